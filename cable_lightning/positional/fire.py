"""FIRE: functional interpolation of relative positions (Li et al., 2024).

bias(i, j) = f(psi(|i - j|) / psi(max(L, i))), psi(x) = log(c x + 1), f an MLP 1 -> 32 -> heads;
c and L are learned. Bidirectionally the normaliser uses max(L, i, j). i and j are position indices: under a layout,
the layout's (restarting at each document, so the normaliser does too).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .base import Encoding, PositionalBias, PositionalEncoding

HIDDEN = 32


class FireBias(PositionalBias):
    def __init__(self, w1, b1, w2, b2, c, threshold, q_offset, causal, layout=None):
        super().__init__(q_offset, causal, layout)
        self.w1, self.b1, self.w2, self.b2, self.c, self.threshold = w1, b1, w2, b2, c, threshold

    def normalised_distance(self, i, j):
        pos = i if self.causal else torch.maximum(i, j)
        d = (i - j).abs().to(self.c.dtype)
        norm = torch.maximum(pos.to(self.c.dtype), self.threshold)
        return torch.log1p(self.c * d) / torch.log1p(self.c * norm)

    def at(self, h, i, j):
        # Hidden units unrolled: the same code serves FlexAttention's scalar score_mod and the chunked
        # path's index grids, and never holds a (rows x keys x hidden) tensor.
        x = self.normalised_distance(i, j)
        out = self.b2[h]
        for unit in range(HIDDEN):
            out = out + self.w2[h, unit] * F.relu(self.w1[unit] * x + self.b1[unit])
        return out


class FireModule(PositionalEncoding):
    relative = False  # psi(max(L, i)) reads the query's own position once it passes the threshold L
    def __init__(self, settings, config):
        super().__init__(settings, config)
        n, heads = config.n_layer, config.n_head
        self.w1 = nn.Parameter(torch.randn(n, HIDDEN) * 0.5)
        self.b1 = nn.Parameter(torch.zeros(n, HIDDEN))
        self.w2 = nn.Parameter(torch.randn(n, heads, HIDDEN) * HIDDEN**-0.5)
        self.b2 = nn.Parameter(torch.zeros(n, heads))
        self.c_raw = nn.Parameter(torch.full((n,), 0.5413))  # softplus -> c = 1
        self.threshold = nn.Parameter(torch.full((n,), float(config.original_length)))

    per_layer = ("w1", "b1", "w2", "b2", "c_raw", "threshold")

    def score_bias(self, h, layer, offset, state, layout=None):
        return FireBias(
            self.w1[layer], self.b1[layer], self.w2[layer], self.b2[layer],
            F.softplus(self.c_raw[layer]), self.threshold[layer].abs(), offset, self.causal, layout,
        )


@dataclass
class Fire(Encoding):
    """FIRE: a learned MLP of the log-normalised distance, one output per head, per layer (its threshold L starts
    at the training length)."""

    name = "fire"
    module = FireModule
    scores = "bias"
