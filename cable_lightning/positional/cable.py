"""CABLE: context-aware additive biases (and its NW and kernelised variants, and FoX, which is one of them).

Per layer and head, from the layer's normalised input x_t:
    b_t = ReLU(w_c . x_t) >= 0        (softplus in the paper's first version: ``cable_bias_activation``)
    S_t = sum_{u <= t} b_u
    g_t = softplus(w_s . x_t) > 0     (CABLE_NW: g = 1)
    bias[i, j] = -g_i * (S_i - S_j)   causal;   -g_i * |S_i - S_j| bidirectional
    K-CABLE:     -log(1 + (g_i * (S_i - S_j))^2)
With b = 1 and g = ALiBi's slope this is exactly ALiBi.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..errors import ConfigError
from .base import PositionalEncoding, ScoreBias
from .registry import register


class CableBias(ScoreBias):
    """The bias from per-token cumulative sums. ``s_q``/``g_q``: (B, H, Tq) for queries; ``s_k``: (B, H, Tk)."""

    def __init__(self, s_q: Tensor, s_k: Tensor, g_q: Tensor | None, q_offset: int, causal: bool,
                 kernel: str = "linear"):
        super().__init__(q_offset, causal)
        self.s_q, self.s_k, self.g_q, self.kernel = s_q, s_k, g_q, kernel

    @property
    def foldable(self) -> bool:
        # -g_i (S_i - S_j) = g_i . (S_j - S_i); |S_i - S_j| (bidirectional) and log1p do not split.
        return self.causal and self.kernel == "linear"

    def factors(self, n_keys):
        g = self.g_q if self.g_q is not None else torch.ones_like(self.s_q)
        return g.unsqueeze(-1), self.s_k.unsqueeze(-1)

    def __call__(self, b, h, q_idx, kv_idx):
        diff = self.s_q[b, h, q_idx] - self.s_k[b, h, kv_idx]
        if not self.causal:
            diff = diff.abs()
        if self.g_q is not None:
            diff = self.g_q[b, h, q_idx] * diff
        if self.kernel == "log":
            return -torch.log1p(diff * diff)
        return -diff


class Cable(PositionalEncoding):
    has_score_bias = True
    weighted = True
    kernel = "linear"
    gate_offset = False  # FoX: the projection has a learned offset per head

    def __init__(self, config):
        super().__init__(config)
        outputs = 2 if self.weighted else 1
        # One linear map per layer giving, per head, the bias logit (and the weight logit).
        self.proj = nn.ModuleList(nn.Linear(config.n_embd, outputs * config.n_head, bias=self.gate_offset)
                                  for _ in range(config.n_layer))
        for p in self.proj:
            nn.init.normal_(p.weight, std=0.02)
            if p.bias is not None:
                nn.init.zeros_(p.bias)
        self.activation = self.token_activation(config)

    def token_activation(self, config):
        """The map from a token's bias logit to its (non-negative) bias b."""
        if config.cable_bias_activation not in ("relu", "softplus"):
            raise ConfigError("cable_bias_activation must be 'relu' or 'softplus', "
                              f"got {config.cable_bias_activation!r}")
        return F.relu if config.cable_bias_activation == "relu" else F.softplus

    def score_bias(self, h, layer, offset, state):
        # Cumulative sums run in fp32 (or wider): at 15k tokens bf16 would lose the small differences S_i - S_j.
        proj = self.proj[layer]
        dtype = torch.promote_types(proj.weight.dtype, torch.float32)
        with torch.autocast(device_type=h.device.type, enabled=False):
            offsets = proj.bias.to(dtype) if proj.bias is not None else None
            out = F.linear(h.to(dtype), proj.weight.to(dtype), offsets).transpose(1, 2)  # (B, outputs*H, T)
            b = self.activation(out[:, : self.n_head])
            g = F.softplus(out[:, self.n_head :]) if self.weighted else None
            s_q = torch.cumsum(b, dim=-1)
            if offset:
                s_q = s_q + state["cable_s"][..., -1:]
                s_k = torch.cat([state["cable_s"], s_q], dim=-1)
            else:
                s_k = s_q
            if state is not None:
                state["cable_s"] = s_k
        return CableBias(s_q, s_k, g, q_offset=offset, causal=self.causal, kernel=self.kernel)


@register("cable")
class CableWeighted(Cable):
    """CABLE: ReLU token biases, cumulative sum, softplus per-token weight."""


@register("cable_nw")
class CableNoWeight(Cable):
    """CABLE_NW: CABLE without the per-token weight (g = 1)."""

    weighted = False


@register("k_cable")
class KernelCable(Cable):
    """K-CABLE: CABLE's weighted distance through the kernel -log(1 + x^2)."""

    kernel = "log"


def negative_log_sigmoid(logit: Tensor) -> Tensor:
    """-log sigmoid(z) = softplus(-z) >= 0: the penalty a forget gate sigmoid(z) adds per token."""
    return F.softplus(-logit)


@register("fox")
class ForgettingGate(Cable):
    """FoX (Lin et al., 2025): a forget gate per head and token, f_t = sigmoid(w . x_t + c), and
    bias[i, j] = sum_{j < u <= i} log f_u. With S_t = sum_{u <= t} -log f_u this is -(S_i - S_j):
    CABLE_NW with b_t = -log f_t, so it shares CABLE's cumulative sums, cache and fold path.

    Initialisation as FoX's data-dependent gate: weights N(0, 0.02), offset c = 0 (f = 1/2 at the start,
    a strong recency bias the model learns away from where it needs distant tokens).
    """

    weighted = False
    gate_offset = True

    def token_activation(self, config):
        return negative_log_sigmoid
