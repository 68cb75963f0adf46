"""What a run prints: preparation, training progress, the perplexity table and where the run went, without other
libraries' chatter. Every filter here names one message of one library and says why it goes; anything else (a real
warning, an error, Lightning's other notes) still shows. ``tests/test_console.py`` checks both sides."""

from __future__ import annotations

import logging
import re
import warnings

from lightning.pytorch.callbacks import ModelSummary, TQDMProgressBar

# litdata's own switch (``optimize(verbose=...)``, used by ``data.prepare``): verbose litdata prints an advert ("Create
# an account on https://lightning.ai/ ..."), its setup steps, per-worker lines and a tqdm bar that, written to a
# file or a pipe, leaves raw cursor-movement escape codes. Preparation reports its own steps as ``[prepare]`` lines;
# litdata's errors come back through its error queue either way.
LITDATA_VERBOSE = False


class DropMessages(logging.Filter):
    """Drops the records of one logger whose message matches ``pattern`` (``re.search``); keeps all others."""

    def __init__(self, pattern: str):
        super().__init__()
        self.pattern = re.compile(pattern)

    def filter(self, record: logging.LogRecord) -> bool:
        return not self.pattern.search(record.getMessage())


_LITLOGGER_TIP = DropMessages(r"^💡 Tip: .*litlogger")


def quiet_library_chatter() -> None:
    """Installs the filters below; idempotent. Called by the command-line entry point (``cli.run``)."""
    # Lightning (2.6) advertises its cloud logger at every run through rank_zero_info; runs here log to TensorBoard.
    # Only that record is dropped: the logger's other notes (GPU available, restored checkpoints) stay.
    rank_zero = logging.getLogger("lightning.pytorch.utilities.rank_zero")
    if _LITLOGGER_TIP not in rank_zero.filters:
        rank_zero.addFilter(_LITLOGGER_TIP)
    # The token stream is a litdata StreamingDataset: an IterableDataset with __len__ (Lightning's epoch length)
    # that gives each loader worker its own share, so Lightning's caution about duplicated data does not apply.
    warnings.filterwarnings("ignore", message=r"Your `IterableDataset` has `__len__` defined")
    # Lightning's own pytree function builds torch's LeafSpec, which torch deprecates; nothing a user can change. Only
    # when raised from that Lightning module: the same deprecation anywhere else still shows.
    warnings.filterwarnings("ignore", message=r"`isinstance\(treespec, LeafSpec\)` is deprecated",
                            category=FutureWarning, module=r"lightning\.pytorch\.utilities\._pytree")


class ParameterSummary(ModelSummary):
    """Lightning's model summary without its FLOPs column and total when they are 0, which they always are here:
    Lightning counts FLOPs only for a model with an ``example_input_array``, and these models have none. Counted
    FLOPs (non-zero) are shown as Lightning shows them. The CLI puts it in place of Lightning's default summary."""

    @staticmethod
    def summarize(summary_data, total_parameters, trainable_parameters, model_size, total_training_modes,
                  total_flops=0, **summarize_kwargs) -> None:
        if total_flops:
            ModelSummary.summarize(summary_data, total_parameters, trainable_parameters, model_size,
                                   total_training_modes, total_flops=total_flops, **summarize_kwargs)
            return
        from lightning.pytorch.utilities.model_summary.model_summary import get_human_readable_count

        columns = [(name, [str(v) for v in values]) for name, values in summary_data if name != "FLOPs"]
        widths = [max([len(name), *map(len, values)]) for name, values in columns]
        rows = [" | ".join(name.ljust(w) for (name, _), w in zip(columns, widths))]
        rows.append("-" * len(rows[0]))
        rows += [" | ".join(values[i].ljust(w) for (_, values), w in zip(columns, widths))
                 for i in range(len(columns[0][1]))]
        rows.append("-" * len(rows[0]))
        rows.append(f"{get_human_readable_count(trainable_parameters):<10}Trainable params")
        rows.append(f"{get_human_readable_count(total_parameters - trainable_parameters):<10}Non-trainable params")
        rows.append(f"{model_size:<10.3f}Total estimated model params size (MB)")
        logging.getLogger("lightning.pytorch.callbacks.model_summary").info("\n" + "\n".join(rows))


class LoggingStepBar(TQDMProgressBar):
    """Lightning's TQDM progress bar, refreshed at the logging steps (every ``log_every_n_steps`` optimizer steps),
    showing the last step's loss and tokens/s. Reading the loss back to the host is a sync on a GPU (it waits for the
    step's kernels): here it is read only where the bar refreshes, where the logger reads it anyway. Lightning reads
    every value logged with ``prog_bar=True`` at every batch's end, and its default bars (TQDM's, or Rich's where rich
    is installed) refresh at every batch; the CLI puts this bar in place of the default."""

    SHOWN = ("train/loss", "tokens_per_sec")  # logged by LanguageModel.training_step

    @property
    def refresh_rate(self) -> int:
        trainer = self._trainer
        return 1 if trainer is None else max(trainer.log_every_n_steps, 1) * trainer.accumulate_grad_batches

    def get_metrics(self, trainer, pl_module) -> dict:
        metrics = super().get_metrics(trainer, pl_module)
        logged = trainer.callback_metrics
        return {**metrics, **{name: logged[name].item() for name in self.SHOWN if name in logged}}
