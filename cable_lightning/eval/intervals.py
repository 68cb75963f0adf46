"""How sure a results table is: 95% intervals and paired tests, from scipy.stats.

- Over seeds (n >= 2 runs of one encoding): the mean and a Student-t interval, ``scipy.stats.t.interval`` with n - 1
  degrees of freedom and the standard error of the mean; two encodings are compared by a paired t-test across the
  seeds they share (``scipy.stats.ttest_rel``), since runs of one seed see the same data in the same order.
- Within one run (one seed): a percentile bootstrap over the evaluated windows (``scipy.stats.bootstrap``), of
  exp(token-weighted mean NLL), or of the ratio of two such perplexities (the windows of each length resampled
  independently); two encodings are compared by a paired t-test over the per-window mean NLLs of the same windows.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np
from scipy import stats

CONFIDENCE = 0.95
ALPHA = 0.05  # a paired difference separates when the two-sided p-value is below this
RESAMPLES = 2000
BATCH = 50  # resamples at a time: 50 x 16384 windows of indices is 6.5 MB

Windows = tuple[Sequence[float], Sequence[int]]  # per window: mean NLL, scored tokens


@dataclass(frozen=True)
class Estimate:
    """A cell's value and its interval: ``how`` is "t" (over ``n`` seeds), "bootstrap" (over ``n`` windows of one
    run), or "" (no interval: one value without windows, or a value that is not finite)."""

    mean: float
    low: Optional[float] = None
    high: Optional[float] = None
    n: int = 1
    how: str = ""


def seed_interval(values: Sequence[float]) -> Estimate:
    """The mean of one value per seed and its 95% t-interval (none for one value or a non-finite one)."""
    values = np.asarray(values, dtype=float)
    mean = float(values.mean())
    if len(values) < 2 or not np.isfinite(values).all():
        return Estimate(mean, n=len(values))
    sem = float(stats.sem(values))
    if sem == 0.0:
        return Estimate(mean, mean, mean, len(values), "t")
    low, high = stats.t.interval(CONFIDENCE, len(values) - 1, loc=mean, scale=sem)
    return Estimate(mean, float(low), float(high), len(values), "t")


def window_interval(windows: Windows, reference: Optional[Windows] = None) -> Estimate:
    """One run's perplexity over its windows (or, with ``reference``, the ratio of it to the reference windows'
    perplexity) and a 95% percentile bootstrap interval; none with fewer than two windows on a side."""
    sides = [(np.asarray(nll, dtype=float), np.asarray(tokens, dtype=float))
             for nll, tokens in ([windows] if reference is None else [windows, reference])]

    def ppl(side, index):
        nll, tokens = side
        return np.exp((nll[index] * tokens[index]).sum(axis=-1) / tokens[index].sum(axis=-1))

    def statistic(*indices, axis=-1):
        values = [ppl(side, index) for side, index in zip(sides, indices)]
        return values[0] if len(values) == 1 else values[0] / values[1]

    indices = [np.arange(len(nll)) for nll, _ in sides]
    value = float(statistic(*indices))
    if min(len(i) for i in indices) < 2 or not math.isfinite(value):
        return Estimate(value, n=min(len(i) for i in indices))
    result = stats.bootstrap(indices, statistic, vectorized=True, paired=False, confidence_level=CONFIDENCE,
                             n_resamples=RESAMPLES, batch=BATCH, method="percentile", rng=np.random.default_rng(0))
    interval = result.confidence_interval
    return Estimate(value, float(interval.low), float(interval.high), len(indices[0]), "bootstrap")


def separable(a: Sequence[float], b: Sequence[float]) -> bool:
    """Whether a two-sided paired t-test (scipy.stats.ttest_rel) rejects equal means at ALPHA; pairs that all
    differ by the same amount separate unless that amount is zero (the test's statistic is undefined there)."""
    difference = np.asarray(a, dtype=float) - np.asarray(b, dtype=float)
    if len(difference) < 2:
        raise ValueError("a paired test needs at least two pairs")
    if np.ptp(difference) == 0:
        return bool(difference[0] != 0)
    return bool(stats.ttest_rel(a, b).pvalue < ALPHA)
