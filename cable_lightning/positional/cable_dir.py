"""Order-aware bidirectional CABLE: **the project's own form, not the paper's**.

CABLE's bidirectional bias -g_i |S_i - S_j| is symmetric: a key k tokens to the left of a query and one k tokens to
its right look the same to it whenever the increments between them are equal. Two adjacent [MASK] tokens then differ
only by g x b at [MASK], which training can switch off (docs/results/tasks-encoders.md). Here the
bias depends on the side of the key (j <= i: left, j > i: right; the order of the tokens, no position index):

- ``order: weights``: separate per-token weights for the two sides,
      bias[i, j] = -g_i (S_i - S_j) for j <= i,   -h_i (S_j - S_i) for j > i,   h = softplus(w_h . x) > 0;
- ``order: increments``: separate per-token increments for the two sides,
      bias[i, j] = -g_i (S_i - S_j) for j <= i,   -g_i (R_j - R_i) for j > i,   R the cumulative sum of
      c = ``bias_activation``(w_c . x) >= 0.

A causal model never sees a key on the right: its module is CABLE's, parameters included, so the causal form, its
cache and its fold are exactly CABLE's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F

from .base import ScoreBias
from .cable import Cable, CableBias, CumulativeBias


class SidedBias(CableBias):
    """A bidirectional bias with its own right-hand side: ``right`` (B, H, Tq) weights h (``order`` weights), or
    ``(r_q, r_k)`` sums R (``order`` increments)."""

    def __init__(self, s_q, s_k, g_q, right, order: str, q_offset: int, layout=None):
        super().__init__(s_q, s_k, g_q, q_offset, causal=False, layout=layout)
        self.right, self.order = right, order

    rows = ScoreBias.rows  # its blocks from its own pointwise formula below (CableBias slices CABLE's)

    def __call__(self, b, h, q_idx, kv_idx):
        s_q, g = self.s_q[b, h, q_idx], self.g_q[b, h, q_idx]
        left = g * (s_q - self.s_k[b, h, kv_idx])
        if self.order == "weights":
            right = self.right[b, h, q_idx] * (self.s_k[b, h, kv_idx] - s_q)
        else:
            r_q, r_k = self.right
            right = g * (r_k[b, h, kv_idx] - r_q[b, h, q_idx])
        return -torch.where(kv_idx <= q_idx + self.q_offset, left, right)


class SidedCumulativeBias(CumulativeBias):
    """CABLE's module with one more per-token quantity when bidirectional: the right side's weight or increment."""

    def extra_maps(self, settings, config):
        if config.causal:
            return {}
        return {"weight_right": F.softplus} if settings.order == "weights" else {"increment_right": self.activation}

    def score_bias(self, h, layer, offset, state, layout=None):
        if self.causal:
            return super().score_bias(h, layer, offset, state, layout)
        found = self.per_token(h, layer)
        s_q, s_k = self.sums(found["increment"], offset, state, layout)
        if self.settings.order == "weights":
            right = found["weight_right"]
        else:
            right = self.sums(found["increment_right"], offset, state, layout, key="cable_r")
        return SidedBias(s_q, s_k, found["weight"], right, self.settings.order, offset, layout)


@dataclass
class CableDir(Cable):
    """Order-aware bidirectional CABLE (the project's own, not the paper's): the bias to a key on the right has its
    own per-token weight (``order: weights``) or its own increments (``order: increments``); causal: CABLE."""

    order: Literal["weights", "increments"] = "weights"

    name = "cable_dir"
    module = SidedCumulativeBias
