"""PoPE, polar coordinate position embedding (Gopalakrishnan et al., 2025, arXiv 2509.10534): each of a head's D
components c of q and k becomes a point in the plane whose magnitude comes from content alone, softplus(q_c), and
whose angle from position alone, i theta_c (keys: j theta_c + delta_c, a learned phase per layer, head and component,
clamped to [-2 pi, 0]). The logit is

    sum_c softplus(q_ic) softplus(k_jc) cos((i - j) theta_c - delta_c) / sqrt(D),

so what a token is and where it is are kept apart, which RoPE's rotation of pairs of raw components mixes. Every
component turns at its own frequency theta_c = base^(-c / D) (D frequencies; RoPE has D / 2).

The rotation writes each point as its two coordinates, so q and k leave :meth:`rotate` with 2D components (cos then
sin of each) and v keeps D: attention then runs on any backend as plain attention, at the scale of D, not 2D (q
carries sqrt(2)). Written from the formula of the authors' code (the magnitude, the key phase and its clamp, the
scale of the original head size), with the phases starting at 0 as their default.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import ConfigError
from .base import Encoding, PositionalEncoding

# The key phase's range: a full turn below zero, as the authors clamp it.
PHASE_RANGE = (-2 * math.pi, 0.0)


def pope_points(x, angles):
    """(..., D) components and (..., D) angles -> (..., 2D): softplus(x) cos, then softplus(x) sin. ``x`` arrives as a
    transposed view of the layer's projection; made contiguous first, because a compiled backward through
    FlexAttention assumed other strides for its gradient than it got."""
    magnitude = F.softplus(x.to(angles.dtype).contiguous())
    return torch.cat([magnitude * angles.cos(), magnitude * angles.sin()], dim=-1)


class PopeModule(PositionalEncoding):
    """The frequencies (one per component) and each layer's key phases (n_layer, n_head, head_dim)."""

    def __init__(self, settings: "Pope", config):
        super().__init__(settings, config)
        exponents = torch.arange(self.head_dim, dtype=torch.float64) / self.head_dim
        self.register_buffer("inv_freq", settings.base**-exponents, persistent=False)
        self.phase = nn.Parameter(torch.zeros(config.n_layer, config.n_head, self.head_dim))

    per_layer = ("phase",)

    def rotate(self, q, k, offset, layer=0, key_padding=None, layout=None):
        t = q.shape[-2]
        wide = torch.promote_types(q.dtype, torch.float32)  # fp32, or fp64 for a double-precision reference
        if layout is not None:  # each row's positions: angles (B, 1, T, D)
            pos = layout.positions[:, None, :].to(wide)
        else:
            pos = torch.arange(offset, offset + t, device=q.device, dtype=wide)
        angles = pos[..., None] * self.inv_freq.to(wide)
        phase = self.phase[layer].clamp(*PHASE_RANGE)[:, None, :].to(wide)  # (H, 1, D)
        # sqrt(2): attention scales by the width it sees, 2D; the logit is PoPE's at the scale of D
        q_points = pope_points(q, angles) * math.sqrt(2.0)
        return q_points.to(q.dtype), pope_points(k, angles + phase).to(k.dtype)


@dataclass
class Pope(Encoding):
    """PoPE: softplus magnitudes of q and k from content, angles from position (base ``base``, one frequency per
    component), and a learned key phase per layer, head and component."""

    base: float = 10000.0

    name = "pope"
    module = PopeModule

    def __post_init__(self):
        super().__post_init__()
        if self.base <= 1:
            raise ConfigError(f"pope.base must be > 1 (the frequencies are base^(-c/D)), got {self.base}")
