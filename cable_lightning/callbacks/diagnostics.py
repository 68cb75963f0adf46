"""Attention diagnostics at validations (docs/diagnostics.md): per layer and head, at every evaluation length,
the entropy, distance, sink and locality of the weights attention applies and its largest logit
(``<log_dir>/attention.jsonl``), and what the whole window gains over the training length on the tokens that need it
(``<log_dir>/long_context.jsonl``); TensorBoard figures of each quantity against length, a line per layer. For an
encoding built on per-token increments (CABLE, its variants, FoX, DAPEv2 over them), their share of exact zeros and
their distribution per layer, head and set of tokens (``<log_dir>/increments.jsonl``), and for a task run how far
apart the final hidden states of its first two answer positions are (``<log_dir>/hidden_pairs.jsonl``, any
encoding): docs/diagnostics.md#increments.

A callback, so it runs at checkpoints' validations inside ``fit`` and on ``validate --ckpt_path FILE``: every
``validate``, the first and the last validation of a fit, and the others while their cost stays within ``budget``
times the length evaluation's (on a GPU they cost many times the fused evaluation: docs/diagnostics.md#cost). The
windows are the first ``windows`` non-overlapping windows of each length of the validation stream, the same whatever
the number of ranks; rank 0 computes and writes them (a sharded FSDP2 model's weights are on no one rank: none there).
"""

from __future__ import annotations

import math
from typing import Optional

import lightning as L
import numpy as np
import torch
from torch.distributed.fsdp import FSDPModule

from ..data.windows import EvalWindows
from ..errors import ConfigError
from ..eval.diagnostics import (
    DEFAULT_SINK,
    DEFAULT_THRESHOLD,
    QUANTITIES,
    diagnose,
    has_increments,
    increment_diagnostics,
)
from ..figures import line_figure
from ..positional import UnsupportedLengthError
from ..records.io import append_records
from ..records.schema import AttentionRecord, HiddenPairRecord, IncrementRecord, LongContextRecord
from ..tasks.generation import EVAL


