"""The run's row in TensorBoard's HParams tab: what a researcher compares a sweep's runs by (encoding, model, training
length, learning rate, seed, layout, tasks, experiment) with its perplexity at each evaluated length and its task
scores as the metrics.

Written once, at the run's first evaluation, from the same context its records carry (a validated checkpoint's
seed and layout are known only once it is loaded), with the stage that wrote it (fit, validate, test) and the step its
weights start at (a fit's: 0, or the step it resumed from; a validation's: its checkpoint's), so that the rows a resume
or a validation adds beside the first are told apart. The metrics are the tags of the scalars every evaluation logs
(``val_ppl/len_<L>``, ``tasks/<task>/len_<L>``): the tab shows the last value of each, so it follows the run.
"""

from __future__ import annotations

import lightning as L
from lightning.pytorch.loggers import TensorBoardLogger
from torch.utils.tensorboard.summary import hparams

from ..lit.length_eval import val_tag
from .task_eval import TaskAccuracy, task_tag


class RunHParams(L.Callback):
    """Writes the hyperparameters and metric tags of the run to its TensorBoard events once (rank 0); ``experiment``
    is the CLI's ``--experiment``."""

    def __init__(self, experiment: str):
        self.experiment, self.written = experiment, False

    def on_validation_end(self, trainer, pl_module):
        rows = pl_module.length_results
        logger = trainer.logger
        if self.written or trainer.sanity_checking or not rows or not isinstance(logger, TensorBoardLogger) \
                or not trainer.is_global_zero:
            return
        self.written = True
        context, config = pl_module.run_context, pl_module.config
        tasks = getattr(trainer.datamodule, "tasks", None)
        params = {"experiment": self.experiment, "encoding": context.pe, "preset": config.preset,
                  "n_layer": config.n_layer, "n_embd": config.n_embd, "train_length": context.train_length,
                  "block_size": config.block_size, "lr": context.lr, "seed": context.run_seed,
                  "layout": context.layout or "none",
                  "tasks": "+".join(task.name for task in tasks.tasks) if tasks is not None else "none",
                  # which row is which: a resume or a validation of the run adds a row with the same settings
                  "stage": context.stage, "step": pl_module.loaded_step or 0}
        metrics = [val_tag("ppl", r.length, r.mode) for r in rows if r.ppl is not None]
        scored = [cb.results for cb in trainer.callbacks if isinstance(cb, TaskAccuracy) and cb.active(trainer)]
        metrics += dict.fromkeys(task_tag(r.task, r.length) for results in scored for r in results)
        # torch's summary takes the metric tags only; the end record (its "success") is not written for a running fit
        experiment, session_start, _ = hparams(params, dict.fromkeys(metrics))
        writer = logger.experiment._get_file_writer()  # as Lightning's own log_hyperparams writes them
        writer.add_summary(experiment)
        writer.add_summary(session_start)
