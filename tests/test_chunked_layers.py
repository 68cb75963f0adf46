"""Llama 4's chunked layers (``@cC`` in a ``layers`` pattern) and its query temperature: the chunk mask against
transformers' own chunked causal mask, every backend against a dense reference in values and gradients, and the
temperature against the expression transformers' Llama 4 attention applies, with its defaults."""


import pytest
import torch
from conftest import dense_attention, randomised

from cable_lightning.models import BackboneConfig, KVCache, build_backbone
from cable_lightning.models import attention as attn_mod
from cable_lightning.models.attention import attention
from cable_lightning.positional import build_positional, from_label
from cable_lightning.positional.base import Chunks, visible_keys
from cable_lightning.positional.layers import query_temperature

HEADS, WIDTH = 2, 16


def small_config(pe, **overrides):
    return BackboneConfig(pos_encoding=pe, **(dict(n_layer=2, n_head=HEADS, n_embd=WIDTH, vocab_size=97,
                                                   block_size=16) | overrides))


def test_the_chunk_mask_is_transformers_chunked_causal_mask():
    from transformers.masking_utils import chunked_causal_mask_function

    mask = chunked_causal_mask_function(5, torch.zeros(1, dtype=torch.long))
    for q_offset in (0, 3, 12):
        q_idx = torch.arange(7).view(-1, 1) + q_offset
        kv_idx = torch.arange(q_offset + 7).view(1, -1)
        theirs = mask(torch.zeros(1, dtype=torch.long), 0, q_idx, kv_idx)
        ours = visible_keys(0, 7, 0, q_offset + 7, q_offset, True, Chunks(5), "cpu")
        assert torch.equal(ours, theirs.expand_as(ours)), q_offset


