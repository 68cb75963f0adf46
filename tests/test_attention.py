"""Every attention backend against the materialised reference, for every score-bias PE."""

import pytest
import torch

from cable_lightning.models import BackboneConfig
from cable_lightning.models import attention as attn_mod
from cable_lightning.models.attention import attention
from cable_lightning.positional import available, build_positional
from cable_lightning.positional.alibi import AlibiBias, alibi_slopes
from cable_lightning.positional.cable import CableBias

BIAS_PES = [name for name in available() if build_positional(BackboneConfig(pos_encoding=name, n_layer=1, n_head=4, n_embd=32)).has_score_bias]


def test_bias_pes_are_the_expected_family():
    assert sorted(BIAS_PES) == sorted(["alibi", "cable", "cable_nw", "fire", "k_cable", "kerple_log", "kerple_power", "t5"])


def make_inputs(pe_name, causal, t, seed=0):
    torch.manual_seed(seed)
    config = BackboneConfig(pos_encoding=pe_name, n_layer=2, n_head=4, n_embd=32, causal=causal, block_size=16)
    pe = build_positional(config)
    with torch.no_grad():  # make every learned PE non-trivial
        for p in pe.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    h = torch.randn(2, t, 32, requires_grad=True)
    q, k, v = (torch.randn(2, 4, t, 8, requires_grad=True) for _ in range(3))
    return pe, h, q, k, v


def run(backend, pe, h, q, k, v, causal):
    bias = pe.score_bias(h, 1, 0, None)
    return attention(q, k, v, bias, causal, backend=backend)


def grads(out, tensors):
    torch.manual_seed(1)
    weight = torch.randn_like(out)
    return torch.autograd.grad((out * weight).sum(), tensors, allow_unused=True)


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidirectional"])
@pytest.mark.parametrize("t", [1, 7, 129])
@pytest.mark.parametrize("pe_name", BIAS_PES)
def test_chunked_matches_reference_values_and_gradients(pe_name, t, causal, monkeypatch):
    # Small blocks so a 129-token sequence spans several row blocks.
    monkeypatch.setattr(attn_mod, "CHUNK_ELEMENTS", 2 * 4 * 129 * 10)
    pe, h, q, k, v = make_inputs(pe_name, causal, t)
    tensors = [q, k, v, h] + list(pe.parameters())
    ref = run("materialized", pe, h, q, k, v, causal)
    out = run("chunked", pe, h, q, k, v, causal)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-4)
    for g_out, g_ref in zip(grads(out, tensors), grads(ref, tensors)):
        if g_ref is None:
            assert g_out is None
        else:
            torch.testing.assert_close(g_out, g_ref, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidirectional"])
@pytest.mark.parametrize("t", [1, 7, 129])
@pytest.mark.parametrize("pe_name", BIAS_PES)
def test_flex_matches_reference(pe_name, t, causal):
    """FlexAttention's score_mod is the pointwise form of each bias; on CPU it runs forward only."""
    pe, h, q, k, v = make_inputs(pe_name, causal, t)
    h, q, k, v = (x.detach() for x in (h, q, k, v))
    with torch.no_grad():
        ref = run("materialized", pe, h, q, k, v, causal)
        out = run("flex", pe, h, q, k, v, causal)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-4)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="FlexAttention backward needs CUDA on this torch build")
@pytest.mark.parametrize("pe_name", BIAS_PES)
def test_flex_gradients_on_cuda(pe_name):
    pe, h, q, k, v = make_inputs(pe_name, True, 129)
    pe, h, q, k, v = pe.cuda(), h.detach().cuda().requires_grad_(), *(x.detach().cuda().requires_grad_() for x in (q, k, v))
    tensors = [q, k, v, h] + list(pe.parameters())
    ref, out = run("materialized", pe, h, q, k, v, True), run("flex", pe, h, q, k, v, True)
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-3)
    for g_out, g_ref in zip(grads(out, tensors), grads(ref, tensors)):
        if g_ref is not None:
            torch.testing.assert_close(g_out, g_ref, atol=1e-4, rtol=1e-3)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("t", [1, 7, 129])
def test_sdpa_without_bias_matches_reference(t, causal):
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 4, t, 8) for _ in range(3))
    torch.testing.assert_close(attention(q, k, v, None, causal, backend="sdpa"),
                               attention(q, k, v, None, causal, backend="materialized"), atol=2e-5, rtol=1e-4)


def test_sdpa_refuses_a_score_bias():
    q = torch.randn(1, 4, 3, 8)
    bias = AlibiBias(alibi_slopes(4), 0, True)
    with pytest.raises(ValueError, match="cannot add a score bias"):
        attention(q, q, q, bias, True, backend="sdpa")


