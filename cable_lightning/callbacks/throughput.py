"""Training throughput in TensorBoard: tokens/s, samples/s, MFU (Lightning's ``Throughput`` with the model's FLOPs per
batch) and, on CUDA, peak memory, written at the logging steps only; and at the end of a fit, its steady tokens/s and
MFU as a record (``throughput.jsonl``, :class:`records.schema.ThroughputRecord`), beside the run's length records."""

from __future__ import annotations

import torch
from lightning.fabric.utilities.throughput import Throughput
from lightning.pytorch.callbacks import Callback

from cable_lightning.errors import ConfigError
from cable_lightning.hardware import peak_flops
from cable_lightning.lit.resume import global_batch
from cable_lightning.records.io import append_records
from cable_lightning.records.schema import ThroughputRecord
from cable_lightning.timing import synced_time

# Optimizer steps a fit's steady rate leaves out: compiling happens in them (gpu-check's fits time after as many)
WARMUP_STEPS = 3


class TokenThroughput(Callback):
    """Tokens/s, samples/s and MFU of training, over the last ``window_size - 1`` intervals between logging steps.

    Lightning's ``ThroughputMonitor`` synchronized the device at every batch to read its clock: on a GPU a second
    host sync in every step beside the divergence check. Here the clock is read, the device synchronized first, only
    where a rate is computed: at the logging steps (``trainer.log_every_n_steps``), and at a validation's start and
    end, whose time is left out. The rates are written to the loggers as numbers (``self.log`` would copy each to the
    device, a sync on a GPU). On CUDA, MFU divides by the project's peak (:func:`cable_lightning.hardware.peak_flops`:
    the datasheet dense bf16 peak, or a measured matmul for a GPU its table lacks; Lightning's table has no H200), and
    ``train/peak_memory_gib`` is the peak since the last logging step; the CPU gets tokens/s and samples/s.

    The fit's steady rate, recorded at its end (:meth:`on_train_end`): from the first logging step at or after
    ``warmup`` optimizer steps (compiling is in them) to the last logging step, on the same clock reads, validations
    left out; a fit with no logging step after that records no rate."""

    def __init__(self, window_size: int = 2, log_peak_memory: bool = True, warmup: int = WARMUP_STEPS):
        if window_size < 2:
            raise ConfigError(f"throughput.window_size is {window_size}; a rate needs at least 2 logging steps")
        if warmup < 0:
            raise ConfigError(f"throughput.warmup is {warmup}; give the optimizer steps to leave out, 0 or more")
        self.window_size, self.log_peak_memory, self.warmup = window_size, log_peak_memory, warmup
        self.available_flops = None
        self.throughput = Throughput(window_size=window_size)

    def setup(self, trainer, pl_module, stage):
        self.device = trainer.strategy.root_device
        self.available_flops = None
        if self.device.type == "cuda":
            self.available_flops, source = peak_flops(self.device)
            if trainer.is_global_zero:
                print(f"MFU against {source}: {self.available_flops / 1e12:.0f} TFLOP/s", flush=True)
        self.throughput = Throughput(available_flops=self.available_flops, world_size=trainer.world_size,
                                     window_size=self.window_size)

    def on_train_start(self, trainer, pl_module):
        self.throughput.reset()
        self.batches = self.samples = self.tokens = 0
        self.flops, self.paused, self.start = 0.0, 0.0, synced_time(self.device)
        # (seconds, tokens, flops, optimizer steps) at the steady phase's first logging step, and at the last one
        self.all_flops, self.steady, self.last, self.steps = 0.0, None, None, 0

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        tokens = batch["tokens"] if isinstance(batch, dict) else batch  # a row holds block + 1 tokens
        self.batches += 1
        self.samples += tokens.shape[0]
        self.tokens += tokens.shape[0] * (tokens.shape[1] - 1)
        flops = getattr(pl_module, "flops_per_batch", 0.0)  # set by training_step
        self.flops, self.all_flops = self.flops + flops, self.all_flops + flops
        if trainer.fit_loop._should_accumulate():
            return
        self.steps += 1
        # The logger connector's own test of a logging step, as Lightning's ThroughputMonitor reads it
        if not trainer._logger_connector.should_update_logs:
            return
        elapsed = synced_time(self.device) - self.start - self.paused
        self.last = (elapsed, self.tokens, self.all_flops, self.steps)
        if self.steady is None and self.steps >= self.warmup:
            self.steady = self.last
        self.throughput.update(time=elapsed, batches=self.batches, samples=self.samples, lengths=self.tokens,
                               flops=self.flops)
        self.flops = 0.0
        metrics = {f"train/{name}": value for name, value in self.throughput.compute().items()}
        if self.log_peak_memory and self.device.type == "cuda":
            metrics["train/peak_memory_gib"] = torch.cuda.max_memory_allocated(self.device) / 2**30
            torch.cuda.reset_peak_memory_stats(self.device)
        trainer._logger_connector.log_metrics(metrics)

    def on_validation_start(self, trainer, pl_module):
        if trainer.state.fn == "fit" and not trainer.sanity_checking:  # inside training, after on_train_start
            self.validation_start = synced_time(self.device)

    def on_validation_end(self, trainer, pl_module):
        if trainer.state.fn == "fit" and not trainer.sanity_checking:
            self.paused += synced_time(self.device) - self.validation_start

    def on_train_end(self, trainer, pl_module):
        """The fit's steady tokens/s and MFU, a record in the run's folder (rank 0): from the steady phase's first
        logging step to the last one, so the last step's validation and checkpoint are left out (a checkpoint saved
        at an earlier validation counts, as in the rates above)."""
        log_dir = trainer.log_dir or trainer.default_root_dir  # a broadcast under DDP: every rank must ask
        if not trainer.is_global_zero or not hasattr(pl_module, "record_context"):
            return
        seconds, tokens, flops, steps = (b - a for a, b in zip(self.steady, self.last)) \
            if self.steady is not None else (0.0, 0, 0.0, 0)
        timed = steps > 0 and seconds > 0
        batch = global_batch(trainer, pl_module.config.block_size)
        context = pl_module.record_context(trainer.global_step, None, pl_module.recipe())
        append_records(log_dir, [ThroughputRecord(
            **context, tokens=trainer.global_step * (batch["tokens"] if batch else 0),
            tokens_per_sec=tokens * trainer.world_size / seconds if timed else None,
            mfu=flops / seconds / self.available_flops if timed and self.available_flops else None,
            steady_steps=steps, steady_seconds=round(seconds, 3), warmup=self.warmup, devices=trainer.world_size,
            precision=str(trainer.precision))])
