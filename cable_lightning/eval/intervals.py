"""How sure a results table is: 95% intervals and paired tests, from scipy.stats.

- Over seeds (n >= 2 runs of one encoding): the mean and a Student-t interval, ``scipy.stats.t.interval`` with n - 1
  degrees of freedom and the standard error of the mean; two encodings are compared by a paired t-test across the
  seeds they share (``scipy.stats.ttest_rel``), since runs of one seed see the same data in the same order.
- Within one run (one seed): a percentile bootstrap over the evaluated windows (``scipy.stats.bootstrap``), of
  exp(token-weighted mean NLL), or of the ratio of two such perplexities (a window resampled with the windows of
  the other length that score the same tokens); two encodings are compared by a paired t-test over the per-window
  mean NLLs of the same windows.
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
    """One run's perplexity over its windows and a 95% percentile bootstrap interval over them; with ``reference``
    (the same run's windows at another length), the ratio of the two perplexities, paired: each resampled window
    brings the reference windows that score the same tokens. Windows are in stream order, each scoring the targets
    after the previous one's (as LengthRecord keeps them), so a reference window belongs to the window its first
    scored target falls in (exact when the reference windows are no longer). No interval with one window."""
    nll, tokens = np.asarray(windows[0], dtype=float), np.asarray(windows[1], dtype=float)
    sums = [nll * tokens, tokens]
    if reference is not None:
        ref_nll, ref_tokens = np.asarray(reference[0], dtype=float), np.asarray(reference[1], dtype=float)
        starts = np.concatenate([[0.0], np.cumsum(tokens)[:-1]])
        ref_starts = np.concatenate([[0.0], np.cumsum(ref_tokens)[:-1]])
        owner = np.clip(np.searchsorted(starts, ref_starts, side="right") - 1, 0, len(nll) - 1)
        sums += [np.bincount(owner, ref_nll * ref_tokens, len(nll)), np.bincount(owner, ref_tokens, len(nll))]

    def statistic(index, axis=-1):
        num, den, *ref = [s[index].sum(axis=-1) for s in sums]
        return np.exp(num / den) / (np.exp(ref[0] / ref[1]) if ref else 1.0)

    value = float(statistic(np.arange(len(nll))))
    if len(nll) < 2 or not math.isfinite(value):
        return Estimate(value, n=len(nll))
    result = stats.bootstrap((np.arange(len(nll)),), statistic, vectorized=True, confidence_level=CONFIDENCE,
                             n_resamples=RESAMPLES, batch=BATCH, method="percentile", rng=np.random.default_rng(0))
    interval = result.confidence_interval
    return Estimate(value, float(interval.low), float(interval.high), len(nll), "bootstrap")


def paired_p(a: Sequence[float], b: Sequence[float]) -> float:
    """The two-sided p-value of a paired t-test (scipy.stats.ttest_rel); pairs that all differ by the same amount
    give 0 unless that amount is zero (1), since the test's statistic is undefined there."""
    difference = np.asarray(a, dtype=float) - np.asarray(b, dtype=float)
    if len(difference) < 2:
        raise ValueError("a paired test needs at least two pairs")
    if np.ptp(difference) == 0:
        return 0.0 if difference[0] != 0 else 1.0
    return float(stats.ttest_rel(a, b).pvalue)


def separable(a: Sequence[float], b: Sequence[float]) -> bool:
    """Whether a two-sided paired t-test rejects equal means at ALPHA (:func:`paired_p`)."""
    return paired_p(a, b) < ALPHA
