"""CABLE: context-aware additive biases, and its NW and kernelised variants (FoX, in fox.py, is one of them too).

Per layer and head, from the layer's normalised input x_t:
    b_t = ReLU(w_c . x_t) >= 0        (softplus in the paper's first version: ``bias_activation``)
    S_t = sum_{u <= t} b_u
    g_t = softplus(w_s . x_t) > 0     (CABLE_NW: g = 1)
    bias[i, j] = -g_i * (S_i - S_j)   causal;   -g_i * |S_i - S_j| bidirectional
    K-CABLE:     -log(1 + (g_i * (S_i - S_j))^2)
With b = 1 and g = ALiBi's slope this is exactly ALiBi. The sums count tokens, not position indices: under a layout
they restart at each document's first token (and ignore the layout's positions).

The authors' released code (axiomlab/Cable, src/Cable.py) is the CABLE_NW form with softplus increments, which
``cable_nw`` with ``bias_activation: softplus`` is (tests/test_reference_encodings.py compares them). It differs in two
ways the project does not follow: its projection has a per-head offset (an nn.Linear bias, initialised to 0), which
CABLE's equations do not have; and it divides q and k by sqrt(C / n_embd) = 1, leaving q.k unscaled, where the paper
and every encoding here scale it by 1/sqrt(d).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .base import Encoding, PositionalEncoding, ScoreBias


class CableBias(ScoreBias):
    """The bias from per-token cumulative sums. ``s_q``/``g_q``: (B, H, Tq) for queries; ``s_k``: (B, H, Tk)."""

    def __init__(self, s_q: Tensor, s_k: Tensor, g_q: Tensor | None, q_offset: int, causal: bool,
                 kernel: str = "linear", layout=None):
        super().__init__(q_offset, causal, layout)
        self.s_q, self.s_k, self.g_q, self.kernel = s_q, s_k, g_q, kernel

    @property
    def foldable(self) -> bool:
        # -g_i (S_i - S_j) = g_i . (S_j - S_i); |S_i - S_j| (bidirectional) and log1p do not split.
        return self.causal and self.kernel == "linear"

    def factors(self, n_keys):
        g = self.g_q if self.g_q is not None else torch.ones_like(self.s_q)
        return g.unsqueeze(-1), self.s_k.unsqueeze(-1)

    def rows(self, start, end, n_keys, batch, heads, device, first_key=0):
        """The block of the bias by slicing the sums (no index grids); built in place when nothing needs its
        gradient (evaluation), so that a block costs one (B, H, rows, keys) tensor, not one per operation."""
        diff = self.s_q[:, :, start:end, None] - self.s_k[:, :, None, first_key:n_keys]
        weight = None if self.g_q is None else self.g_q[:, :, start:end, None]
        return self._bias(diff, weight, in_place=not diff.requires_grad)

    def __call__(self, b, h, q_idx, kv_idx):
        weight = None if self.g_q is None else self.g_q[b, h, q_idx]
        return self._bias(self.s_q[b, h, q_idx] - self.s_k[b, h, kv_idx], weight, in_place=False)

    def _bias(self, diff: Tensor, weight: Tensor | None, in_place: bool) -> Tensor:
        """-g_i (S_i - S_j) (|S_i - S_j| bidirectional; K-CABLE through -log(1 + x^2)) from ``diff`` = S_i - S_j."""
        if not self.causal:
            diff = diff.abs_() if in_place else diff.abs()
        if self.kernel == "log":
            if weight is not None:
                diff = diff.mul_(weight) if in_place else weight * diff
            return diff.square_().log1p_().neg_() if in_place else -torch.log1p(diff * diff)
        if in_place:  # one pass: the sign rides on the (small) weights
            return diff.mul_(-weight) if weight is not None else diff.neg_()
        return -(weight * diff) if weight is not None else -diff


class CumulativeBias(PositionalEncoding):
    """The module of every encoding built on cumulative sums of per-token biases (CABLE, its variants, FoX). Its
    settings class says ``weighted`` (a per-token weight g), ``kernel`` (linear or log), ``gate_offset`` (a learned
    offset per head) and ``token_bias`` (the map from a token's bias logit to its bias b >= 0)."""

    def __init__(self, settings, config):
        super().__init__(settings, config)
        self.weighted, self.kernel = settings.weighted, settings.kernel
        self.activation = settings.token_bias()
        # The per-token quantities, in the order of the projection's outputs: name -> the map from its logits.
        self.maps = {"increment": self.activation} | ({"weight": F.softplus} if self.weighted else {})
        self.maps |= self.extra_maps(settings, config)
        # One linear map per layer giving, per head, each quantity's logit.
        self.proj = nn.ModuleList(nn.Linear(config.n_embd, len(self.maps) * config.n_head, bias=settings.gate_offset)
                                  for _ in range(config.n_layer))
        for p in self.proj:
            nn.init.normal_(p.weight, std=0.02)
            if p.bias is not None:
                nn.init.zeros_(p.bias)

    per_layer = ("proj",)

    reads_positions = False  # sums of per-token biases along the tokens, restarting at each document

    def extra_maps(self, settings, config) -> dict:
        """Per-token quantities a variant adds after the increment and the weight (none here)."""
        return {}

    def per_token(self, h: Tensor, layer: int) -> dict[str, Tensor]:
        """Each quantity of :attr:`maps` (B, H, T) in fp32 or wider: at 15k tokens bf16 would lose the small
        differences S_i - S_j of their sums."""
        proj = self.proj[layer]
        dtype = torch.promote_types(proj.weight.dtype, torch.float32)
        with torch.autocast(device_type=h.device.type, enabled=False):
            offsets = proj.bias.to(dtype) if proj.bias is not None else None
            out = F.linear(h.to(dtype), proj.weight.to(dtype), offsets).transpose(1, 2)  # (B, quantities*H, T)
            return {name: map_(part) for (name, map_), part in zip(self.maps.items(), out.split(self.n_head, dim=1))}

    def token_increments(self, h, layer, layout=None):
        return self.per_token(h, layer)

    def sums(self, b: Tensor, offset: int, state: dict | None, layout=None, key: str = "cable_s"):
        """(S for the queries, S for every key): cumulative sums of ``b`` along the tokens (restarting at each
        document of a layout), continuing the cache's ``key``."""
        with torch.autocast(device_type=b.device.type, enabled=False):
            s_q = torch.cumsum(b, dim=-1) if layout is None else layout.restart_sums(b)
            if offset:
                s_q = s_q + state[key][..., -1:]
                s_k = torch.cat([state[key], s_q], dim=-1)
            else:
                s_k = s_q
            if state is not None:
                state[key] = s_k
        return s_q, s_k

    def score_bias(self, h, layer, offset, state, layout=None):
        found = self.per_token(h, layer)
        s_q, s_k = self.sums(found["increment"], offset, state, layout)
        return CableBias(s_q, s_k, found.get("weight"), q_offset=offset, causal=self.causal, kernel=self.kernel,
                         layout=layout)


@dataclass
class Cable(Encoding):
    """CABLE (Veisi et al., 2025): per-token biases b = ``bias_activation``(w . x) summed along the sequence, times a
    softplus per-token weight: bias[i, j] = -g_i (S_i - S_j)."""

    bias_activation: Literal["relu", "softplus"] = "relu"

    name = "cable"
    module = CumulativeBias
    scores = "foldable_bias"
    weighted = True
    kernel = "linear"
    gate_offset = False

    def token_bias(self):
        return F.relu if self.bias_activation == "relu" else F.softplus


@dataclass
class CableNw(Cable):
    """CABLE_NW: CABLE without the per-token weight (g = 1)."""

    name = "cable_nw"
    weighted = False


@dataclass
class KCable(Cable):
    """K-CABLE: CABLE's weighted distance through the kernel -log(1 + x^2) (which the fold cannot split)."""

    name = "k_cable"
    scores = "bias"
    kernel = "log"
