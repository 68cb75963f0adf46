"""Test-only callbacks for the 2-process tests: for DDP, the initial weights, each rank's first batch, and each rank's
weights after the first and the last optimizer step; for FSDP, each step's loss."""

import json
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


class Losses(L.Callback):
    """Writes each optimizer step's training loss and epoch (rank 0) to ``<out_dir>/losses.jsonl``, one line per
    step."""

    def __init__(self, out_dir: str):
        self.out_dir = out_dir

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.is_global_zero:
            os.makedirs(self.out_dir, exist_ok=True)
            with open(os.path.join(self.out_dir, "losses.jsonl"), "a") as f:
                f.write(json.dumps({"step": trainer.global_step, "epoch": trainer.current_epoch,
                                    "loss": float(outputs["loss"])}) + "\n")



class Windows(L.Callback):
    """Writes each micro-batch's windows (one digest per row), the optimizer step it trains towards and the epoch to
    ``<out_dir>/windows_rank<r>.jsonl``, one line per micro-batch: which data each step of each rank saw."""

    def __init__(self, out_dir: str):
        self.out_dir = out_dir

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        import hashlib

        os.makedirs(self.out_dir, exist_ok=True)
        rows = [hashlib.sha1(row.cpu().numpy().tobytes()).hexdigest()[:16] for row in batch]
        with open(os.path.join(self.out_dir, f"windows_rank{trainer.global_rank}.jsonl"), "a") as f:
            f.write(json.dumps({"step": trainer.global_step + 1, "epoch": trainer.current_epoch, "rows": rows}) + "\n")
