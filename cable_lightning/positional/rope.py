"""RoPE: rotary position embedding on q and k (Su et al., 2021), with optional context-extension
scaling at evaluation: position interpolation (``linear``), NTK-aware base scaling (``ntk``), YaRN. The scalings'
original length is the length the weights were first trained at (``BackboneConfig.original_length``): in a context
extension stage, not the new block size.

``yarn`` is YaRN as its authors' code and transformers compute it (``_compute_yarn_parameters``; the reference tests
compare them): the kept share of each frequency ramps linearly in the dimension index, from 1 at the last dimension
that turns at least beta_fast = 32 times over the original length (rounded down) to 0 at the first that turns at most
beta_slow = 1 time (rounded up). ``yarn_paper`` is the equation the YaRN paper prints (Peng et al., 2023): the
share ramps linearly in the rotation count r itself, (r - 1) / (32 - 1). Both temper the logits by
(0.1 ln s + 1)^2 (the factor on cos and sin of q and of k).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

from ..errors import ConfigError
from .base import Encoding, PositionalEncoding

Scaling = Literal["none", "linear", "ntk", "yarn", "yarn_paper"]
# YaRN's ramp ends, in rotations over the original length (its beta_fast and beta_slow)
YARN_FAST_ROTATIONS, YARN_SLOW_ROTATIONS = 32.0, 1.0


def yarn_kept_share(head_dim: int, base: float, original_length: int, inv_freq: torch.Tensor, ramp: str) -> Tensor:
    """(head_dim/2,) the share of each frequency YaRN keeps (1: as trained, 0: interpolated by the factor).
    ``ramp`` ``yarn``: linear in the dimension index between the correction dimensions, as the reference code;
    ``yarn_paper``: linear in the rotation count, as the paper's equation."""
    if ramp == "yarn_paper":
        rotations = original_length * inv_freq / (2 * math.pi)
        return ((rotations - YARN_SLOW_ROTATIONS) / (YARN_FAST_ROTATIONS - YARN_SLOW_ROTATIONS)).clamp(0.0, 1.0)

    def dimension(rotations):  # the (fractional) pair index whose frequency turns `rotations` times
        return head_dim * math.log(original_length / (rotations * 2 * math.pi)) / (2 * math.log(base))

    first = max(math.floor(dimension(YARN_FAST_ROTATIONS)), 0)
    last = min(math.ceil(dimension(YARN_SLOW_ROTATIONS)), head_dim - 1)
    if last == first:
        last += 0.001  # one dimension wide: the reference's guard against dividing by zero
    index = torch.arange(head_dim // 2, dtype=torch.float64)
    return 1.0 - ((index - first) / (last - first)).clamp(0.0, 1.0)


def rope_frequencies(head_dim: int, base: float, scaling: str, factor: float, original_length: int):
    """Inverse frequencies (head_dim/2,), the position divisor, and the logit temperature factor (``scaling`` and
    ``factor`` as :class:`Rope` checked them)."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim
    if scaling == "ntk":
        base = base * factor ** (head_dim / (head_dim - 2))
    inv_freq = base**-exponents
    position_divisor, mscale = 1.0, 1.0
    if scaling == "linear":
        position_divisor = factor
    elif scaling in ("yarn", "yarn_paper"):
        # Interpolate only the low frequencies (few rotations over the training length), keep the high ones;
        # temper the logits by 0.1 ln(s) + 1 on q and on k.
        keep = yarn_kept_share(head_dim, base, original_length, inv_freq, scaling)
        inv_freq = keep * inv_freq + (1 - keep) * inv_freq / factor
        mscale = 0.1 * math.log(factor) + 1.0
    return inv_freq.float(), position_divisor, mscale


def rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


class RopeModule(PositionalEncoding):
    """RoPE on q and k; scaling modes for evaluating past the training length."""

    def __init__(self, settings: "Rope", config):
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
class Rope(Encoding):
    """RoPE (Su et al., 2021): q and k rotated by their position, base ``base``. ``scaling`` (with
    ``scaling_factor``) changes how a trained model is run past its training length: position interpolation
    (``linear``), NTK-aware base scaling (``ntk``), YaRN as its reference code computes it (``yarn``) or as the YaRN
    paper's equation prints it (``yarn_paper``); records label it ``rope+linear4``."""

    base: float = 10000.0
    scaling: Scaling = "none"
    scaling_factor: float = 1.0

    name = "rope"
    module = RopeModule
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
