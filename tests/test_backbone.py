"""Backbone behaviour: causality, incremental decoding, RoPE, presets, errors, memory at long lengths."""

import math

import pytest
import torch
import torch.nn.functional as F
from conftest import LargestTensor

from cable_lightning.models import BackboneConfig, KVCache, build_backbone
from cable_lightning.models import attention as attn_mod
from cable_lightning.models import backbone as backbone_mod
from cable_lightning.models.attention import attention
from cable_lightning.models.config import split_switches
from cable_lightning.positional import UnsupportedLengthError, available, from_label, score_bias_encodings
from cable_lightning.positional.absolute import Learnable
from cable_lightning.positional.rope import Rope

# Every encoding, and DAPEv2 over every encoding it can wrap: the properties below hold for all of them.
VARIANTS = sorted({from_label(pe).label() for pe in available() + [f"dape_v2+{pe}" for pe in score_bias_encodings()]})
# Every encoding with every attention switch that can go beside it (the sink beside a softmax only).
SWITCHED = [pe + "+attn_gate" + ("+attn_sink" if from_label(pe).softmax else "") + "+qk_norm" for pe in available()]


def tiny(pe, causal=True, **overrides):
    """``pe``: an encoding's label (``dape_v2+cable``, with switches: ``rope+attn_sink``) or settings
    (``learnable(max_positions=16)``)."""
    torch.manual_seed(0)
    switches = {}
    if isinstance(pe, str):
        pe, on = split_switches(pe)
        switches = dict.fromkeys(on, True)
    config = BackboneConfig(pos_encoding=pe, n_layer=2, n_head=4, n_embd=32, vocab_size=97, causal=causal,
                            block_size=64, **switches, **overrides)
    model = build_backbone(config).eval()
    switches_at_init = (".attn.sink", ".attn.q_norm.weight", ".attn.k_norm.weight")  # 0 and 1: trivial values
    with torch.no_grad():  # make learned PE and switch parameters non-trivial (T5 and a sink start at zero)
        for p in [*model.pe.parameters(),
                  *(p for name, p in model.named_parameters() if name.endswith(switches_at_init))]:
            p.add_(torch.randn_like(p) * 0.3)
    return model


@pytest.mark.parametrize("pe", VARIANTS + SWITCHED)
def test_no_future_token_leaks(pe, monkeypatch):
    monkeypatch.setattr(attn_mod, "CHUNK_ELEMENTS", 4 * 40 * 8)  # several query blocks
    model = tiny(pe)
    x = torch.randint(0, 97, (1, 40))
    t = 23
    y = x.clone()
    y[0, t] = (x[0, t] + 1) % 97
    with torch.no_grad():
        a, b = model(x), model(y)
    assert torch.equal(a[:, :t], b[:, :t])
    assert not torch.allclose(a[:, t], b[:, t])


@pytest.mark.parametrize("pe", VARIANTS)
def test_bidirectional_encoder_sees_both_directions(pe):
    model = tiny(pe, causal=False)
    x = torch.randint(0, 97, (1, 12))
    y = x.clone()
    y[0, 8] = (x[0, 8] + 1) % 97
    with torch.no_grad():
        assert not torch.allclose(model(x)[:, 2], model(y)[:, 2])


@pytest.mark.parametrize("pe", VARIANTS + SWITCHED)
def test_incremental_decoding_equals_full_forward(pe):
    model = tiny(pe)
    x = torch.randint(0, 97, (2, 14))
    with torch.no_grad():
        full = model(x)
        cache = KVCache(2)
        steps = [model(x[:, :5], cache)]  # prefill
        steps.append(model(x[:, 5:8], cache))  # several tokens onto a cache
        steps += [model(x[:, i : i + 1], cache) for i in range(8, 14)]  # one token at a time
    torch.testing.assert_close(torch.cat(steps, dim=1), full, atol=1e-5, rtol=1e-4)
    assert cache.length == 14


