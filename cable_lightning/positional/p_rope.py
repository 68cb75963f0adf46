"""p-RoPE (Barbero et al., ICLR 2025, "Round and Round We Go! What makes Rotary Positional Encodings useful?"):
RoPE on the highest ``fraction`` of its frequencies only. The lowest frequencies barely turn over a training length,
so models use those channels for content rather than position; p-RoPE leaves them unrotated (frequency 0).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import ConfigError
from .rope import Rope, RopeModule


class PartialRope(RopeModule):
    def __init__(self, settings: "PRope", config):
        super().__init__(settings, config)
        # inv_freq falls with its index: the highest come first. int(p D // 2) of them, as transformers'
        # proportional RoPE counts them (the reference test compares the two).
        kept = int(settings.fraction * self.head_dim // 2)
        self.inv_freq[kept:] = 0.0


@dataclass
class PRope(Rope):
    """RoPE's settings and scalings, rotating only the highest ``fraction`` of the frequencies (1: RoPE, 0: NoPE)."""

    fraction: float = 0.75

    name = "p_rope"
    module = PartialRope

    def __post_init__(self):
        super().__post_init__()
        if not 0.0 <= self.fraction <= 1.0:
            raise ConfigError(f"p_rope.fraction must be in [0, 1] (the share of frequencies rotated), "
                              f"got {self.fraction}")
