"""The order-aware bidirectional CABLE (``cable_dir``, the project's own form): its bias against a loop written from
its definition, both sides of a pair of identical tokens told apart, the causal form exactly CABLE's (weights, cache
and fold). Export, layouts, cached decoding and the backends run for it through the registry's lists
(test_backbone.py, test_export.py, test_positional_layout.py, test_attention.py)."""

import pytest
import torch
import torch.nn.functional as F
from conftest import randomised

from cable_lightning.models import BackboneConfig, build_backbone
from cable_lightning.positional import build_positional
from cable_lightning.positional.cable_dir import CableDir

HEADS, WIDTH = 2, 16


def config(pe, causal=False, **overrides):
    return BackboneConfig(pos_encoding=pe, n_layer=2, n_head=HEADS, n_embd=WIDTH, vocab_size=97, block_size=16,
                          causal=causal, **overrides)


@pytest.mark.parametrize("order", ["weights", "increments"])
@torch.no_grad()
def test_bias_against_a_loop_over_the_definition(order):
    pe = randomised(build_positional(config(CableDir(order=order))))
    t = 7
    h = torch.randn(1, t, WIDTH)
    rows = pe.score_bias(h, 1, 0, None).rows(0, t, t, 1, HEADS, "cpu")
    out = h[0] @ pe.proj[1].weight.T  # (T, 3H): increment, weight, right-hand quantity
    b, g, extra = F.relu(out[:, :HEADS]), F.softplus(out[:, HEADS:2 * HEADS]), out[:, 2 * HEADS:]
    for head in range(HEADS):
        for i in range(t):
            for j in range(t):
                if j <= i:
                    expected = -g[i, head] * sum(b[u, head] for u in range(j + 1, i + 1))
                elif order == "weights":
                    expected = -F.softplus(extra[i, head]) * sum(b[u, head] for u in range(i + 1, j + 1))
                else:
                    expected = -g[i, head] * sum(F.relu(extra[u, head]) for u in range(i + 1, j + 1))
                assert rows[0, head, i, j].item() == pytest.approx(float(expected), abs=1e-5)


@torch.no_grad()
def test_with_equal_sides_it_is_cables_bidirectional_bias():
    """Right weights equal to the left ones give -g_i |S_i - S_j|: CABLE's bidirectional form."""
    pe = randomised(build_positional(config(CableDir())))
    reference = build_positional(config("cable"))
    for mine, theirs in zip(pe.proj, reference.proj):
        mine.weight[2 * HEADS:] = mine.weight[HEADS:2 * HEADS]
        theirs.weight.copy_(mine.weight[:2 * HEADS])
    h = torch.randn(2, 9, WIDTH)
    ours = pe.score_bias(h, 0, 0, None).rows(0, 9, 9, 2, HEADS, "cpu")
    cables = reference.score_bias(h, 0, 0, None).rows(0, 9, 9, 2, HEADS, "cpu")
    torch.testing.assert_close(ours, cables)


@pytest.mark.parametrize("order", ["weights", "increments"])
@torch.no_grad()
def test_two_identical_neighbours_are_told_apart_where_cable_cannot(order):
    """Two [MASK]-like tokens side by side with every increment equal: CABLE gives their rows mirror images (each
    sees the other at the same bias); the sided form gives the left one's right neighbour another bias than the
    right one's left neighbour."""
    pe = randomised(build_positional(config(CableDir(order=order))))
    h = torch.randn(1, 6, WIDTH)
    h[0, 3] = h[0, 2]  # positions 2 and 3 hold the same input
    rows = pe.score_bias(h, 0, 0, None).rows(0, 6, 6, 1, HEADS, "cpu")[0]
    assert not torch.allclose(rows[:, 2, 3], rows[:, 3, 2])
    cable = build_positional(config("cable"))
    for mine, theirs in zip(pe.proj, cable.proj):
        theirs.weight.copy_(mine.weight[:2 * HEADS])
    symmetric = cable.score_bias(h, 0, 0, None).rows(0, 6, 6, 1, HEADS, "cpu")[0]
    torch.testing.assert_close(symmetric[:, 2, 3], symmetric[:, 3, 2])


def test_the_causal_form_is_cables_module_weights_and_output():
    torch.manual_seed(0)
    ours = build_backbone(config(CableDir(), causal=True))
    torch.manual_seed(0)
    cables = build_backbone(config("cable", causal=True))
    assert {k: v.shape for k, v in ours.state_dict().items()} == {k: v.shape for k, v in cables.state_dict().items()}
    cables.load_state_dict(ours.state_dict())
    ids = torch.randint(0, 97, (2, 12))
    with torch.no_grad():
        torch.testing.assert_close(ours(ids), cables(ids))
        bias = ours.pe.score_bias(torch.randn(2, 12, WIDTH), 0, 0, None)
    assert bias.foldable and type(bias).__name__ == "CableBias"


def test_a_bad_order_is_named_with_the_valid_ones():
    with pytest.raises(Exception, match=r"cable_dir.order='left' is not valid; valid: weights, increments"):
        CableDir(order="left")
