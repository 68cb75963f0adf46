"""Absolute encodings added once to the token embeddings, and NoPE."""

from __future__ import annotations

import torch
from torch import nn

from .base import PositionalEncoding, UnsupportedLengthError
from .registry import register


@register("learnable")
class Learnable(PositionalEncoding):
    """A learned table of ``max_positions`` vectors (GPT-2's); it cannot extrapolate past its size."""

    def __init__(self, config):
        super().__init__(config)
        self.max_positions = config.max_positions or config.block_size
        self.table = nn.Embedding(self.max_positions, config.n_embd)
        nn.init.normal_(self.table.weight, std=0.02)

    def check_length(self, total_length):
        if total_length > self.max_positions:
            raise UnsupportedLengthError(
                f"sequence length {total_length} exceeds the learnable position table "
                f"({self.max_positions} positions); "
                f"learnable absolute positions cannot extrapolate: use lengths <= {self.max_positions} "
                "or a relative encoding"
            )

    def embed(self, x, offset):
        self.check_length(offset + x.shape[1])
        return x + self.table.weight[offset : offset + x.shape[1]]


def sinusoidal_table(positions: torch.Tensor, dim: int) -> torch.Tensor:
    """The Transformer's fixed table: sin/cos of position / 10000^(2i/d), any length."""
    freqs = 10000.0 ** (-torch.arange(0, dim, 2, dtype=torch.float32, device=positions.device) / dim)
    angles = positions.float()[:, None] * freqs[None, :]
    table = torch.zeros(len(positions), dim, device=positions.device)
    table[:, 0::2] = angles.sin()
    table[:, 1::2] = angles.cos()
    return table


# The table's entries have RMS 1/sqrt(2); GPT-2-initialised token embeddings have std 0.02. Unscaled,
# positions would outweigh tokens 35:1 at initialisation (the original Transformer instead scaled its
# embeddings up by sqrt(d)); scaled, both start at the same magnitude, like a learnable table.
SINUSOIDAL_SCALE = 0.02 * 2**0.5


@register("sinusoidal")
class Sinusoidal(PositionalEncoding):
    """The original fixed sinusoidal table, computed for any length, at the token embeddings' scale."""

    def embed(self, x, offset):
        positions = torch.arange(offset, offset + x.shape[1], device=x.device)
        return x + SINUSOIDAL_SCALE * sinusoidal_table(positions, x.shape[-1]).to(x.dtype)


@register("nope")
class NoPE(PositionalEncoding):
    """No positional information (causal masking alone carries order)."""
