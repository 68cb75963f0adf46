"""SSMax, scalable softmax (Nakanishi, 2025, "Scalable-Softmax is superior for attention"): softmax(s log(n) z) in
place of softmax(z), with n the number of keys the query sees and s learned per layer and head, so that attention
does not flatten as n grows past the training length.

An encoding that wraps any other (its ``base``): the logits z = q.k / sqrt(d) are scaled by multiplying each query
row by s log(n) after the base's rotation, which keeps every backend the base runs on (a per-row scale of q leaves
the fold, SDPA and FlexAttention paths as they are). What the base adds besides the logits (a bias, CoPE's
positions) is not scaled. n counts the positions a query row sees, its own included: offset + i + 1 when causal,
at most the layer's window; every position (within the window) when bidirectional. At evaluation past the training
length n is the true count; under a layout, the count of its own document's tokens it sees (whatever the positions).
s starts at 1 / log(training length), so a new model is its base at the training length.
Runs, records and reports name it ``ssmax+<base>``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from .base import Chunks, Encoding, OverBase
from .layout import with_layout
from .registry import encoding_from
from .rope import Rope


def keys_seen(offset: int, t: int, causal: bool, window: int | Chunks | None, total: int | Tensor, device) -> Tensor:
    """(t,) how many positions each of the query rows at offset..offset+t-1 sees, its own included, among ``total``
    keys (or (B, t) for per-row totals (B, 1): a padded batch's real lengths)."""
    position = torch.arange(offset, offset + t, device=device)
    if causal:
        behind, ahead = position, torch.zeros_like(position)
    else:
        behind, ahead = position, total - 1 - position
    behind, ahead = within_window(behind, ahead, position, window)
    return behind + ahead + 1


def within_window(behind: Tensor, ahead: Tensor, index: Tensor, window: int | Chunks | None) -> tuple[Tensor, Tensor]:
    """The keys behind and ahead of the query at ``index`` that its window leaves it (a sliding window's width, or
    the rest of its chunk on each side)."""
    if isinstance(window, Chunks):
        into = index % window.size
        return torch.minimum(behind, into), torch.minimum(ahead, window.size - 1 - into)
    if window is not None:
        return behind.clamp(max=window - 1), ahead.clamp(max=window - 1)
    return behind, ahead


def keys_seen_in(layout, causal: bool, window: int | Chunks | None) -> Tensor:
    """(B, T) how many positions each token sees inside its own document (a layout's), its own included."""
    behind = layout.order
    index = torch.arange(behind.shape[-1], device=behind.device)
    ahead = torch.zeros_like(behind) if causal else layout.last - index
    behind, ahead = within_window(behind, ahead, index, window)
    return behind + ahead + 1


class LengthScaled(OverBase):
    """The base encoding's module, and s per layer and head scaling each query row by s log(n)."""

    def __init__(self, settings: "Ssmax", config):
        super().__init__(settings, config)
        self.scale = nn.Parameter(torch.full((config.n_layer, config.n_head), 1 / math.log(config.original_length)))

    per_layer = ("scale",)

    def rotate(self, q, k, offset, layer=0, key_padding=None, layout=None):
        q, k = super().rotate(q, k, offset, layer, key_padding, layout)
        t = q.shape[-2]
        # a padded row's keys are its real ones (moved to the front), as when the row runs alone
        total = offset + t if key_padding is None else key_padding.sum(dim=-1, keepdim=True)  # (B, 1)
        if layout is not None:
            n = keys_seen_in(layout, self.causal, self.window(layer))  # (B, T)
        else:
            n = keys_seen(offset, t, self.causal, self.window(layer), total, q.device).clamp(min=1)  # (T,) or (B, T)
        factor = self.scale[layer].view(-1, 1, 1) * torch.log(n.to(self.scale.dtype)).unsqueeze(-1).unsqueeze(-3)
        return q * factor.to(q.dtype), k

    def score_bias(self, h, layer, offset, state, layout=None):
        return self.base.score_bias(h, layer, offset, state, **with_layout(layout))


@dataclass
class Ssmax(Encoding):
    """SSMax over ``base`` (any encoding): queries scaled by s log(n), n the positions a query sees, s learned per
    layer and head."""

    base: Encoding = field(default_factory=Rope)

    name = "ssmax"
    module = LengthScaled

    def __post_init__(self):
        super().__post_init__()
        self.base = encoding_from(self.base)

    @property
    def scores(self) -> str:
        return self.base.scores

    def label(self, runtime: bool = True) -> str:
        return f"ssmax+{self.base.label(runtime)}"

    def longest_length(self, block_size):
        return self.base.longest_length(block_size)

    def check(self, config):
        self.base.check(config)
