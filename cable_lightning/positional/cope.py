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
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ..errors import ConfigError
from .base import Encoding, LogitScores, PositionalEncoding


class CopeScores(LogitScores):
    maps_per_head = 8  # gates, positions, two indices, two gathered logits, the fraction, the scores

    def __init__(self, table, q_offset, causal):
        super().__init__(q_offset, causal)
        self.table = table  # (head_dim, positions)

    def positions(self, logits, start, stop):
        """Contextual positions p_ij (B, H, rows, keys), before clamping."""
        gates = torch.sigmoid(logits)
        n_keys = logits.shape[-1]
        if self.causal:
            gates = gates.masked_fill(self.future(start, stop, n_keys, logits.device), 0.0)
            return gates.flip(-1).cumsum(-1).flip(-1)  # sum over t = j..n-1 of masked gates = sum over t = j..i
        totals = gates.cumsum(-1)  # C_j = sum_{t <= j} gate_it
        own = torch.arange(start, stop, device=logits.device) + self.q_offset
        own_index = own.view(1, 1, -1, 1).expand(*logits.shape[:-1], 1)
        own_total, own_gate = totals.gather(-1, own_index), gates.gather(-1, own_index)
        before = torch.arange(n_keys, device=logits.device) <= own.view(-1, 1)
        # j <= i: C_i - C_j + gate_ij;  j > i: C_j - C_i + gate_ii
        return (own_total - totals).abs() + torch.where(before, gates, own_gate)

    def scores(self, logits, q, start, stop):
        last = self.table.shape[-1] - 1
        positions = self.positions(logits, start, stop).clamp(max=last)
        below = positions.floor()
        fraction = positions - below
        below = below.long()
        above = (below + 1).clamp(max=last)
        position_logits = (q.to(logits.dtype) @ self.table.to(logits.dtype)) * q.shape[-1] ** -0.5  # (B, H, rows, P)
        interpolated = (position_logits.gather(-1, below) * (1 - fraction)
                        + position_logits.gather(-1, above) * fraction)
        return logits + interpolated


class Cope(PositionalEncoding):
    def __init__(self, settings, config):
        super().__init__(settings, config)
        self.table = nn.Parameter(torch.zeros(config.n_layer, self.head_dim, settings.positions))

    def score_bias(self, h, layer, offset, state):
        return CopeScores(self.table[layer], offset, self.causal)


@dataclass
class cope(Encoding):
    """CoPE: gated, context-dependent positions with interpolated learned position logits; contextual positions are
    clamped to 0..``positions`` - 1."""

    positions: int = 64

    module = Cope
    scores = "logits"

    def __post_init__(self):
        super().__post_init__()
        if self.positions < 2:
            raise ConfigError(f"cope.positions must be >= 2 (interpolation needs two positions), got {self.positions}")
