"""Absolute encodings added once to the token embeddings, and NoPE."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn

from ..errors import ConfigError
from .base import Encoding, PositionalEncoding


class LearnedTable(PositionalEncoding):
    relative = False
    def __init__(self, settings, config):
        super().__init__(settings, config)
        self.table = nn.Embedding(self.longest, config.n_embd)
        nn.init.normal_(self.table.weight, std=0.02)

    def embed(self, x, offset, layout=None):
        if layout is not None:  # each token's own row of the table
            self.check_layout(layout)
            return x + self.table.weight[layout.positions]
        self.check_length(offset + x.shape[1])
        return x + self.table.weight[offset : offset + x.shape[1]]


@dataclass
class Learnable(Encoding):
    """A learned table of ``max_positions`` vectors (GPT-2's; default: the training length); it cannot extrapolate
    past its size."""

    max_positions: Optional[int] = None

    name = "learnable"
    module = LearnedTable

    def __post_init__(self):
        super().__post_init__()
        if self.max_positions is not None and self.max_positions < 1:
            raise ConfigError(f"learnable.max_positions must be >= 1 (or unset: the training length), "
                              f"got {self.max_positions}")

    def longest_length(self, block_size):
        return self.max_positions or block_size


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


class SinusoidalTable(PositionalEncoding):
    relative = False
    def embed(self, x, offset, layout=None):
        if layout is not None:
            table = sinusoidal_table(layout.positions.flatten(), x.shape[-1]).view(*layout.positions.shape, -1)
            return x + SINUSOIDAL_SCALE * table.to(x.dtype)
        positions = torch.arange(offset, offset + x.shape[1], device=x.device)
        return x + SINUSOIDAL_SCALE * sinusoidal_table(positions, x.shape[-1]).to(x.dtype)


@dataclass
class Sinusoidal(Encoding):
    """The original Transformer's fixed sinusoidal table, computed for any length, at the token embeddings' scale."""

    name = "sinusoidal"
    module = SinusoidalTable


class OrderOnly(PositionalEncoding):
    reads_positions = False  # nothing of position; under a layout, attention's document mask is all it sees


@dataclass
class Nope(Encoding):
    """No positional information (causal masking alone carries order)."""

    name = "nope"
    module = OrderOnly