class AttentionDiagnostics(L.Callback):
    """Diagnostics of ``windows`` windows per evaluation length: ``sink`` first positions, ``local`` latest ones
    (default an eighth of the training length), key tokens by a loss drop of ``threshold`` nats against windows of the
    training length advancing by ``short_stride`` (default a quarter of it), run ``batch_size`` at a time (default
    all of a length's in one forward). In a fit, a validation other than the first and the last runs them only while
    their seconds so far stay within ``budget`` times the length evaluations' (this one's included); ``budget``
    None runs them at every validation. The increments of a task run are read on its first task's first
    ``examples`` evaluation examples per length, those of any other run on the windows."""

    def __init__(self, enabled: bool = True, windows: int = 2, sink: int = DEFAULT_SINK, local: Optional[int] = None,
                 threshold: float = DEFAULT_THRESHOLD, short_stride: Optional[int] = None,
                 batch_size: Optional[int] = None, budget: Optional[float] = 0.5, examples: int = 16):
        for name, value, low in (("windows", windows, 1), ("sink", sink, 1), ("local", local, 1),
                                 ("short_stride", short_stride, 1), ("batch_size", batch_size, 1),
                                 ("examples", examples, 1)):
            if value is not None and value < low:
                raise ConfigError(f"diagnostics.{name} must be >= {low}, got {value}")
        if not threshold > 0:
            raise ConfigError(f"diagnostics.threshold must be > 0 nats, got {threshold}")
        if budget is not None and not budget > 0:
            raise ConfigError(f"diagnostics.budget must be > 0 (times the length evaluation) or null (every "
                              f"validation), got {budget}")
        self.enabled, self.windows, self.sink, self.local = enabled, windows, sink, local
        self.threshold, self.short_stride, self.batch_size, self.budget = threshold, short_stride, batch_size, budget
        self.examples = examples
        self.attention: list[AttentionRecord] = []
        self.long_context: list[LongContextRecord] = []
        self.increments: list[IncrementRecord] = []
        self.pairs: list[HiddenPairRecord] = []
        self.spent = self.evaluated = 0.0  # seconds of this process's diagnostics and length evaluations
        self.runs = 0

    def due(self, final: bool) -> bool:
        """Whether this validation runs them: the first, a ``final`` one (a ``validate``, a fit's last), or while the
        seconds spent so far are within the budget."""
        return self.budget is None or final or self.runs == 0 or self.spent <= self.budget * self.evaluated

    def window_batch(self, stream: torch.Tensor, length: int) -> torch.Tensor:
        """(n, length + 1) tokens: the first ``windows`` non-overlapping windows of ``length`` (fewer if the stream
        is short)."""
        windows = EvalWindows(stream, length, length)
        return torch.stack([windows[i]["tokens"] for i in range(min(self.windows, len(windows)))])

    def on_validation_end(self, trainer, pl_module):
        if not self.enabled or trainer.sanity_checking:
            return
        log_dir = trainer.log_dir or trainer.default_root_dir  # a broadcast under DDP: every rank must ask
        stream_of = getattr(trainer.datamodule, "eval_stream", None)
        if not trainer.is_global_zero or stream_of is None or isinstance(pl_module.backbone, FSDPModule):
            return
        stream = stream_of("val")
        config, backbone = pl_module.config, pl_module.backbone
        context = pl_module.run_context  # this validation's run, step and checkpoint, as its length records
        evaluation = sum(r.seconds or 0.0 for r in pl_module.length_results)
        self.evaluated += evaluation
        final = trainer.state.fn != "fit" or 0 < trainer.max_steps <= trainer.global_step
        self.attention, self.long_context, self.increments, self.pairs = [], [], [], []
        if not self.due(final):
            print(f"attention diagnostics skipped at step {context['step']}: {self.spent:.1f} s so far against "
                  f"{self.evaluated:.1f} s of length evaluation, above the budget of {self.budget:g}x "
                  "(--diagnostics.budget null runs them at every validation)", flush=True)
            return
        was_training = backbone.training
        backbone.eval()
        seconds = 0.0
        # At the trainer's precision, as validation_step runs (Lightning's hooks run outside it): a bf16-mixed
        # run's diagnostics once ran in fp32, numbers other than its evaluation's, and compiled FlexAttention again
        try:
            with trainer.precision_plugin.forward_context():
                for length in sorted({length for length, _ in pl_module.eval_specs()}):
                    tokens = self.window_batch(stream, length).to(pl_module.device)
                    starts = torch.arange(len(tokens), device=tokens.device) * length
                    inputs, targets = pl_module.split_batch(tokens, train=False, start=starts)
                    try:
                        found = diagnose(backbone, inputs, targets, config.block_size, self.sink, self.local,
                                         self.threshold, self.short_stride, self.batch_size)
                    except UnsupportedLengthError:
                        continue  # the length record says so
                    seconds += found.seconds
                    local = self.local or max(1, config.block_size // 8)
                    self.attention += [AttentionRecord(**context, length=length, windows=found.windows, sink=self.sink,
                                                       local=local, seconds=round(found.seconds, 3), **row)
                                       for row in found.attention]
                    if found.gain is not None:
                        self.long_context.append(LongContextRecord(
                            **context, length=length, context=config.block_size, threshold=self.threshold,
                            stride=self.short_stride or max(1, config.block_size // 4), windows=found.windows,
                            **vars(found.gain)))
                    read = self.increment_inputs(trainer, pl_module, length, inputs)
                    if read is None:
                        continue
                    name, read_ids, tokens, pair, layout = read
                    try:
                        measured = increment_diagnostics(backbone, read_ids, tokens, pair, layout)
                    except UnsupportedLengthError as err:  # a task's rows outgrow the length: the rest is kept
                        print(f"increment diagnostics at length {length} ({name}) skipped: {err}", flush=True)
                        continue
                    seconds += measured.seconds
                    where = dict(context, length=length, inputs=name, examples=len(read_ids))
                    self.increments += [IncrementRecord(**where, **row) for row in measured.increments]
                    if measured.pair is not None:
                        self.pairs.append(HiddenPairRecord(**where, pair="answer 1, answer 2", **{
                            f"difference_{k}": measured.pair[k] for k in ("mean", "min", "max")}))
                    print(increment_summary(context["pe"], length, name, self.increments, self.pairs), flush=True)
        finally:
            backbone.train(was_training)
        append_records(log_dir, self.attention + self.long_context + self.increments + self.pairs)
        self.spent, self.runs = self.spent + seconds, self.runs + 1
        print(f"attention diagnostics ({context['pe']}, step {context['step']}, {self.windows} windows per length): "
              f"{seconds:.1f} s, the length evaluation {evaluation:.1f} s", flush=True)
        experiment = getattr(trainer.logger, "experiment", None)
        if hasattr(experiment, "add_figure") and self.attention:
            self.log_figures(experiment, context)

    def increment_inputs(self, trainer, pl_module, length: int, windows: torch.Tensor) -> Optional[tuple]:
        """What the increment diagnostics read at ``length``: (its name, the inputs (B, L), the sets of tokens
        (name -> (B, L) bool), the pair of positions or None, their Layout or None). A task run's first task's first
        ``examples`` evaluation examples as the model reads them (at the positions its task evaluation reads them,
        the answer positions, the pair its first two, and the vocabulary's markers, symbols and filler) where the
        task fits ``length``, else the ``windows`` at 0, 1, 2, ... as the length evaluation reads them; the mask
        token's positions for a masked LM. None where there is nothing to measure: no increments and no pair."""
        data, mask_id = trainer.datamodule, getattr(pl_module, "mask_id", None)
        mix, pair, layout = getattr(data, "tasks", None), None, None
        task = mix.tasks[0] if mix is not None else None
        shortest = task.fixed_tokens(mix.vocab) if task is not None else None
        if task is not None and (shortest is None or length >= shortest):  # else the windows (a passkey at 32)
            examples = [mix.example(length + 1, data.seed, EVAL, i, task=task) for i in range(self.examples)]
            ids = torch.from_numpy(np.stack([e.ids for e in examples])).to(pl_module.device)
            answer = torch.from_numpy(np.stack([e.answer for e in examples]))[:, 1:].to(pl_module.device)
            read, name = pl_module.task_inputs(ids, answer), f"task:{task.name}"
            layout = pl_module.task_layout()(read)
            tokens = {"all": torch.ones_like(answer), "answer": answer}
            if mix.vocab is not None:
                roles = {"marker": list(mix.vocab.markers.values()), "symbol": mix.vocab.symbols,
                         "filler": mix.vocab.filler}
                tokens |= {role: torch.isin(read, torch.as_tensor(np.asarray(ids_), device=read.device))
                           for role, ids_ in roles.items()}
            if min(int(e.answer[1:].sum()) for e in examples) >= 2:
                first_two = np.stack([np.flatnonzero(e.answer[1:])[:2] for e in examples])
                pair = tuple(torch.from_numpy(first_two[:, k]).to(pl_module.device) for k in range(2))
        else:
            read, name = windows, "windows"
            tokens = {"all": torch.ones_like(windows, dtype=torch.bool)}
        if mask_id is not None:
            tokens["mask"] = read == mask_id
        if pair is None and not has_increments(pl_module.backbone):
            return None
        return name, read, tokens, pair, layout

    def log_figures(self, experiment, context: dict) -> None:
        """One figure per quantity against length, a line per layer (the mean over heads; max_logit the maximum);
        the key tokens' loss and share as scalars per length."""
        layers = sorted({r.layer for r in self.attention})
        for name in QUANTITIES:
            series = {}
            for layer in layers:
                points = []
                for length in sorted({r.length for r in self.attention}):
                    values = [getattr(r, name) for r in self.attention if r.layer == layer and r.length == length]
                    values = [v for v in values if v is not None]
                    if values:
                        points.append((length, max(values) if name == "max_logit" else sum(values) / len(values)))
                series[f"layer {layer}"] = points
            title = f"{context['pe']}: attention {name} by layer, step {context['step']}"
            figure = line_figure(series, title, context["train_length"], "evaluation length (tokens)", name,
                                 log_y=False)
            experiment.add_figure(f"attention/{name}", figure, context["step"])
        for r in self.long_context:
            if r.tokens:
                experiment.add_scalar(f"long_context/key_share/len_{r.length}", r.key_tokens / r.tokens,
                                      context["step"])
            if r.key_loss is not None and math.isfinite(r.key_loss):
                experiment.add_scalar(f"long_context/key_loss/len_{r.length}", r.key_loss, context["step"])


def increment_summary(pe: str, length: int, inputs: str, increments: list[IncrementRecord],
                      pairs: list[HiddenPairRecord]) -> str:
    """One line: per set of tokens, the share of increments exactly 0 per layer (the mean over heads) and the mean
    weight; the pair's relative difference."""
    rows = [r for r in increments if r.length == length]
    parts = []
    for tokens in dict.fromkeys(r.tokens for r in rows if r.tokens in ("all", "mask", "answer")):
        layers = sorted({r.layer for r in rows})
        shares = []
        for layer in layers:
            values = [r.zero_share for r in rows if r.quantity == "increment" and r.tokens == tokens
                      and r.layer == layer]
            shares.append(f"{sum(values) / len(values):.0%}" if values else "-")
        weights = [r.mean for r in rows if r.quantity == "weight" and r.tokens == tokens]
        weight = f", weight mean {sum(weights) / len(weights):.3f}" if weights else ""
        parts.append(f"{tokens}: increment = 0 at {'/'.join(shares)} (layers {'/'.join(map(str, layers))}){weight}")
    if not rows:
        parts.append("no per-token increments")
    pair = [p for p in pairs if p.length == length]
    if pair:
        parts.append(f"answer 1 vs 2 final hidden states: relative difference {pair[0].difference_mean:.3g} "
                     f"(min {pair[0].difference_min:.3g})")
    return f"increments ({pe}, length {length}, {inputs}): " + "; ".join(parts)
