"""The bare step beside each fit: the fit's own compiled backbone trained without Lightning on one
batch, in the same process right after the fit: forward and backward, the gradient norm and clipping at 1.0 as the
fit does them (``CausalLM.on_before_optimizer_step``, ``configure_gradient_clipping``), the fit's fused AdamW
(``lit.optim.build_optimizer``). A fit's steady step over this one is what the loop costs (loader, hooks, logging,
host syncs); the target is at most 1.10x."""

from __future__ import annotations

import statistics
import time

import torch

from .dynamo import dynamo_counts

BARE_TARGET = 1.10  # the fit's steady step over the bare one
BARE_WARMUP = 2  # the optimizer's state, and any compile the fit did not already do


def bare_step(backbone, sizes, device: torch.device, cuda: bool) -> tuple[float, int]:
    """(median seconds of ``sizes.steady`` bare steps, Dynamo's compiles among all of them). Each step is the period
    from its start to the next one's, as the fit's are (CUDA events, or the CPU's clock)."""
    from ..lit.optim import build_optimizer

    backbone.to(device).train()  # Lightning's teardown moved the module to the CPU
    optimizer = build_optimizer(backbone, 6e-4, 6e-5, 10, 1000, (0.9, 0.95), 1e-8, 0.1)["optimizer"]
    x = torch.randint(0, backbone.config.vocab_size, (sizes.micro, sizes.block + 1), device=device)
    autocast = sizes.dtype != torch.float32

    def step():
        with torch.autocast(device.type, dtype=sizes.dtype, enabled=autocast):
            loss = backbone.loss(x[:, :-1], x[:, 1:])
        loss.backward()
        params = [p for p in backbone.parameters() if p.grad is not None]
        norm = torch.nn.utils.get_total_norm([p.grad for p in params], 2.0)
        torch.nn.utils.clip_grads_with_norm_(params, 1.0, norm)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    compiles = dynamo_counts()["compiles"]
    marks = []
    for number in range(BARE_WARMUP + sizes.steady + 1):  # one more start closes the last timed step's period
        if number >= BARE_WARMUP:
            if cuda:
                marks.append(torch.cuda.Event(enable_timing=True))
                marks[-1].record()
            else:
                marks.append(time.perf_counter())
        if number < BARE_WARMUP + sizes.steady:
            step()
    if cuda:
        torch.cuda.synchronize()
        periods = [a.elapsed_time(b) / 1000 for a, b in zip(marks, marks[1:])]
    else:
        periods = [b - a for a, b in zip(marks, marks[1:])]
    return statistics.median(periods), dynamo_counts()["compiles"] - compiles


def ratio_cell(fit_step: float | None, bare: float | None) -> str:
    """The fit's steady step over the bare one, against its target."""
    if not fit_step or not bare:
        return "-"
    ratio = fit_step / bare
    return f"{ratio:.2f} (<= {BARE_TARGET:.2f}: {'met' if ratio <= BARE_TARGET else 'missed'})"
