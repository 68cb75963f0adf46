"""The bare step beside each fit: the fit's own module and compiled blocks trained without Lightning's loop on one
batch, in the same process right after the fit (:class:`timing.BareStep`: the fit's loss, precision, accumulation,
gradient norm and clipping, and its own optimizer from ``configure_optimizers``). A fit's steady step over this one is
what the loop costs (loader, hooks, logging, host syncs); the target is at most 1.10x."""

from __future__ import annotations

import statistics

from ..timing import BareStep, step_periods
from .dynamo import dynamo_counts

BARE_TARGET = 1.10  # the fit's steady step over the bare one
BARE_WARMUP = 2  # the optimizer's state, and any compile the fit did not already do


def bare_seconds(model, sizes) -> tuple[float, int]:
    """(median seconds of ``sizes.steady`` bare steps of the fit's ``model``, at its trainer's settings, Dynamo's
    compiles among all of them). Each step is the period from its start to the next one's, as the fit's are."""
    compiles = dynamo_counts()["compiles"]
    step = BareStep(model, model.trainer, sizes.micro, sizes.block)
    seconds = statistics.median(step_periods(step, BARE_WARMUP, sizes.steady, step.device))
    return seconds, dynamo_counts()["compiles"] - compiles


def ratio_cell(fit_step: float | None, bare: float | None) -> str:
    """The fit's steady step over the bare one, against its target."""
    if not fit_step or not bare:
        return "-"
    ratio = fit_step / bare
    return f"{ratio:.2f} (<= {BARE_TARGET:.2f}: {'met' if ratio <= BARE_TARGET else 'missed'})"
