"""Where each token of a batch sits: its position index and its document (docs/training_distances.md).

A :class:`Layout` is one per forward: ``positions`` (B, T), the index each position-reading encoding uses for a token
(RoPE's angle, ALiBi's and T5's distance, FIRE's normaliser, an absolute table's row), and ``documents`` (B, T), the
document each token belongs to (None: one document per row). Attention keeps every query inside its own document
(``models.attention``); an encoding that keeps state along the sequence restarts it at each document (CABLE's and
FoX's cumulative sums, SSMax's count of keys; CoPE's counts and stick-breaking's sticks span only keys a query sees, so
they restart through the mask). Without explicit positions, positions restart at 0 at each document; explicit ones
(randomized, PoSE-style skips, a shift) must increase along each document.

No layout (None) is today's contiguous 0..T-1 in one document, and every encoding's code for it is unchanged: a
layout is only built where training asks for one, never for a KV cache or a padded batch.
"""

from __future__ import annotations

from functools import cached_property

import torch
from torch import Tensor


def with_layout(layout: "Layout | None") -> dict:
    """A hook's keyword for a layout, only when there is one: an encoding written before layouts (hooks without a
    ``layout`` parameter) runs as it did wherever none is given, also under a wrapper (DAPEv2, SSMax, layers)."""
    return {} if layout is None else {"layout": layout}


class Layout:
    """``positions`` (B, T) int64 and ``documents`` (B, T) int64 non-decreasing along each row, or None."""

    def __init__(self, positions: Tensor, documents: Tensor | None = None):
        self.positions, self.documents = positions, documents
        self.masks: dict = {}  # what attention builds from the layout once per forward and reuses in every layer

    @classmethod
    def build(cls, batch: int, length: int, device, documents: Tensor | None = None,
              positions: Tensor | None = None) -> "Layout":
        """A checked layout for a (batch, length) input; a bad one is one line naming what is wrong. Without
        ``positions``, each document's tokens are at 0, 1, 2, ..."""
        for name, value in (("documents", documents), ("positions", positions)):
            if value is not None and (value.dim() not in (1, 2) or value.shape[-1] != length
                                      or value.dim() == 2 and value.shape[0] not in (1, batch)
                                      or value.dtype.is_floating_point):
                raise ValueError(f"{name} must be integers of shape ({batch}, {length}) or ({length},) like the "
                                 f"input ids; got {value.dtype} {tuple(value.shape)}")
        if documents is not None:
            documents = documents.to(device=device, dtype=torch.long).expand(batch, length)
            if length > 1 and bool((documents.diff(dim=-1) < 0).any()):
                raise ValueError("documents must not decrease along a row (one run of tokens per document); got "
                                 f"{documents[0].tolist()[:16]}...")
        if positions is None:
            layout = cls(torch.arange(length, device=device).expand(batch, length), documents)
            layout.positions = layout.order
            return layout
        positions = positions.to(device=device, dtype=torch.long).expand(batch, length)
        if bool((positions < 0).any()):
            raise ValueError(f"positions must be >= 0; got {int(positions.min())}")
        if length > 1:
            step = positions.diff(dim=-1)
            if documents is not None:
                step = step.masked_fill(documents.diff(dim=-1) != 0, 1)  # a new document may start anywhere
            if bool((step <= 0).any()):
                raise ValueError("positions must increase along each document (ordered, as randomized positions and "
                                 "PoSE's skips are); a row has a step of " + str(int(step.min())))
        return cls(positions, documents)

    @property
    def batch(self) -> int:
        return self.positions.shape[0]

    @cached_property
    def extent(self) -> int:
        """How many positions an encoding must serve: the largest position + 1."""
        return int(self.positions.max()) + 1 if self.positions.numel() else 0

    @cached_property
    def first(self) -> Tensor:
        """(B, T) the index of the first token of each token's document."""
        if self.documents is None:
            return torch.zeros_like(self.positions)
        index = torch.arange(self.documents.shape[-1], device=self.documents.device)
        starts = torch.ones_like(self.documents, dtype=torch.bool)
        starts[:, 1:] = self.documents[:, 1:] != self.documents[:, :-1]
        return torch.where(starts, index, 0).cummax(dim=-1).values

    @cached_property
    def last(self) -> Tensor:
        """(B, T) the index of the last token of each token's document."""
        t = self.positions.shape[-1]
        if self.documents is None:
            return torch.full_like(self.positions, t - 1)
        index = torch.arange(t, device=self.documents.device)
        ends = torch.ones_like(self.documents, dtype=torch.bool)
        ends[:, :-1] = self.documents[:, :-1] != self.documents[:, 1:]
        return torch.where(ends, index, t).flip(-1).cummin(dim=-1).values.flip(-1)

    @cached_property
    def order(self) -> Tensor:
        """(B, T) each token's index inside its document (0 at a document's first token); what counts of tokens
        (SSMax's keys seen) read, whatever the positions."""
        return torch.arange(self.positions.shape[-1], device=self.positions.device) - self.first

    def restart_sums(self, values: Tensor) -> Tensor:
        """Cumulative sums of ``values`` (B, H, T) along the tokens, from zero at each document's first token."""
        sums = torch.cumsum(values, dim=-1)
        if self.documents is None:
            return sums
        before = sums - values  # the sum of every token before this one
        first = self.first[:, None, :].expand_as(values)
        return sums - before.gather(-1, first)

    def same_document(self, rows: slice, keys: slice) -> Tensor | None:
        """(B, 1, rows, keys) True where a query row and a key are in one document; None without documents."""
        if self.documents is None:
            return None
        return self.documents[:, None, rows, None] == self.documents[:, None, None, keys]
