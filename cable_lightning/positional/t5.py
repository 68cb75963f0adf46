"""T5 relative bias: a learned scalar per (log-spaced distance bucket, head), shared by all layers.

The buckets and the bias are T5's (transformers' T5Attention; the reference tests compare them). T5 itself leaves
q.k unscaled (its initialisation absorbs the 1/sqrt(d)); here the bias is added to the 1/sqrt(d)-scaled logits, as
for every encoding."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from .base import Encoding, PositionalBias, PositionalEncoding

NUM_BUCKETS = 32
MAX_DISTANCE = 128


def relative_bucket(rel, causal: bool, num_buckets: int = NUM_BUCKETS, max_distance: int = MAX_DISTANCE):
    """Bucket of rel = i - j: exact buckets for short distances, log-spaced up to ``max_distance``,
    the last bucket reused beyond it. Bidirectional: half the buckets per direction."""
    offset = torch.zeros_like(rel)
    if causal:
        n = rel.clamp(min=0)
    else:
        num_buckets //= 2
        offset = (rel < 0).to(rel.dtype) * num_buckets
        n = rel.abs()
    exact = num_buckets // 2
    log_ratio = torch.log(n.clamp(min=1).float() / exact) / math.log(max_distance / exact)
    far = (exact + (log_ratio * (num_buckets - exact)).to(rel.dtype)).clamp(max=num_buckets - 1)
    return offset + torch.where(n < exact, n, far)


class T5Bias(PositionalBias):
    def __init__(self, table, q_offset, causal, layout=None):
        super().__init__(q_offset, causal, layout)
        self.table = table  # (buckets, heads)

    def at(self, h, i, j):
        bucket = relative_bucket(i - j, self.causal)
        return self.table[bucket, h]


class T5Module(PositionalEncoding):
    def __init__(self, settings, config):
        super().__init__(settings, config)
        self.table = nn.Parameter(torch.zeros(NUM_BUCKETS, config.n_head))

    def score_bias(self, h, layer, offset, state, layout=None):
        return T5Bias(self.table, offset, self.causal, layout)


@dataclass
class T5(Encoding):
    """T5-bias: 32 log-spaced buckets up to distance 128, one table for all layers."""

    name = "t5"
    module = T5Module
    scores = "bias"
