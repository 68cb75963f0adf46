"""How the project times work, in one place so that every figure it compares is taken alike: the device's
synchronisation, a clock of marks at each step's start (a step's seconds are the period to the next start), the
median of calls run in turns, and the bare step (a fit's training batch without its loop) with its periods, so a
fit's step and its bare step (``bench --loop_overhead``, gpu-check's fits) are timed by one clock and do one work."""

from __future__ import annotations

import itertools
import statistics
import time
from typing import Callable, Optional

import lightning as L
import torch


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work through its own module (``torch.cuda`` on a GPU, ``torch.cpu``'s, with
    nothing to wait for, on the CPU): one call for every device, so a CPU test that stands in for it counts what a GPU
    runs."""
    getattr(torch, device.type).synchronize(device)


def synced_time(device: torch.device) -> float:
    """The host's clock once the device has done its queued work: what a rate's clock reads."""
    synchronize(device)
    return time.perf_counter()


def interleaved(fns, device, repeats) -> list[float]:
    """The median seconds of each of ``fns``, run in turns (one call of each per round, after one warm-up call of
    each): load that comes and goes on a shared machine falls on all of them alike, so their ratios hold."""
    for fn in fns:
        fn()
    times = [[] for _ in fns]
    for _ in range(repeats):
        for fn, kept in zip(fns, times):
            start = synced_time(device)
            fn()
            kept.append(synced_time(device) - start)
    return [statistics.median(kept) for kept in times]


def timed(fn, device, repeats) -> float:
    """The median seconds of ``repeats`` calls of ``fn``, after a warm-up call (and compilation on CUDA)."""
    return interleaved([fn], device, repeats)[0]


class StepClock(L.Callback):
    """A mark at each training batch's start (:meth:`mark`, also called by hand for steps run outside a fit): a CUDA
    event on a GPU, so the loop gains no host sync, else the host's clock. A step's seconds are the period from its
    mark to the next one, so they hold all that runs between (the loader, the hooks, logging). ``device`` None: the
    fit's, at its setup."""

    def __init__(self, device: Optional[torch.device] = None):
        self.device = device
        self.marks: list = []

    @property
    def cuda(self) -> bool:
        return self.device is not None and self.device.type == "cuda"

    def setup(self, trainer, pl_module, stage):
        if self.device is None:
            self.device = trainer.strategy.root_device

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.mark()

    def mark(self) -> None:
        if self.cuda:
            self.marks.append(torch.cuda.Event(enable_timing=True))
            self.marks[-1].record()
        else:
            self.marks.append(time.perf_counter())

    def elapsed(self, first: int, last: int) -> float:
        """Seconds from mark ``first`` to mark ``last``."""
        if self.cuda:
            self.marks[last].synchronize()  # the later event done, the earlier one is
            return self.marks[first].elapsed_time(self.marks[last]) / 1000
        return self.marks[last] - self.marks[first]

    def periods(self, first: int = 0) -> list[float]:
        """Seconds of each step from mark ``first`` on whose period has closed (the last mark opens none)."""
        return [self.elapsed(i, i + 1) for i in range(first, len(self.marks) - 1)]


class BareStep:
    """One training batch of a fit as its loop runs it, without the loop: a call is ``rows`` x ``length`` random
    tokens through the module's own loss (``batch_loss``) in the fit's precision (its plugin's forward context:
    autocast under ``*-mixed``), then backward; every ``accumulate_grad_batches``-th call also measures the gradient
    norm and clips by the trainer's ``gradient_clip_val`` and ``gradient_clip_algorithm`` (the module's own hook, as
    the fit does), and steps the module's own optimizer (a fresh one from ``configure_optimizers``: the fit's recipe),
    through the fit's grad scaler under fp16. What a fit's step costs beyond this is the loop's (the loader, hooks,
    logging, host syncs)."""

    def __init__(self, pl_module, trainer, rows: int, length: int):
        self.module, self.device = pl_module, trainer.strategy.root_device
        pl_module.to(self.device).train()  # a finished fit's teardown moved the module to the CPU
        configured = pl_module.configure_optimizers()
        self.optimizer = configured["optimizer"] if isinstance(configured, dict) else configured
        self.precision = trainer.precision_plugin
        self.scaler = getattr(self.precision, "scaler", None)
        self.accumulate = trainer.accumulate_grad_batches
        self.clip, self.algorithm = trainer.gradient_clip_val, trainer.gradient_clip_algorithm
        self.batch = torch.randint(0, pl_module.config.vocab_size, (rows, length + 1), device=self.device)
        self.calls = itertools.count(1)

    def __call__(self) -> None:
        with self.precision.forward_context():
            loss = self.module.batch_loss(self.batch)[0] / self.accumulate  # as Lightning scales an accumulated loss
        (loss if self.scaler is None else self.scaler.scale(loss)).backward()
        if next(self.calls) % self.accumulate:
            return
        if self.scaler is not None:
            self.scaler.unscale_(self.optimizer)
        self.module.measure_grad_norm()
        self.module.configure_gradient_clipping(self.optimizer, self.clip, self.algorithm)
        if self.scaler is None:
            self.optimizer.step()
        else:
            self.scaler.step(self.optimizer)
            self.scaler.update()
        self.optimizer.zero_grad(set_to_none=True)


def step_periods(step: Callable[[], None], warmup: int, steps: int, device: torch.device) -> list[float]:
    """Seconds of each of ``steps`` calls of ``step`` after ``warmup`` untimed ones (the optimizer's state, any
    compile), each the period from its start to the next one's on a :class:`StepClock`, as a fit's steps are."""
    clock = StepClock(device)
    for _ in range(warmup):
        step()
    for _ in range(steps):
        clock.mark()
        step()
    clock.mark()  # closes the last step's period
    return clock.periods()