def padded_against_alone(pe, causal, monkeypatch, gradients):
    """Left, right, no and all padding in one batch: real tokens get the hidden states (and the gradients) of
    their row's real tokens run alone, padding gets zeros, rows come back in their order, and each layer's attention
    runs once per group of similar lengths: lengths 16, 15 and 14 together (rows 0, 2, 1: one padded to the right,
    one to the left), 6 alone, the empty row not at all."""
    model = tiny(pe, causal=causal)
    x = torch.randint(0, 97, (5, 16))
    spans = [(0, 16), (2, 16), (0, 15), (0, 6), (0, 0)]  # full, left-padded, right-padded, short, all padding
    mask = torch.zeros(5, 16, dtype=torch.long)
    for row, (start, stop) in enumerate(spans):
        mask[row, start:stop] = 1
    calls = []
    monkeypatch.setattr(backbone_mod, "attention",
                        lambda q, *a, **kw: calls.append(q.shape[0]) or attention(q, *a, **kw))
    weight = torch.randn(5, 16, 32)
    with torch.set_grad_enabled(gradients):
        padded = model.hidden_states(x, padding_mask=mask)
        assert calls == [3, 3, 1, 1]
        grad = torch.autograd.grad((padded * weight).sum(), model.wte.weight)[0] if gradients else None
        alone_grad = 0
        for row, (start, stop) in enumerate(spans):
            if start == stop:
                assert not padded[row].any()
                continue
            alone = model.hidden_states(x[row : row + 1, start:stop])[0]
            torch.testing.assert_close(padded[row, start:stop], alone, atol=1e-5, rtol=1e-4)
            assert not padded[row, :start].any() and not padded[row, stop:].any()
            if gradients:
                alone_grad += torch.autograd.grad((alone * weight[row, start:stop]).sum(), model.wte.weight)[0]
    if gradients:  # relative to the largest: DAPEv2's LeakyReLU turns fp32 rounding into a few larger elements
        assert (grad - alone_grad).abs().max() <= 1e-4 * alone_grad.abs().max()


# Causal rows are moved to the front of the batch and never see their padding (no mask): a few encodings show the
# positions are right (absolute, FIRE's, CoPE's, DAPEv2's); bidirectional attention masks the padding: all of them.
PADDED_CASES = ([(pe, False) for pe in VARIANTS + SWITCHED]
                + [(pe, True) for pe in ["cable", "fox", "learnable", "sinusoidal", "fire", "cope", "dape_v2+cable"]])


@pytest.mark.parametrize("pe, causal", PADDED_CASES)
def test_a_padded_batch_in_one_call_equals_each_row_run_alone(pe, causal, monkeypatch):
    padded_against_alone(pe, causal, monkeypatch, gradients=False)


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidirectional"])
@pytest.mark.parametrize("pe", ["cable", "fox", "sinusoidal", "dape_v2+cable"])
def test_a_padded_batch_has_each_row_s_gradients(pe, causal, monkeypatch):
    padded_against_alone(pe, causal, monkeypatch, gradients=True)


def test_padding_mask_errors_are_one_line():
    model = tiny("cable")
    x = torch.randint(0, 97, (2, 6))
    with pytest.raises(ValueError, match=r"^padding_mask rows must be one run of ones \(left or right padding\)$"):
        model.hidden_states(x, padding_mask=torch.tensor([[1, 0, 1, 1, 1, 1], [1] * 6]))
    with pytest.raises(ValueError, match=r"cannot use the KV cache.*one prompt at a time"):
        model.hidden_states(x, KVCache(2), padding_mask=torch.tensor([[0, 1, 1, 1, 1, 1], [1] * 6]))


def test_cable_cache_keeps_cumulative_sums_so_a_step_is_linear():
    model = tiny("cable")
    cache = KVCache(2)
    with torch.no_grad():
        model(torch.randint(0, 97, (1, 10)), cache)
        model(torch.randint(0, 97, (1, 1)), cache)
    s = cache.layers[0]["cable_s"]
    assert s.shape == (1, 4, 11)
    assert torch.all(s[..., 1:] >= s[..., :-1])  # a running sum of non-negative token biases


def test_generate_greedy_matches_argmax_of_full_forward():
    model = tiny("cable")
    prompt = torch.randint(0, 97, (1, 6))
    out = model.generate(prompt, max_new_tokens=5, temperature=0)
    seq = prompt
    with torch.no_grad():
        for _ in range(5):
            seq = torch.cat([seq, model(seq)[:, -1].argmax(-1, keepdim=True)], dim=1)
    assert torch.equal(out, seq)
    sampled = model.generate(prompt, 4, temperature=0.8, top_k=5, generator=torch.Generator().manual_seed(0))
    assert sampled.shape == (1, 10) and int(sampled.max()) < 97


