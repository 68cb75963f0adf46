"""Passkey retrieval after a validation, when enabled: a lengths x depths accuracy grid for the current weights.

It is a callback (``--passkey.enabled true``) rather than a subcommand so that one switch serves both uses a
LightningCLI user has: ``validate --ckpt_path FILE`` for any checkpoint, and ``fit``, where it runs at every
checkpoint's validation and at the end. Rows go to ``<log_dir>/passkey.jsonl``; TensorBoard gets a heatmap and
the mean accuracy per length.
"""

from __future__ import annotations

from typing import Optional

import lightning as L
import torch

from ..errors import ConfigError
from ..eval.passkey import DEFAULT_DEPTHS, PasskeyPrompts, greedy_completion, passkey_grid
from ..records import PasskeyRecord, append_records


def passkey_heatmap(rows: list[PasskeyRecord], title: str):
    """Accuracy per (depth, length) cell; unsupported cells are blank."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    lengths, depths = sorted({r.length for r in rows}), sorted({r.depth for r in rows})
    grid = np.full((len(depths), len(lengths)), np.nan)
    for r in rows:
        if r.accuracy is not None:
            grid[depths.index(r.depth), lengths.index(r.length)] = r.accuracy
    fig, ax = plt.subplots(figsize=(1.2 * len(lengths) + 2.5, 0.6 * len(depths) + 2))
    image = ax.imshow(grid, vmin=0, vmax=1, cmap="RdYlGn", aspect="auto")
    for (i, j), value in np.ndenumerate(grid):
        ax.text(j, i, "-" if np.isnan(value) else f"{value:.2f}", ha="center", va="center", fontsize=8)
    ax.set_xticks(range(len(lengths)), [str(n) for n in lengths])
    ax.set_yticks(range(len(depths)), [f"{d:.0%}" for d in depths])
    ax.set_xlabel("prompt length (tokens)")
    ax.set_ylabel("key depth")
    ax.set_title(title)
    fig.colorbar(image, ax=ax, fraction=0.046)
    fig.tight_layout()
    return fig


class PasskeyRetrieval(L.Callback):
    """Passkey accuracy for each length in ``lengths`` (default: the data's evaluation lengths) and each depth in
    ``depths`` (fractions of the filler before the key), ``trials`` prompts per cell with keys fixed by ``seed``.

    Every rank runs the whole grid (identical results; no collective calls, so any strategy can run it) and
    rank 0 writes it down.
    """

    def __init__(
        self,
        enabled: bool = False,
        lengths: Optional[list[int]] = None,
        depths: list[float] = list(DEFAULT_DEPTHS),
        trials: int = 5,
        seed: int = 0,
    ):
        if trials < 1:
            raise ConfigError(f"passkey.trials must be >= 1, got {trials}")
        if not depths or any(not 0.0 <= d <= 1.0 for d in depths):
            raise ConfigError(f"passkey.depths must be fractions in [0, 1] (0 = start, 1 = end), got {depths}")
        if lengths is not None and (not lengths or min(lengths) < 1):
            raise ConfigError(
                f"passkey.lengths must be positive token counts, or null for data.eval_lengths; got {lengths}"
            )
        self.enabled, self.lengths, self.depths, self.trials, self.seed = enabled, lengths, list(depths), trials, seed
        self.results: list[dict] = []
        self._builder: Optional[PasskeyPrompts] = None

    def prompts(self, trainer) -> PasskeyPrompts:
        if self._builder is None:
            datamodule = trainer.datamodule
            if datamodule is None or not hasattr(datamodule, "load_tokenizer"):
                raise ConfigError(
                    "passkey retrieval needs the data's tokenizer: run it with a TokenDataModule (the data section)"
                )
            self._builder = PasskeyPrompts(datamodule.load_tokenizer())
        return self._builder

    def grid_lengths(self, pl_module) -> list[int]:
        return self.lengths or sorted({length for length, _ in pl_module.eval_specs()})

    def setup(self, trainer, pl_module, stage):
        """Refuse a model that cannot answer, or a length too short for the prompt's fixed text, before any training
        or evaluation runs (the prompts of the shortest length are built once here)."""
        if not self.enabled:
            return
        if not pl_module.backbone.causal:
            raise ConfigError(
                "passkey retrieval needs a causal LM (it decodes an answer); this model is a masked LM: "
                "leave passkey.enabled false"
            )
        builder, shortest = self.prompts(trainer), min(self.grid_lengths(pl_module))
        for trial in range(self.trials):  # each trial has its own key, whose length in tokens may differ
            builder.sample(shortest, 0.0, trial, self.seed)

    def on_validation_end(self, trainer, pl_module):
        if not self.enabled or trainer.sanity_checking:
            return
        lengths = self.grid_lengths(pl_module)
        backbone, was_training = pl_module.backbone, pl_module.backbone.training
        backbone.eval()
        try:
            with torch.no_grad():
                grid = passkey_grid(
                    greedy_completion(backbone),
                    self.prompts(trainer),
                    lengths,
                    self.depths,
                    self.trials,
                    self.seed,
                    device=pl_module.device,
                )
        finally:
            backbone.train(was_training)
        measured = pl_module.length_results[0] if pl_module.length_results else None  # this validation's step
        step = measured.step if measured else trainer.global_step
        checkpoint = measured.checkpoint if measured else None
        config = pl_module.config
        self.results = [PasskeyRecord(pe=config.pos_encoding.label(), train_length=config.block_size, step=step,
                                      stage=trainer.state.fn.value, checkpoint=checkpoint,
                                      run_seed=getattr(pl_module, "run_seed", None), seed=self.seed, **row)
                        for row in grid]
        log_dir = trainer.log_dir or trainer.default_root_dir  # a broadcast under DDP: every rank must ask
        if not trainer.is_global_zero:
            return
        append_records(log_dir, self.results)
        pe, train_length = self.results[0].pe, self.results[0].train_length
        experiment = getattr(trainer.logger, "experiment", None)
        if hasattr(experiment, "add_figure"):
            title = f"passkey accuracy: {pe}, trained at {train_length}, step {step}"
            experiment.add_figure("passkey/accuracy", passkey_heatmap(self.results, title), step)
            for length in lengths:
                cells = [r.accuracy for r in self.results if r.length == length and r.accuracy is not None]
                if cells:
                    experiment.add_scalar(f"passkey/len_{length}", sum(cells) / len(cells), step)
        summary = "  ".join(f"{length}: {format_accuracy(self.results, length)}" for length in lengths)
        print(
            f"passkey accuracy by length ({pe}, {self.trials} trials x {len(self.depths)} depths, "
            f"step {step}): {summary}",
            flush=True,
        )


def format_accuracy(rows: list[PasskeyRecord], length: int) -> str:
    cells = [r.accuracy for r in rows if r.length == length]
    if not cells or any(c is None for c in cells):
        return "-"
    return f"{sum(cells) / len(cells):.2f}"
