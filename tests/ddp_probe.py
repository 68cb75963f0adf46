"""Test-only callback for the 2-process DDP test: saves the initial weights, each rank's first batch,
and each rank's weights after the first and the last optimizer step."""

import os

import lightning as L
import torch


class Probe(L.Callback):
    def __init__(self, out_dir: str):
        self.out_dir = out_dir

    def _save(self, obj, name, trainer):
        os.makedirs(self.out_dir, exist_ok=True)
        torch.save(obj, os.path.join(self.out_dir, f"{name}_rank{trainer.global_rank}.pt"))

    def _weights(self, pl_module):
        return {k: v.detach().clone() for k, v in pl_module.backbone.state_dict().items()}

    def on_train_start(self, trainer, pl_module):
        self._save(self._weights(pl_module), "init", trainer)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step == 0:
            self._save(batch.clone(), "batch0", trainer)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step == 1:
            self._save(self._weights(pl_module), "step1", trainer)

    def on_train_end(self, trainer, pl_module):
        self._save(self._weights(pl_module), "final", trainer)
