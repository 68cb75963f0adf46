"""CoPE: contextual position encoding (Golovneva et al., 2024).

Positions count tokens the query finds relevant instead of all tokens. For query i and key j:
    gate_ij = sigmoid(q_i . k_j / sqrt(d))
    p_ij    = sum_{t = j..i} gate_it            (bidirectional: over the tokens between i and j, both included)
    p_ij    clamped to [0, positions - 1]
    z_ij    = interpolation of q_i . e[floor(p_ij)] and q_i . e[ceil(p_ij)] / sqrt(d), weights by the fraction
    score   = q_i . k_j / sqrt(d) + z_ij
with e one learned table of position vectors per layer, shared by the heads (initialised to zero, so
a new model starts as NoPE). The gates need every logit, so CoPE runs on blocks of query rows (the
chunked path) and never through fused kernels. Gates use the scaled logits, as the authors' code does.

One difference from the paper's listing: there the position logits are q_i . e unscaled; here they are divided by
sqrt(d) like the q.k logits. The two are the same model up to the scale of e (e here = sqrt(d) x the listing's e),
which starts at zero either way; under Adam, whose steps do not depend on a parameter's scale, the position logits
here move sqrt(d) times slower per step than the listing's.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import ConfigError
from .base import Encoding, LogitScores, PositionalEncoding


class CopeScores(LogitScores):
    maps_per_head = 8  # gates, their reversed copy, positions, the index, two gathered maps, the fraction, the scores

    def __init__(self, table, q_offset, causal, layout=None):
        super().__init__(q_offset, causal, layout)
        self.table = table  # (head_dim, positions)

    def positions(self, logits, start, stop):
        """Contextual positions p_ij (B, H, rows, keys), before clamping."""
        gates = torch.sigmoid(logits)
        n_keys = logits.shape[-1]
        if self.causal:
            # sum over t = j..n-1 of the gates with the future zeroed = sum over t = j..i: a cumulative sum of the
            # reversed gates (a sum of few terms near the query, so exact there). The future is zeroed in place on
            # the reversed copy, only in the keys of the block's own rows (every earlier key is in every row's past).
            first = min(n_keys, start + self.q_offset + 1)
            reversed_gates = gates.flip(-1)
            reversed_gates[..., : n_keys - first].masked_fill_(
                self.future(start, stop, n_keys, logits.device, first).flip(-1), 0.0)
            return reversed_gates.cumsum_(-1).flip(-1)
        totals = gates.cumsum(-1)  # C_j = sum_{t <= j} gate_it
        own = torch.arange(start, stop, device=logits.device) + self.q_offset
        own_index = own.view(1, 1, -1, 1).expand(*logits.shape[:-1], 1)
        own_total, own_gate = totals.gather(-1, own_index), gates.gather(-1, own_index)
        before = torch.arange(n_keys, device=logits.device) <= own.view(-1, 1)
        # j <= i: C_i - C_j + gate_ij;  j > i: C_j - C_i + gate_ii
        return (own_total - totals).abs() + torch.where(before, gates, own_gate)

    def scores(self, logits, q, start, stop, key_padding=None):
        """logits + z(p), z interpolated linearly between the position logits at floor(p) and floor(p) + 1, as
        z[n] + (z[n + 1] - z[n]) (p - n) with n = floor(p) clamped to the last position, whose slope is zero (so
        past it z is the last position's logit, and p needs no clamp): one index, two gathers, one fused multiply-add
        over each (rows x keys) map."""
        last = self.table.shape[-1] - 1
        positions = self.positions(logits, start, stop)
        below = positions.long().clamp_(max=last)  # floor: positions are >= 0
        position_logits = (q.to(logits.dtype) @ self.table.to(logits.dtype)) * q.shape[-1] ** -0.5  # (B, H, rows, P)
        slopes = F.pad(position_logits.diff(dim=-1), (0, 1))  # z[n + 1] - z[n]; zero at the last position
        return torch.addcmul(logits + position_logits.gather(-1, below), slopes.gather(-1, below), positions - below)


class CopeModule(PositionalEncoding):
    def __init__(self, settings, config):
        super().__init__(settings, config)
        self.table = nn.Parameter(torch.zeros(config.n_layer, self.head_dim, settings.positions))

    per_layer = ("table",)

    reads_positions = False  # counts of gates over the keys between query and key: inside its document, or masked

    def score_bias(self, h, layer, offset, state, layout=None):
        return CopeScores(self.table[layer], offset, self.causal, layout)


@dataclass
class Cope(Encoding):
    """CoPE: gated, context-dependent positions with interpolated learned position logits; contextual positions are
    clamped to 0..``positions`` - 1."""

    positions: int = 64

    name = "cope"
    module = CopeModule
    scores = "logits"

    def __post_init__(self):
        super().__post_init__()
        if self.positions < 2:
            raise ConfigError(f"cope.positions must be >= 2 (interpolation needs two positions), got {self.positions}")
