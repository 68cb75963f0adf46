"""Test-only callbacks the CLI loads by class path (this folder is on sys.path under pytest)."""

import hashlib

import lightning as L

BATCHES: list[str] = []
LOSSES: list[float] = []


class RecordBatches(L.Callback):
    """Appends a digest of every training batch to ``BATCHES`` and its loss to ``LOSSES``."""

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        BATCHES.append(hashlib.sha1(batch.cpu().numpy().tobytes()).hexdigest())

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        LOSSES.append(float(outputs["loss"]))


class StopAt(L.Callback):
    """Ends fit after ``step`` optimizer steps without touching max_steps (so the LR schedule is unchanged)."""

    def __init__(self, step: int):
        self.step = step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step >= self.step:
            trainer.should_stop = True
