"""Loss as a function of token position inside an evaluation window.

Perplexity over whole windows can hide that a model ignores distant tokens (a local bias can look good at
16x by attending only nearby). The mean NLL by log-spaced position bucket (1, 2-3, 4-7, ... up to the window
length) shows whether later positions, which have more context, are predicted better or worse.
"""

from __future__ import annotations

import torch
from torchmetrics import Metric


def position_buckets(length: int) -> list[tuple[int, int]]:
    """(first, last) 1-based positions of each bucket of a window of ``length`` targets: 1-1, 2-3, 4-7, ...;
    the last bucket ends at ``length`` and takes the lone position ``length`` when that is a power of two."""
    if length < 1:
        raise ValueError(f"a window needs length >= 1, got {length}")
    top = max(length - 1, 1).bit_length()  # number of buckets
    return [(1 << b, length if b == top - 1 else (1 << (b + 1)) - 1) for b in range(top)]


def bucket_index(length: int) -> torch.Tensor:
    """(length,) bucket of each target index 0..length-1 (the target at index i has position i + 1)."""
    last = max(length - 1, 1)  # the lone position `length` joins the bucket before it
    return torch.tensor([min(position, last).bit_length() - 1 for position in range(1, length + 1)])


class PositionNLL(Metric):
    """Token-weighted mean NLL per position bucket over the windows of one length; summed across ranks."""

    full_state_update = False

    def __init__(self, length: int, **kwargs):
        super().__init__(**kwargs)
        self.length = length
        self.buckets = position_buckets(length)
        self.register_buffer("bucket_of", bucket_index(length), persistent=False)
        self.add_state("nll_sum", default=torch.zeros(len(self.buckets), dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("count", default=torch.zeros(len(self.buckets), dtype=torch.float64), dist_reduce_fx="sum")

    def update(self, nll: torch.Tensor, scored: torch.Tensor) -> None:
        """``nll`` (B, T) per-token NLL, ``scored`` (B, T) bool: the targets that count (T == length)."""
        weights = scored.to(torch.float64)
        bucket_of = self.bucket_of.to(nll.device)
        self.nll_sum.index_add_(0, bucket_of, (nll.to(torch.float64) * weights).sum(0))
        self.count.index_add_(0, bucket_of, weights.sum(0))

    def compute(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(mean NLL, token count) per bucket; the mean is NaN where a bucket had no scored token."""
        return self.nll_sum / self.count, self.count
