"""Test-only callbacks for the 2-process tests: for DDP, the initial weights, each rank's first batch, and each rank's
weights after the first and the last optimizer step; for FSDP, each step's loss; for two nodes, which windows each
rank reads, and the loss of a node."""

import hashlib
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
    """Writes what this rank trains on to ``<out_dir>/windows_rank<r>.jsonl``: first how Lightning placed it (world
    size, node and global rank, cluster environment), then one line per micro-batch: the optimizer step it belongs
    to, the epoch and a digest of each window (row), so a test can tell which windows each node read."""

    def __init__(self, out_dir: str):
        self.out_dir = out_dir

    def _write(self, trainer, row):
        os.makedirs(self.out_dir, exist_ok=True)
        with open(os.path.join(self.out_dir, f"windows_rank{trainer.global_rank}.jsonl"), "a") as f:
            f.write(json.dumps(row) + "\n")

    def on_train_start(self, trainer, pl_module):
        environment = type(trainer._accelerator_connector.cluster_environment).__name__
        self._write(trainer, {"world_size": trainer.world_size, "num_nodes": trainer.num_nodes,
                              "node_rank": trainer.node_rank, "global_rank": trainer.global_rank,
                              "environment": environment})

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        rows = [hashlib.sha1(row.cpu().numpy().tobytes()).hexdigest()[:16] for row in batch]
        self._write(trainer, {"step": trainer.global_step + 1, "epoch": trainer.current_epoch, "windows": rows})


class KillNodeAt(L.Callback):
    """On global rank ``rank``, SIGKILLs the node's launcher (torchrun, this process's parent) and then this process
    as its ``batch``-th micro-batch starts (1-based, counted in this process): a node lost, nothing saved."""

    def __init__(self, batch: int, rank: int = 1):
        self.batch, self.rank, self.seen = batch, rank, 0

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.seen += 1
        if self.seen == self.batch and trainer.global_rank == self.rank:
            import signal

            os.kill(os.getppid(), signal.SIGKILL)
            os.kill(os.getpid(), signal.SIGKILL)


class SignalAt(L.Callback):
    """On global rank ``rank``, sends ``signame`` to this process as its ``batch``-th micro-batch starts (1-based,
    counted in this process): with accumulation 2 and an even ``batch``, in the middle of an optimizer step."""

    def __init__(self, batch: int, rank: int = 0, signame: str = "SIGUSR1"):
        self.batch, self.rank, self.signame, self.seen = batch, rank, signame, 0

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.seen += 1
        if self.seen == self.batch and trainer.global_rank == self.rank:
            import signal

            os.kill(os.getpid(), getattr(signal, self.signame))