def test_alibi_slopes_match_the_paper():
    torch.testing.assert_close(alibi_slopes(8), torch.tensor([2.0 ** -(i + 1) for i in range(8)]))
    # Non-power-of-two: the 4-head slopes, then every other 8-head slope.
    expected = [2.0**-2, 2.0**-4, 2.0**-6, 2.0**-8, 2.0**-1, 2.0**-3]
    torch.testing.assert_close(alibi_slopes(6), torch.tensor(expected))


@pytest.mark.parametrize("causal", [True, False])
def test_cable_with_unit_bias_and_slope_weight_is_alibi(causal):
    b, h, t = 2, 8, 37
    slopes = alibi_slopes(h)
    s = torch.cumsum(torch.ones(b, h, t), dim=-1)
    g = slopes.view(1, h, 1).expand(b, h, t)
    cable = CableBias(s, s, g, q_offset=0, causal=causal).rows(0, t, t, b, h, "cpu")
    alibi = AlibiBias(slopes, 0, causal).rows(0, t, t, b, h, "cpu").expand(b, h, t, t)
    if causal:  # only j <= i is ever used
        keep = torch.ones(t, t, dtype=torch.bool).tril()
        cable, alibi = cable[..., keep], alibi[..., keep]
    assert torch.equal(cable, alibi)


def test_cable_bias_sign_and_formula_against_loops():
    torch.manual_seed(0)
    s = torch.cumsum(torch.rand(1, 2, 6), dim=-1)
    g = torch.rand(1, 2, 6) + 0.5
    rows = CableBias(s, s, g, 0, causal=True).rows(0, 6, 6, 1, 2, "cpu")
    k_rows = CableBias(s, s, g, 0, causal=True, kernel="log").rows(0, 6, 6, 1, 2, "cpu")
    for hh in range(2):
        for i in range(6):
            for j in range(i + 1):
                expected = -g[0, hh, i] * (s[0, hh, i] - s[0, hh, j])
                assert rows[0, hh, i, j] == pytest.approx(expected.item(), abs=1e-6)
                assert rows[0, hh, i, j] <= 0  # a penalty growing with (context-weighted) distance
                assert k_rows[0, hh, i, j] == pytest.approx(-torch.log1p(expected**2).item(), abs=1e-6)


def test_cable_nw_is_cable_with_unit_weight():
    torch.manual_seed(0)
    base = dict(n_layer=1, n_head=4, n_embd=32, block_size=16)
    cable = build_positional(BackboneConfig(pos_encoding="cable", **base))
    nw = build_positional(BackboneConfig(pos_encoding="cable_nw", **base))
    with torch.no_grad():
        nw.proj[0].weight.copy_(cable.proj[0].weight[:4])
    h = torch.randn(2, 9, 32)
    nw_rows = nw.score_bias(h, 0, 0, None).rows(0, 9, 9, 2, 4, "cpu")
    cb = cable.score_bias(h, 0, 0, None)
    unit = CableBias(cb.s_q, cb.s_k, torch.ones_like(cb.g_q), 0, causal=True).rows(0, 9, 9, 2, 4, "cpu")
    torch.testing.assert_close(nw_rows, unit)
    assert not torch.allclose(cb.rows(0, 9, 9, 2, 4, "cpu"), unit)  # the weight does act


def test_t5_buckets():
    from cable_lightning.positional.t5 import relative_bucket

    rel = torch.tensor([0, 1, 15, 16, 127, 128, 5000, -3])
    causal = relative_bucket(rel, causal=True).tolist()
    assert causal[:3] == [0, 1, 15] and causal[3] == 16 and causal[5] == 31 and causal[6] == 31 and causal[7] == 0
    assert causal == sorted(causal[:7]) + [0]
    bidir = relative_bucket(rel, causal=False)
    assert bidir[7] == 16 + 3 and bidir[0] == 0 and bidir[6] == 15


def test_auto_backend_choice():
    from cable_lightning.models.attention import resolve_backend

    bias = AlibiBias(alibi_slopes(4), 0, True)
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert resolve_backend("auto", None, cuda) == "sdpa"
    assert resolve_backend("auto", bias, cuda) == "flex"
    assert resolve_backend("auto", bias, cuda, q_offset=5) == "chunked"  # decoding onto a cache
    assert resolve_backend("auto", bias, cpu) == "chunked"
    with pytest.raises(ValueError, match="unknown attention backend 'fast'"):
        resolve_backend("fast", bias, cpu)