def chunk_reference(q, k, v, bias_rows, causal, size):
    """softmax(q.k / sqrt(d) + bias) v with every key outside the query's chunk (and the future) masked, densely."""
    i, j = torch.arange(q.shape[-2]).view(-1, 1), torch.arange(k.shape[-2]).view(1, -1)
    return dense_attention(q, k, v, bias_rows, (i // size == j // size) & ((j <= i) if causal else True))


@pytest.mark.parametrize("pe, backend, causal", [
    (pe, backend, causal) for causal in (True, False)
    for pe, backend in [("nope", "sdpa"), ("cable", "fold"), ("alibi", "fold"), ("kerple_log", "chunked"),
                        ("cable", "chunked"), ("rope", "materialized")]
    if causal or backend != "fold"])
def test_chunks_on_every_backend_match_a_dense_chunk_mask_in_values_and_gradients(pe, backend, causal, monkeypatch):
    monkeypatch.setattr(attn_mod, "CHUNK_ELEMENTS", 2 * HEADS * 24 * 6)  # several row blocks, some across chunks
    torch.manual_seed(0)
    t = 23
    q, k, v = (torch.randn(2, HEADS, t, 8, dtype=torch.float64, requires_grad=True) for _ in range(3))
    module = randomised(build_positional(small_config(pe, causal=causal))).double()
    h = torch.randn(2, t, WIDTH, dtype=torch.float64, requires_grad=True)
    tolerance = dict(atol=2e-6, rtol=1e-5) if backend == "fold" else dict(atol=1e-9, rtol=1e-7)
    for size in (1, 5, 8, 100):
        out = attention(q, k, v, module.score_bias(h, 1, 0, None), causal, backend=backend, window=Chunks(size))
        bias = module.score_bias(h, 1, 0, None)
        rows = bias.rows(0, t, t, 2, HEADS, "cpu") if bias is not None else 0.0
        ref = chunk_reference(q, k, v, rows, causal, size)
        torch.testing.assert_close(out, ref, **tolerance)
        weight = torch.randn_like(out)
        for got, want in zip(torch.autograd.grad((out * weight).sum(), [q, k, v, h], allow_unused=True),
                             torch.autograd.grad((ref * weight).sum(), [q, k, v, h], allow_unused=True)):
            assert (got is None) == (want is None)
            if want is not None:
                torch.testing.assert_close(got, want, **tolerance)


def test_chunks_on_flex_match_a_dense_chunk_mask():
    """FlexAttention's block mask; on CPU it runs forward only."""
    torch.manual_seed(1)
    q, k, v = (torch.randn(2, HEADS, 21, 8) for _ in range(3))
    module = randomised(build_positional(small_config("alibi")))
    bias = module.score_bias(torch.randn(2, 21, WIDTH), 1, 0, None)
    with torch.no_grad():
        out = attention(q, k, v, bias, True, backend="flex", window=Chunks(6))
    torch.testing.assert_close(out, chunk_reference(q, k, v, bias.rows(0, 21, 21, 2, HEADS, "cpu"), True, 6),
                               atol=2e-5, rtol=1e-4)


def test_a_chunked_layer_sees_nothing_of_the_chunk_before():
    """One RoPE layer over chunks of 4: changing token 5 changes outputs 5..7 (the rest of its chunk) and nothing
    before or after."""
    model = randomised(build_backbone(small_config("layers-rope@c4", n_layer=1)).eval())
    x = torch.randint(0, 97, (1, 12))
    y = x.clone()
    y[0, 5] = (x[0, 5] + 1) % 97
    with torch.no_grad():
        changed = (model(x) - model(y)).abs().amax(-1)[0] > 1e-6
    assert changed.tolist() == [False] * 5 + [True] * 3 + [False] * 4


def test_the_temperature_is_llama_4s_on_the_nope_layers_only_and_labels_records_not_runs():
    from transformers import Llama4TextConfig

    defaults = Llama4TextConfig()
    positions = torch.tensor([0, 8190, 8191, 20000, 100000, 10**6])
    theirs = torch.log1p(torch.floor((positions.float() + 1.0) / defaults.floor_scale)) * defaults.attn_scale + 1.0
    torch.testing.assert_close(query_temperature(positions, defaults.floor_scale, defaults.attn_scale), theirs)
    assert query_temperature(positions, 8192, 0.1)[:2].tolist() == [1.0, 1.0]  # 1 below the floor

    tempered = from_label("layers-rope@c4-nope")
    tempered.temperature_floor = 4
    pe = build_positional(small_config(tempered))
    q = torch.randn(1, HEADS, 6, 8)
    scale = query_temperature(torch.arange(10, 16), 4, 0.1)
    torch.testing.assert_close(pe.rotate(q, q, 10, 1)[0], q * scale[:, None])  # layer 1: NoPE
    plain = build_positional(small_config("layers-rope@c4-nope"))
    torch.testing.assert_close(pe.rotate(q, q, 10, 0)[0], plain.rotate(q, q, 10, 0)[0])  # layer 0: RoPE, untouched
    assert tempered.label() == "layers-rope@c4-nope+temp4" and tempered.label(runtime=False) == "layers-rope@c4-nope"
    assert "pos_encoding.temperature_floor" not in tempered.weight_settings()


def test_a_tempered_pattern_decodes_onto_a_cache_as_its_full_forward():
    tempered = from_label("layers-rope@c3-nope")
    tempered.temperature_floor = 2
    model = randomised(build_backbone(small_config(tempered, n_layer=2)).eval())
    x = torch.randint(0, 97, (2, 10))
    with torch.no_grad():
        full = model(x)
        cache = KVCache(2)
        steps = [model(x[:, :4], cache)] + [model(x[:, i : i + 1], cache) for i in range(4, 10)]
    torch.testing.assert_close(torch.cat(steps, dim=1), full, atol=1e-5, rtol=1e-4)


def test_a_bad_temperature_floor_is_one_line():
    with pytest.raises(ValueError, match=r"^layers.temperature_floor must be a number of positions >= 1"):
        from_label("layers-rope@c4-nope").__class__(pattern="rope@c4-nope", temperature_floor=0)
