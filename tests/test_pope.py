"""PoPE against its formula written out per pair of positions: q.k after :meth:`rotate`, at the scale attention
applies (the width it sees, 2D), must be sum_c softplus(q_c) softplus(k_c) cos((i - j) theta_c - delta_c) / sqrt(D),
with delta clamped to [-2 pi, 0] and theta_c = base^(-c / D), in values and in the gradients of q, k and delta."""

import math

import torch

from cable_lightning.models import BackboneConfig
from cable_lightning.positional.pope import Pope


def module(n_layer=2, n_head=2, n_embd=16, base=10000.0):
    config = BackboneConfig(preset="gpt2-tiny", pos_encoding=Pope(base=base), n_layer=n_layer, n_head=n_head,
                            n_embd=n_embd, vocab_size=32, block_size=16)
    return config.pos_encoding.build(config).double()


def reference_logits(q, k, phase, base, q_positions, k_positions):
    """(B, H, Tq, Tk), one sum over the components for every (i, j): the formula as the paper states it."""
    batch, heads, tq, d = q.shape
    out = torch.zeros(batch, heads, tq, k.shape[-2], dtype=q.dtype)
    delta = phase.clamp(-2 * math.pi, 0.0)
    for i in range(tq):
        for j in range(k.shape[-2]):
            theta = torch.tensor([base ** (-c / d) for c in range(d)], dtype=q.dtype)
            angle = (q_positions[i] - k_positions[j]) * theta - delta  # (H, D)
            out[:, :, i, j] = (torch.nn.functional.softplus(q[:, :, i]) * torch.nn.functional.softplus(k[:, :, j])
                               * angle.cos()).sum(-1)
    return out / math.sqrt(d)


def test_the_logits_after_rotation_are_the_polar_formula_in_values_and_gradients():
    torch.manual_seed(0)
    pe = module(base=50.0)  # a small base: the low frequencies turn within the test's positions too
    with torch.no_grad():  # phases inside, at and past the clamp's ends
        pe.phase.copy_(torch.empty_like(pe.phase).uniform_(-8.0, 2.0))
    q = torch.randn(2, 2, 5, 8, dtype=torch.float64, requires_grad=True)
    k = torch.randn(2, 2, 7, 8, dtype=torch.float64, requires_grad=True)
    for layer in (0, 1):
        rq, rk = pe.rotate(q, k[:, :, :5], offset=0, layer=layer)
        _, rk_all = pe.rotate(k, k, offset=0, layer=layer)
        rq_late, _ = pe.rotate(q, q, offset=2, layer=layer)  # queries at positions 2..6 against keys 0..6
        assert rq.shape[-1] == rk.shape[-1] == 16
        got = rq_late @ rk_all.transpose(-1, -2) / math.sqrt(rq.shape[-1])
        want = reference_logits(q, k, pe.phase[layer], 50.0, range(2, 7), range(7))
        torch.testing.assert_close(got, want)
        weights = torch.randn_like(got)
        grads = torch.autograd.grad((got * weights).sum(), (q, k, pe.phase))
        expected = torch.autograd.grad((want * weights).sum(), (q, k, pe.phase))
        for g, e in zip(grads, expected):
            torch.testing.assert_close(g, e)


def test_the_logits_depend_on_the_distance_alone_and_the_phase_gets_no_gradient_past_its_clamp():
    torch.manual_seed(1)
    pe = module()
    q, k = torch.randn(1, 2, 4, 8, dtype=torch.float64), torch.randn(1, 2, 4, 8, dtype=torch.float64)
    near = [pe.rotate(q, k, offset=offset) for offset in (0, 1000)]
    logits = [a @ b.transpose(-1, -2) for a, b in near]
    torch.testing.assert_close(logits[0], logits[1])
    with torch.no_grad():
        pe.phase.fill_(1.0)  # above 0: clamped, so a step does not move it
    rq, rk = pe.rotate(q, k, offset=0)
    (rq @ rk.transpose(-1, -2)).sum().backward()
    assert pe.phase.grad.abs().max() == 0
