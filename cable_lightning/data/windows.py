"""Evaluation windows over a fixed stream of validation tokens.

Non-overlapping (the CABLE paper's protocol): windows of L tokens side by side, every target scored.
Sliding (ALiBi paper, appendix B): windows of L tokens advance by S and only the last S targets of
each window are scored, so every token is scored exactly once with at least L - S tokens of context
(fewer only at the very start). Stride L is the non-overlapping protocol.

Both score the same ``budget`` targets for every length, so lengths compare on the same text.
"""

from __future__ import annotations

import torch
from torch.utils.data import Dataset

from ..errors import ConfigError


def window_plan(n_tokens: int, length: int, stride: int) -> list[tuple[int, int]]:
    """(start, first_scored) per window over a stream of ``n_tokens`` tokens.

    A window's inputs are tokens[start : start + length] and its targets tokens[start + 1 : start + length + 1];
    targets before relative index ``first_scored`` are context only.
    """
    if length < 1 or not 1 <= stride <= length:
        raise ConfigError(f"need length >= 1 and 1 <= stride <= length, got length={length}, stride={stride}")
    if n_tokens < length + 1:
        raise ConfigError(f"a window of {length} tokens needs {length + 1} tokens of text, the stream has {n_tokens}")
    plan = [(0, 0)]
    last_scored = length  # absolute index of the last scored target
    while last_scored < n_tokens - 1:
        end = min(last_scored + stride, n_tokens - 1)
        start = end - length
        plan.append((start, last_scored - start))
        last_scored = end
    return plan


class EvalWindows(Dataset):
    """The windows of one (length, stride), this rank's share only (ranks take every world-th window),
    so no window is padded in or counted twice under DDP."""

    def __init__(self, tokens: torch.Tensor, length: int, stride: int, rank: int = 0, world_size: int = 1):
        self.tokens, self.length = tokens, length
        self.plan = window_plan(len(tokens), length, stride)[rank::world_size]

    def __len__(self):
        return len(self.plan)

    def __getitem__(self, i):
        start, first_scored = self.plan[i]
        return {"tokens": self.tokens[start : start + self.length + 1], "first_scored": first_scored, "start": start}


def scored_targets(targets: torch.Tensor, first_scored: torch.Tensor) -> torch.Tensor:
    """``targets`` with -100 (ignored) before each row's first scored position."""
    positions = torch.arange(targets.shape[1], device=targets.device)[None, :]
    return targets.masked_fill(positions < first_scored.to(targets.device)[:, None], -100)
