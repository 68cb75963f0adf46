"""Masked-LM masking (lit/masking.py): BERT's 80/10/10 statistics, masks by stream position, GPT-2's mask slot."""

from __future__ import annotations

import pytest
import torch

from cable_lightning.lit.masking import mask_tokens

pytestmark = pytest.mark.usefixtures("no_network")


def test_mask_tokens_statistics():
    vocab, mask_id, specials = 1000, 1, (0, 1, 2)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(3, vocab, (64, 1024), generator=gen)
    ids[:, ::16] = 0  # document separators sprinkled through
    ids[:, 5::32] = 2
    inputs, labels = mask_tokens(ids, mask_id, vocab, generator=torch.Generator().manual_seed(1), special_ids=specials)

    special = torch.isin(ids, torch.tensor(specials))
    chosen = labels != -100
    assert not (chosen & special).any(), "special tokens are never chosen"
    assert torch.equal(labels[chosen], ids[chosen])
    assert torch.equal(inputs[~chosen], ids[~chosen])
    rate = chosen.sum() / (~special).sum()
    assert 0.145 < rate < 0.155
    masked = (inputs == mask_id) & chosen
    kept = (inputs == ids) & chosen
    replaced = chosen & ~masked & ~kept
    n = chosen.sum()
    assert 0.79 < masked.sum() / n < 0.81
    assert 0.09 < kept.sum() / n < 0.11
    assert 0.09 < replaced.sum() / n < 0.11
    assert not torch.isin(inputs[replaced], torch.tensor(specials)).any(), "random tokens never forge specials"
    again = mask_tokens(ids, mask_id, vocab, generator=torch.Generator().manual_seed(1), special_ids=specials)
    assert torch.equal(again[0], inputs) and torch.equal(again[1], labels)
    assert torch.equal(ids[:, ::16], torch.zeros_like(ids[:, ::16])), "input tensor left untouched"


def test_evaluation_masks_a_token_by_its_stream_position_whatever_window_holds_it():
    """MLM perplexity at several lengths must score the same masked tokens: the masking of the validation stream
    cut into windows of 32 equals its masking cut into windows of 128 (DRAW_BLOCK boundaries crossed), and a
    different seed masks other tokens."""
    from cable_lightning.lit.masking import DRAW_BLOCK, position_draws

    stream = torch.randint(3, 1000, (2 * DRAW_BLOCK + 256,), generator=torch.Generator().manual_seed(5))
    stream[::50] = 0  # separators: never chosen, at every length

    def masked(length, seed=11):
        windows = stream[: len(stream) // length * length].view(-1, length)
        positions = torch.arange(windows.numel()).view_as(windows)
        inputs, labels = mask_tokens(windows, 1, 1000, draws=position_draws(positions, seed), special_ids=(0, 1))
        return inputs.flatten(), labels.flatten()

    short, long = masked(32), masked(128)
    assert torch.equal(short[0], long[0]) and torch.equal(short[1], long[1])
    chosen = short[1] != -100
    assert 0.13 < chosen.float().mean() < 0.17 and not (stream[: len(chosen)][chosen] == 0).any()
    assert not torch.equal(masked(32, seed=12)[1], short[1])


def test_mask_tokens_gpt2_mask_slot():
    """GPT-2's mask id is one past its vocabulary; random replacements stay inside the vocabulary."""
    ids = torch.randint(0, 50256, (4, 512), generator=torch.Generator().manual_seed(3))
    inputs, labels = mask_tokens(ids, 50257, 50257, generator=torch.Generator().manual_seed(4), special_ids=(50256,))
    assert int(inputs.max()) == 50257 and int(inputs[inputs != 50257].max()) < 50256