def test_generate_refuses_a_bidirectional_backbone():
    with pytest.raises(ValueError, match="causal"):
        tiny("alibi", causal=False).generate(torch.zeros(1, 2, dtype=torch.long), 1)


def rotary(**shape):
    """The RoPE module of a backbone of this shape (``pos_encoding``: its settings)."""
    config = BackboneConfig(**shape)
    return config.pos_encoding.build(config)


def test_rope_scores_depend_only_on_relative_position():
    pe = rotary(pos_encoding=Rope(), n_layer=1, n_head=1, n_embd=16)
    torch.manual_seed(0)
    q = torch.randn(16).expand(1, 1, 40, 16)
    k = torch.randn(16).expand(1, 1, 40, 16)
    qr, kr = pe.rotate(q, k, 0)
    scores = (qr @ kr.transpose(-1, -2))[0, 0]
    for shift in (1, 5, 17):
        torch.testing.assert_close(scores[shift:, shift:], scores[:-shift, :-shift], atol=1e-4, rtol=1e-4)
    qo, ko = pe.rotate(q[:, :, :10], k[:, :, :10], 7)  # an offset (cache) rotates like the full sequence
    torch.testing.assert_close(qo, qr[:, :, 7:17], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("mode", ["linear", "ntk", "yarn"])
def test_rope_scaling_with_factor_one_is_plain_rope(mode):
    torch.manual_seed(0)
    q, k = torch.randn(2, 2, 50, 16), torch.randn(2, 2, 50, 16)
    shape = dict(n_layer=1, n_head=2, n_embd=32, block_size=32)
    plain = rotary(pos_encoding=Rope(), **shape).rotate(q, k, 3)
    scaled = rotary(pos_encoding=Rope(scaling=mode, scaling_factor=1.0), **shape).rotate(q, k, 3)
    torch.testing.assert_close(scaled, plain)
    stretched = rotary(pos_encoding=Rope(scaling=mode, scaling_factor=4.0), **shape).rotate(q, k, 3)
    assert not torch.allclose(stretched[0], plain[0])


def test_linear_rope_scaling_is_position_interpolation():
    torch.manual_seed(0)
    q = torch.randn(1, 1, 8, 16)
    shape = dict(n_layer=1, n_head=1, n_embd=16)
    scaled = rotary(pos_encoding=Rope(scaling="linear", scaling_factor=2.0), **shape).rotate(q, q, 0)[0]
    plain = rotary(pos_encoding=Rope(), **shape)
    # Position 2p under factor 2 rotates like position p unscaled.
    torch.testing.assert_close(scaled[:, :, 2:3], plain.rotate(q[:, :, 2:3], q[:, :, 2:3], 1)[0], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("fraction", [0.0, 0.5, 1.0])
def test_p_rope_rotates_the_highest_frequencies_and_leaves_the_rest(fraction):
    """Each pair (i, i + D/2) against a 2x2 rotation written out by hand: angle position * base^(-2i/D) for the first
    round(fraction * D/2) pairs (the highest frequencies), no rotation for the others."""
    from cable_lightning.positional.p_rope import PRope

    torch.manual_seed(0)
    d, positions = 16, 9
    q = torch.randn(1, 1, positions, d, dtype=torch.float64)
    rotated = rotary(pos_encoding=PRope(fraction=fraction, base=100.0), n_layer=1, n_head=1, n_embd=d)
    got = rotated.rotate(q.float(), q.float(), 0)[0][0, 0].double()
    kept = int(fraction * d // 2)
    for t in range(positions):
        for i in range(d // 2):
            angle = t * 100.0 ** (-2 * i / d) if i < kept else 0.0
            c, s = math.cos(angle), math.sin(angle)
            x, y = q[0, 0, t, i].item(), q[0, 0, t, i + d // 2].item()
            assert got[t, i].item() == pytest.approx(c * x - s * y, abs=1e-5)
            assert got[t, i + d // 2].item() == pytest.approx(s * x + c * y, abs=1e-5)


def count(preset, **kw):
    with torch.device("meta"):
        model = build_backbone(BackboneConfig(preset=preset, pos_encoding="nope", **kw))
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("preset,expected", [("gpt2-tiny", 44.6e6), ("gpt2-small", 123.6e6), ("gpt2-medium", 353.5e6),
                                             ("bert-base", 110e6)])
def test_preset_parameter_counts(preset, expected):
    n = count(preset)
    assert abs(n - expected) / expected < 0.03, f"{preset}: {n / 1e6:.1f}M"


def test_presets_pad_vocab_and_allow_overrides():
    config = BackboneConfig(preset="gpt2-small", n_layer=3, dropout=0.1)
    assert (config.n_layer, config.n_head, config.n_embd, config.dropout) == (3, 12, 768, 0.1)
    assert config.padded_vocab_size == 50304
    assert BackboneConfig(preset="bert-base").causal is False


def test_learnable_positions_refuse_longer_inputs_in_one_line():
    model = tiny(Learnable(max_positions=16))
    model(torch.zeros(1, 16, dtype=torch.long))
    with pytest.raises(UnsupportedLengthError) as err:
        model(torch.zeros(1, 17, dtype=torch.long))
    message = str(err.value)
    assert "17" in message and "16" in message and "cannot extrapolate" in message and "\n" not in message


def test_unknown_encoding_lists_valid_names_in_one_line():
    with pytest.raises(ValueError) as err:
        build_backbone(BackboneConfig(pos_encoding="rotary", n_layer=1, n_head=2, n_embd=16))
    message = str(err.value)
    assert "'rotary'" in message and all(name in message for name in available()) and "\n" not in message


def test_bad_shapes_and_presets_are_rejected():
    with pytest.raises(ValueError, match="not divisible"):
        BackboneConfig(n_head=5, n_embd=64)
    with pytest.raises(ValueError, match="gpt2-tiny"):
        BackboneConfig(preset="gpt3")


def test_chunked_token_nll_equals_full_cross_entropy():
    model = tiny("cable")
    x = torch.randint(0, 97, (2, 30))
    targets = torch.randint(0, 97, (2, 30))
    targets[0, :4] = -100
    with torch.no_grad():
        full = F.cross_entropy(model(x).transpose(1, 2), targets, ignore_index=-100, reduction="none")
        chunked = model.token_nll(x, targets, chunk=7)
    torch.testing.assert_close(chunked, full)
    assert torch.all(chunked[0, :4] == 0)
    torch.testing.assert_close(model.loss(x, targets), full.sum() / (targets != -100).sum())




@pytest.mark.parametrize("pe", ["cable", "alibi", "fire", "t5", "rope"])
def test_long_evaluation_never_builds_a_full_score_or_logit_tensor(pe):
    t, heads = 8192, 2
    torch.manual_seed(0)
    config = BackboneConfig(pos_encoding=pe, n_layer=1, n_head=heads, n_embd=16, vocab_size=2000, block_size=128)
    model = build_backbone(config).eval()
    x = torch.randint(0, 2000, (1, t))
    with torch.no_grad(), LargestTensor(config.padded_vocab_size) as probe:
        model.token_nll(x, x)
    assert probe.largest <= heads * t * t / 8  # attention works on row blocks
    assert probe.largest_with_width <= t * config.padded_vocab_size / 4  # the LM head on position chunks


def test_activation_checkpointing_gives_the_same_gradients():
    model = tiny("cable")
    model.train()
    x = torch.randint(0, 97, (2, 20))
    model.loss(x[:, :-1], x[:, 1:]).backward()
    plain = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    model.activation_checkpointing = True
    model.loss(x[:, :-1], x[:, 1:]).backward()
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, plain[n], msg=n)


def test_sinusoidal_table_is_the_transformer_formula():
    import math

    from cable_lightning.positional.absolute import sinusoidal_table

    table = sinusoidal_table(torch.arange(50), 16)
    for pos in (0, 7, 49):
        for i in range(8):
            angle = pos / 10000 ** (2 * i / 16)
            assert table[pos, 2 * i].item() == pytest.approx(math.sin(angle), abs=1e-5)
            assert table[pos, 2 * i + 1].item() == pytest.approx(math.cos(angle), abs=1e-5)
