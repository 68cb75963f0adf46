"""RoPE: rotary position embedding on q and k (Su et al., 2021), with optional context-extension
scaling at evaluation: position interpolation (``linear``), NTK-aware base scaling (``ntk``), YaRN. The scalings'
original length is the length the weights were first trained at (``BackboneConfig.original_length``): in a context
extension stage, not the new block size."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

from ..errors import ConfigError
from .base import Encoding, PositionalEncoding

Scaling = Literal["none", "linear", "ntk", "yarn"]


def rope_frequencies(head_dim: int, base: float, scaling: str, factor: float, original_length: int):
    """Inverse frequencies (head_dim/2,), the position divisor, and the logit temperature factor (``scaling`` and
    ``factor`` as :class:`rope` checked them)."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim
    if scaling == "ntk":
        base = base * factor ** (head_dim / (head_dim - 2))
    inv_freq = base**-exponents
    position_divisor, mscale = 1.0, 1.0
    if scaling == "linear":
        position_divisor = factor
    elif scaling == "yarn":
        # Interpolate only the low frequencies (few rotations over the training length), keep the
        # high ones, ramping between 1 and 32 rotations; temper the logits by 0.1 ln(s) + 1.
        rotations = original_length * inv_freq / (2 * math.pi)
        keep = ((rotations - 1.0) / (32.0 - 1.0)).clamp(0.0, 1.0)
        inv_freq = keep * inv_freq + (1 - keep) * inv_freq / factor
        mscale = 0.1 * math.log(factor) + 1.0
    return inv_freq.float(), position_divisor, mscale


def rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


class Rope(PositionalEncoding):
    """RoPE on q and k; scaling modes for evaluating past the training length."""

    def __init__(self, settings: "rope", config):
        super().__init__(settings, config)
        inv_freq, self.position_divisor, self.mscale = rope_frequencies(
            self.head_dim, settings.base, settings.scaling, settings.scaling_factor, config.original_length
        )
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def rotate(self, q, k, offset, layer=0, key_padding=None, layout=None):
        t = q.shape[-2]
        if layout is not None:  # each row's positions: angles (B, 1, T, D/2)
            pos = layout.positions[:, None, :].float() / self.position_divisor
        else:
            pos = torch.arange(offset, offset + t, device=q.device, dtype=torch.float32) / self.position_divisor
        angles = pos[..., None] * self.inv_freq
        cos, sin = angles.cos() * self.mscale, angles.sin() * self.mscale
        return rotate(q, cos.to(q.dtype), sin.to(q.dtype)), rotate(k, cos.to(k.dtype), sin.to(k.dtype))


@dataclass
class rope(Encoding):
    """RoPE (Su et al., 2021): q and k rotated by their position, base ``base``. ``scaling`` (with
    ``scaling_factor``) changes how a trained model is run past its training length: position interpolation
    (``linear``), NTK-aware base scaling (``ntk``) or YaRN; records label it ``rope+linear4``."""

    base: float = 10000.0
    scaling: Scaling = "none"
    scaling_factor: float = 1.0

    module = Rope
    runtime = ("scaling", "scaling_factor")

    def __post_init__(self):
        super().__post_init__()
        if self.scaling_factor < 1:
            raise ConfigError(f"rope.scaling_factor must be >= 1, got {self.scaling_factor}")

    def label(self, runtime: bool = True) -> str:
        scaled = runtime and self.scaling != "none"
        return f"{self.name}+{self.scaling}{self.scaling_factor:g}" if scaled else self.name

    def check(self, config):
        if config.head_dim % 2:
            raise ConfigError(f"{self.name} rotates pairs of dimensions: head size {config.head_dim} "
                              f"(n_embd {config.n_embd} / n_head {config.n_head}) must be even")
