"""Training throughput in TensorBoard: tokens/s, samples/s, MFU (Lightning's ThroughputMonitor with
the model's FLOPs per batch) and, on CUDA, peak memory per step."""

from __future__ import annotations

import warnings

import torch
from lightning.pytorch.callbacks import ThroughputMonitor

from cable_lightning.hardware import peak_flops


def _tokens(batch):
    return batch["tokens"] if isinstance(batch, dict) else batch  # validation batches are dicts


def _samples(batch) -> int:
    return _tokens(batch).shape[0]


def _tokens_per_sample(batch) -> int:
    return _tokens(batch).shape[1] - 1  # a row holds block + 1 tokens (inputs and shifted targets)


class TokenThroughput(ThroughputMonitor):
    """ThroughputMonitor for (B, block + 1) token batches. On CUDA, MFU divides by the project's peak
    (:func:`cable_lightning.hardware.peak_flops`: the datasheet dense bf16 peak, or a measured matmul for a GPU its
    table lacks), not Lightning's table, which has no H200; the CPU gets tokens/s and samples/s."""

    def __init__(self, window_size: int = 20, log_peak_memory: bool = True):
        super().__init__(batch_size_fn=_samples, length_fn=_tokens_per_sample, window_size=window_size)
        self.log_peak_memory = log_peak_memory

    def setup(self, trainer, pl_module, stage):
        with warnings.catch_warnings():  # Lightning's lookup, replaced below, warns for a GPU its table lacks
            warnings.filterwarnings("ignore", message="FLOPs not found")
            super().setup(trainer, pl_module, stage)
        device = trainer.strategy.root_device
        if device.type != "cuda":
            return
        self.available_flops, source = peak_flops(device)
        for throughput in self._throughputs.values():
            throughput.available_flops = self.available_flops
        if trainer.is_global_zero:
            print(f"MFU against {source}: {self.available_flops / 1e12:.0f} TFLOP/s", flush=True)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
        if self.log_peak_memory and torch.cuda.is_available() and pl_module.device.type == "cuda":
            pl_module.log("train/peak_memory_gib", torch.cuda.max_memory_allocated(pl_module.device) / 2**30)
            torch.cuda.reset_peak_memory_stats(pl_module.device)
