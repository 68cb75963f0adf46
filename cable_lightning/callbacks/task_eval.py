"""Task accuracy after every validation of a run that trains on synthetic tasks (``--data.tasks``): exact match per
task, evaluation length and depth, in ``<log_dir>/task_accuracy.jsonl`` beside ``length_eval.jsonl``, a TensorBoard
heatmap (``tasks/accuracy``) and the mean per length (``tasks/<task>/len_<L>``).

A callback, so that it runs at every checkpoint's validation inside ``fit`` and on
``validate --ckpt_path FILE``. Every rank scores the whole grid (identical results, no collectives) and rank 0
writes it down.
"""

from __future__ import annotations

from typing import Optional

import lightning as L
import torch

from ..data.lengths import Lengths, length_list
from ..errors import ConfigError
from ..figures import accuracy_heatmap
from ..records.io import append_records
from ..records.schema import TaskRecord
from ..tasks.scoring import DEFAULT_DEPTHS, task_grid


def row_label(record: TaskRecord) -> str:
    return record.task if record.depth is None else f"{record.task} @ {record.depth:.0%}"


def task_tag(task: str, length: int) -> str:
    """The TensorBoard tag of a task's mean accuracy at a length (an HParams tab metric: callbacks/hparams.py)."""
    return f"tasks/{task}/len_{length}"


def mean_accuracy(rows: list[TaskRecord], task: str, length: int) -> Optional[float]:
    """A task's accuracy at a length, averaged over depths; None where any cell could not be run."""
    cells = [r.accuracy for r in rows if r.task == task and r.length == length]
    return None if not cells or None in cells else sum(cells) / len(cells)


class TaskAccuracy(L.Callback):
    """Exact-match accuracy on the data's tasks at each length in ``lengths`` (default: the data's evaluation
    lengths) and, for tasks that place their fact (the needle), each depth in ``depths``; ``trials`` examples per
    cell, evaluation examples of ``seed`` (never training rows), scored ``batch_size`` at a time. ``enabled``: None
    runs it when the data has tasks."""

    def __init__(self, enabled: Optional[bool] = None, lengths: Optional[Lengths] = None,
                 depths: list[float] = list(DEFAULT_DEPTHS), trials: int = 32, seed: int = 0, batch_size: int = 16):
        if trials < 1 or batch_size < 1:
            raise ConfigError(f"task_eval.trials and task_eval.batch_size must be >= 1, got {trials} and {batch_size}")
        if not depths or any(not 0.0 <= d <= 1.0 for d in depths):
            raise ConfigError(f"task_eval.depths must be fractions in [0, 1] (0 = start, 1 = end), got {depths}")
        lengths = None if lengths is None else length_list(lengths, "task_eval.lengths")
        self.enabled, self.lengths, self.depths = enabled, lengths, list(depths)
        self.trials, self.seed, self.batch_size = trials, seed, batch_size
        self.results: list[TaskRecord] = []

    def mix(self, trainer):
        return getattr(trainer.datamodule, "tasks", None)

    def active(self, trainer) -> bool:
        return self.enabled is not False and self.mix(trainer) is not None

    def grid_lengths(self, pl_module) -> list[int]:
        return sorted(self.lengths or {length for length, _ in pl_module.eval_specs()})

    def setup(self, trainer, pl_module, stage):
        """Refuse what cannot be scored before any training or evaluation runs."""
        if self.enabled and self.mix(trainer) is None:
            raise ConfigError("task_eval.enabled is true but the data has no tasks; set data.tasks")
        if not self.active(trainer):
            return
        shortest, longest = min(self.grid_lengths(pl_module)), max(self.grid_lengths(pl_module))
        try:
            self.mix(trainer).check_length(shortest)
        except ConfigError as exc:
            raise ConfigError(f"evaluation length {shortest} is too short for a task: {exc}") from None
        layout = pl_module.layout
        for task in self.mix(trainer).tasks:  # a masked LM trained at randomized positions is asked at them too
            if task.length_is_input and layout.positions == "randomized" and \
                    (tokens := task.tokens_read(longest)) > layout.position_range:
                raise ConfigError(f"task {task.name} at evaluation length {longest} reads {tokens} tokens, more than "
                                  f"data.layout.position_range {layout.position_range} randomized positions; raise it "
                                  f"to >= {tokens} or evaluate shorter lengths")

    def on_validation_end(self, trainer, pl_module):
        if not self.active(trainer) or trainer.sanity_checking:
            return
        lengths = self.grid_lengths(pl_module)
        backbone, was_training = pl_module.backbone, pl_module.backbone.training
        backbone.eval()
        try:
            with torch.no_grad(), trainer.precision_plugin.forward_context():  # as validation_step runs
                grid = task_grid(pl_module.task_predictions(), self.mix(trainer), lengths, self.depths, self.trials,
                                 self.seed, self.batch_size, pl_module.device)
        finally:
            backbone.train(was_training)
        self.results = [TaskRecord(**pl_module.run_context, seed=self.seed, **row) for row in grid]
        step = pl_module.run_context.step
        log_dir = trainer.log_dir or trainer.default_root_dir  # a broadcast under DDP: every rank must ask
        if not trainer.is_global_zero:
            return
        append_records(log_dir, self.results)
        pe, tasks = self.results[0].pe, list(dict.fromkeys(r.task for r in self.results))
        experiment = getattr(trainer.logger, "experiment", None)
        if hasattr(experiment, "add_figure"):
            labels = list(dict.fromkeys(row_label(r) for r in self.results))
            cells = {(row_label(r), r.length): r.accuracy for r in self.results}
            title = f"task accuracy: {pe}, trained at {pl_module.config.block_size}, step {step}"
            experiment.add_figure("tasks/accuracy", accuracy_heatmap(labels, lengths, cells, title, "task"), step)
            for task in tasks:
                for length in lengths:
                    if (value := mean_accuracy(self.results, task, length)) is not None:
                        experiment.add_scalar(task_tag(task, length), value, step)
        for task in tasks:
            summary = "  ".join(f"{length}: {format_accuracy(mean_accuracy(self.results, task, length))}"
                                for length in lengths)
            print(f"{task} accuracy by length ({pe}, {self.trials} trials, step {step}): {summary}", flush=True)
            above = [n for n in lengths if n > pl_module.config.original_length]
            scores = [mean_accuracy(self.results, task, n) for n in above]
            per_token = any(r.scoring == "per_token" for r in self.results if r.task == task)
            if per_token and scores:  # the papers' score: the mean over the lengths above training
                score = None if None in scores else sum(scores) / len(scores)
                unsupported = [str(n) for n, value in zip(above, scores) if value is None]
                print(f"{task} score ({pe}, per-token accuracy over the {len(scores)} evaluated lengths "
                      f"{min(above)}-{max(lengths)}): {format_accuracy(score)}"
                      + (f" (the encoding cannot read lengths {', '.join(unsupported)}; recorded as unsupported)"
                         if unsupported else ""), flush=True)


def format_accuracy(value: Optional[float]) -> str:
    return "-" if value is None else f"{value:.2f}"
