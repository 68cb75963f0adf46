"""ALiBi: fixed per-head linear distance penalties (Press et al., 2022)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .base import Encoding, PositionalBias, PositionalEncoding


def alibi_slopes(n_head: int) -> torch.Tensor:
    """2^(-8h/H) for h = 1..H when H is a power of two; otherwise the ALiBi paper's interpolation:
    the slopes of the nearest smaller power of two, then every other slope of the next power of two."""

    def geometric(n):
        return [2.0 ** (-8.0 * h / n) for h in range(1, n + 1)]

    if math.log2(n_head).is_integer():
        slopes = geometric(n_head)
    else:
        lower = 2 ** math.floor(math.log2(n_head))
        slopes = geometric(lower) + geometric(2 * lower)[0::2][: n_head - lower]
    return torch.tensor(slopes, dtype=torch.float32)


class AlibiBias(PositionalBias):
    def __init__(self, slopes, q_offset, causal, layout=None):
        super().__init__(q_offset, causal, layout)
        self.slopes = slopes

    @property
    def foldable(self) -> bool:
        return self.causal  # -m (i - j) = m . (j - i); the bidirectional -m |i - j| does not split

    def at(self, h, i, j):
        return -self.slopes[h] * (i - j).abs()

    def factors(self, n_keys):
        if self.layout is not None:  # each row's own positions (B, 1, n_keys, 1)
            return self.slopes.view(1, -1, 1, 1), self.layout.positions[:, None, :n_keys, None].float()
        positions = torch.arange(n_keys, device=self.slopes.device, dtype=torch.float32)
        return self.slopes.view(1, -1, 1, 1), positions.view(1, 1, -1, 1)


class AlibiModule(PositionalEncoding):
    def __init__(self, settings, config):
        super().__init__(settings, config)
        self.register_buffer("slopes", alibi_slopes(config.n_head), persistent=False)

    def score_bias(self, h, layer, offset, state, layout=None):
        return AlibiBias(self.slopes, offset, self.causal, layout)


@dataclass
class Alibi(Encoding):
    """ALiBi: bias -m_h |i - j| with fixed geometric slopes, not scaled by 1/sqrt(d)."""

    name = "alibi"
    module = AlibiModule
    scores = "foldable_bias"
