"""Perplexity-vs-length records after every validation: JSONL rows, TensorBoard figures, a printed table.

Two files per run folder: ``length_eval.jsonl`` (one row per length and window mode) and ``position_loss.jsonl``
(one row per length and position bucket of the non-overlapping windows), kept apart so that each file has one
row shape and readers of the perplexity table never see bucket rows.

The numbers themselves come from the LightningModule's validation loop (one loader per length and
window mode, DDP-reduced by torchmetrics); this callback only writes them down on rank 0.
"""

from __future__ import annotations

import sys

import lightning as L

from ..eval.tables import format_value
from ..figures import position_figure, ppl_figure
from ..records.io import append_records
from ..records.schema import LengthRecord, PositionRecord


def format_table(rows: list[LengthRecord], train_length: int) -> str:
    modes = sorted({r.mode for r in rows})
    by_key = {(r.length, r.mode): r for r in rows}
    lines = ["length  (x train)  " + "  ".join(f"{m:>12}" for m in modes)]
    for length in sorted({r.length for r in rows}):
        cells = []
        for m in modes:
            r = by_key.get((length, m))
            cells.append(f"{'-' if r is None or r.ppl is None else format_value(r.ppl):>12}")
        lines.append(f"{length:>6}  {length / train_length:>8g}x  " + "  ".join(cells))
    return "\n".join(lines)


class LengthEvalRecorder(L.Callback):
    """Writes the module's :class:`LengthRecord` rows to ``<log_dir>/length_eval.jsonl`` and its
    :class:`PositionRecord` rows to ``<log_dir>/position_loss.jsonl``, logs a perplexity-vs-length and a
    loss-vs-position figure to TensorBoard, and prints the table."""

    def __init__(self, print_table: bool = True, figure: bool = True):
        self.print_table, self.figure = print_table, figure

    def on_validation_end(self, trainer, pl_module):
        rows: list[LengthRecord] = pl_module.length_results
        if trainer.sanity_checking or not rows:
            return
        log_dir = trainer.log_dir or trainer.default_root_dir  # a broadcast under DDP: every rank must ask
        if not trainer.is_global_zero:
            return
        position_rows: list[PositionRecord] = pl_module.position_results
        append_records(log_dir, rows + position_rows)
        first = rows[0]
        experiment = getattr(trainer.logger, "experiment", None)
        if self.figure and hasattr(experiment, "add_figure"):
            title = f"{first.pe}, step {first.step}"
            series = {mode: [(r.length, r.ppl) for r in rows if r.mode == mode]
                      for mode in sorted({r.mode for r in rows})}
            experiment.add_figure("val_ppl_vs_length", ppl_figure(series, title, first.train_length), first.step)
            if position_rows:
                figure = position_figure(position_rows, title, first.train_length)
                experiment.add_figure("val_loss_vs_position", figure, first.step)
        if self.print_table:
            print(f"validation perplexity by length ({first.pe}, trained at {first.train_length} tokens, "
                  f"step {first.step}):\n{format_table(rows, first.train_length)}", flush=True)
        vocab = pl_module.config.vocab_size
        data = trainer.datamodule
        if getattr(data, "tasks", None) is not None and data.task_fraction == 1 and data.lm_loss_weight == 0:
            return  # trained on task answers alone: no token the perplexity scores was ever a target
        for r in rows:  # past the training length a high perplexity is the measurement; at it, a broken run
            if r.length == r.train_length and r.ppl is not None and r.ppl > vocab:
                print(f"warning: perplexity {format_value(r.ppl)} at the training length {r.length} (step {r.step}) "
                      f"is above the vocabulary size {vocab}, worse than guessing every token: the model is not "
                      "learning; lower the learning rate (--model.init_args.lr)", file=sys.stderr, flush=True)
                break
