"""Evaluation windows: every token scored once, enough context, stride L == non-overlapping."""

import pytest
import torch

from cable_lightning.data.windows import EvalWindows, scored_targets, window_plan


def scored(plan, length):
    """Absolute target index -> context size (tokens before it inside its window)."""
    out = {}
    for start, first in plan:
        for rel in range(first, length):
            target = start + 1 + rel
            assert target not in out, f"target {target} scored twice"
            out[target] = rel + 1
    return out


@pytest.mark.parametrize("n,length,stride", [(101, 10, 1), (101, 10, 3), (101, 10, 10), (64, 16, 5), (17, 16, 4),
                                             (1000, 128, 32)])
def test_sliding_windows_score_every_token_once_with_enough_context(n, length, stride):
    plan = window_plan(n, length, stride)
    targets = scored(plan, length)
    assert sorted(targets) == list(range(1, n))
    for target, context in targets.items():
        assert context >= min(length - stride, target)
        assert context <= length
    assert all(0 <= start and start + length + 1 <= n for start, _ in plan)


def test_stride_equal_to_length_is_non_overlapping():
    plan = window_plan(1 + 4 * 25, 25, 25)
    assert plan == [(0, 0), (25, 0), (50, 0), (75, 0)]


def test_bad_windows_are_named():
    with pytest.raises(ValueError, match="needs 33 tokens"):
        window_plan(20, 32, 32)
    with pytest.raises(ValueError, match="stride"):
        window_plan(100, 8, 9)


def test_ranks_split_windows_without_duplicates():
    tokens = torch.arange(201)
    shares = [EvalWindows(tokens, 20, 5, rank=r, world_size=3) for r in range(3)]
    everything = EvalWindows(tokens, 20, 5)
    starts = sorted(w["tokens"][0].item() for s in shares for w in (s[i] for i in range(len(s))))
    assert starts == sorted(everything[i]["tokens"][0].item() for i in range(len(everything)))


def test_scored_targets_masks_context_positions():
    targets = torch.arange(12).view(2, 6)
    out = scored_targets(targets, torch.tensor([0, 4]))
    assert out[0].tolist() == list(range(6))
    assert out[1].tolist() == [-100, -100, -100, -100, 10, 11]
