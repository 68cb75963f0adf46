"""FoX, CoPE and DAPEv2: each formula against a loop written from its definition, the blocked path against
an obvious dense reference in values and gradients, DAPEv2's causality, the errors, the pictures.

The properties every PE shares (no future leak, cached decoding, bidirectional encoders) run for these too in
test_backbone.py, whose PE lists come from the registry."""

import math

import pytest
import torch
import torch.nn.functional as F
from conftest import randomised

from cable_lightning.callbacks.bias_pictures import last_layer_maps
from cable_lightning.models import BackboneConfig, build_backbone
from cable_lightning.models import attention as attn_mod
from cable_lightning.models.attention import attention
from cable_lightning.positional import build_positional, from_label, score_bias_encodings
from cable_lightning.positional.cope import Cope, CopeScores
from cable_lightning.positional.dape import DapeConvolutions, DapeScores, DapeV2

HEADS, WIDTH = 2, 16


def small_config(pe="cable", **overrides):
    return BackboneConfig(pos_encoding=pe, n_layer=2, n_head=HEADS, n_embd=WIDTH, vocab_size=97,
                          block_size=16, **overrides)


# --- FoX ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidirectional"])
@torch.no_grad()
def test_fox_bias_is_the_sum_of_log_forget_gates_between_query_and_key(causal):
    pe = randomised(build_positional(small_config("fox", causal=causal)))
    t = 7
    h = torch.randn(1, t, WIDTH)
    rows = pe.score_bias(h, 1, 0, None).rows(0, t, t, 1, HEADS, "cpu")
    proj = pe.proj[1]
    log_f = F.logsigmoid(h[0] @ proj.weight.T + proj.bias)  # (T, H): log f_u
    for head in range(HEADS):
        for i in range(t):
            for j in range(t if not causal else i + 1):
                between = range(min(i, j) + 1, max(i, j) + 1)  # j < u <= i (either side when bidirectional)
                expected = sum(log_f[u, head] for u in between) if between else torch.tensor(0.0)
                assert rows[0, head, i, j].item() == pytest.approx(expected.item(), abs=1e-5)
                assert rows[0, head, i, j] <= 0  # forgetting only ever lowers a score


@pytest.mark.parametrize("kernel", ["linear", "log"])
@pytest.mark.parametrize("weighted", [True, False], ids=["weighted", "unweighted"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidirectional"])
def test_cable_blocks_built_in_place_for_evaluation_are_the_pointwise_bias(kernel, weighted, causal):
    """A block of CABLE's bias is sliced from the sums and, without gradients, built in place: the same numbers as
    the pointwise formula (every backend's) on the same rows and keys, with gradients and without."""
    from cable_lightning.positional.cable import CableBias

    torch.manual_seed(0)
    s_q, s_k = torch.rand(2, 3, 5).cumsum(-1), torch.rand(2, 3, 9).cumsum(-1)
    g = torch.rand(2, 3, 5) + 0.5 if weighted else None
    bias = CableBias(s_q.requires_grad_(), s_k, g, q_offset=4, causal=causal, kernel=kernel)
    b, h = torch.arange(2).view(-1, 1, 1, 1), torch.arange(3).view(1, -1, 1, 1)
    pointwise = bias(b, h, torch.arange(1, 4).view(1, 1, -1, 1), torch.arange(2, 9).view(1, 1, 1, -1))
    with_grad = bias.rows(1, 4, 9, 2, 3, "cpu", first_key=2)
    assert with_grad.requires_grad
    with torch.no_grad():
        in_place = bias.rows(1, 4, 9, 2, 3, "cpu", first_key=2)
    torch.testing.assert_close(with_grad, pointwise)
    torch.testing.assert_close(in_place, pointwise.detach())
    diff = s_q.detach()[:, :, 1:4, None] - s_k[:, :, None, 2:]  # the obvious formula
    diff = diff if causal else diff.abs()
    diff = diff if g is None else g[:, :, 1:4, None] * diff
    torch.testing.assert_close(in_place, -torch.log1p(diff * diff) if kernel == "log" else -diff)


def test_fox_starts_from_the_published_gate_initialisation():
    pe = build_positional(BackboneConfig(pos_encoding="fox", n_layer=2, n_head=4, n_embd=32))
    for proj in pe.proj:
        assert torch.equal(proj.bias, torch.zeros(4))  # f = sigmoid(w.x): 1/2 for a zero input
        assert 0.015 < proj.weight.std() < 0.025


# --- CoPE --------------------------------------------------------------------------------------------

def cope_loop(logits, q, table, causal):
    """CoPE from its definition, one (query, key) pair at a time, for one batch element and head."""
    t, positions = logits.shape[0], table.shape[-1]
    out = torch.empty_like(logits)
    for i in range(t):
        for j in range(t):
            if causal and j > i:
                out[i, j] = logits[i, j]  # masked later; CoPE adds nothing here that could matter
                continue
            between = range(min(i, j), max(i, j) + 1)
            p = min(sum(torch.sigmoid(logits[i, u]) for u in between), positions - 1)
            low = math.floor(p)
            high = min(low + 1, positions - 1)
            z_low, z_high = (q[i] @ table[:, low] / math.sqrt(q.shape[-1]),
                             q[i] @ table[:, high] / math.sqrt(q.shape[-1]))
            out[i, j] = logits[i, j] + z_low * (1 - (p - low)) + z_high * (p - low)
    return out


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidirectional"])
def test_cope_scores_against_a_loop_over_the_definition(causal):
    torch.manual_seed(0)
    t, d, positions = 9, 8, 4  # few positions, so the clamp is reached
    logits = torch.randn(1, 1, t, t) * 2
    q = torch.randn(1, 1, t, d)
    table = torch.randn(d, positions)
    scores = CopeScores(table, 0, causal).scores(logits, q, 0, t)
    expected = cope_loop(logits[0, 0], q[0, 0], table, causal)
    keep = torch.ones(t, t, dtype=torch.bool).tril() if causal else torch.ones(t, t, dtype=torch.bool)
    torch.testing.assert_close(scores[0, 0][keep], expected[keep], atol=1e-5, rtol=1e-5)
    assert (CopeScores(table, 0, causal).positions(logits, 0, t)[0, 0][keep] > positions - 1).any()  # clamp used


def cope_dense_reference(q, k, v, table, causal):
    """CoPE written densely another way: positions as gates times a (query, t, key) indicator, and the
    interpolation as a triangle kernel max(0, 1 - |p - n|) over every integer position n."""
    t, d = q.shape[-2], q.shape[-1]
    logits = q @ k.transpose(-1, -2) / math.sqrt(d)
    gates = torch.sigmoid(logits)
    i, u, j = (torch.arange(t).view(-1, 1, 1), torch.arange(t).view(1, -1, 1), torch.arange(t).view(1, 1, -1))
    between = ((u >= torch.minimum(i, j)) & (u <= torch.maximum(i, j))).to(q.dtype)  # (i, u, j)
    positions = torch.einsum("bhiu,iuj->bhij", gates, between).clamp(max=table.shape[-1] - 1)
    grid = torch.arange(table.shape[-1], dtype=q.dtype)
    weights = (1 - (positions.unsqueeze(-1) - grid).abs()).clamp(min=0)  # (B, H, i, j, P)
    position_logits = q @ table / math.sqrt(d)  # (B, H, i, P)
    scores = logits + torch.einsum("bhijp,bhip->bhij", weights, position_logits)
    if causal:
        scores = scores.masked_fill(~torch.ones(t, t, dtype=torch.bool).tril(), float("-inf"))
    return scores.softmax(-1) @ v


# --- DAPEv2 ------------------------------------------------------------------------------------------

def dape_dense_reference(q, k, v, bias_rows, convolutions: DapeConvolutions, causal):
    """DAPEv2 over the whole (T x T) map at once: features, zeroed future, two convolutions, softmax."""
    t = q.shape[-2]
    logits = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    bias = bias_rows.expand_as(logits)
    past = torch.ones(t, t, dtype=torch.bool).tril() if causal else torch.ones(t, t, dtype=torch.bool)
    pad = (0, convolutions.expand.kernel_size[1] // 2)
    features = torch.cat([logits, bias], dim=1) * past
    hidden = F.leaky_relu(F.conv2d(features, convolutions.expand.weight, convolutions.expand.bias, padding=pad)) * past
    scores = logits + bias + F.conv2d(hidden, convolutions.reduce.weight, convolutions.reduce.bias, padding=pad)
    return scores.masked_fill(~past, float("-inf")).softmax(-1) @ v


def test_dape_correction_against_a_loop_over_the_definition():
    """correction[h, i, j] = c2[h] + sum_{w, o} W2[h, w, o] hidden[w, i, j + o - k//2], hidden from the features
    the same way with LeakyReLU, features zero past the query and outside the keys."""
    torch.manual_seed(0)
    heads, width, kernel, t = 2, 3, 3, 5
    convolutions = randomised(DapeConvolutions(heads, width, kernel))
    logits, bias = torch.randn(1, heads, t, t), torch.randn(1, heads, t, t)

    class GivenBias:  # a ScoreBias that returns fixed rows
        q_offset, causal = 0, True

        def rows(self, start, stop, n_keys, batch, heads, device):
            return bias[:, :, start:stop, :n_keys]

    scores = DapeScores(GivenBias(), convolutions).scores(logits, None, 0, t)
    features = torch.cat([logits, bias], dim=1)[0]

    def conv(inputs, layer, i, j, channel):
        total = layer.bias[channel].clone()
        for c in range(inputs.shape[0]):
            for o in range(kernel):
                key = j + o - kernel // 2
                if 0 <= key <= i:  # zero outside the keys and past the query
                    total = total + layer.weight[channel, c, 0, o] * inputs[c, i, key]
        return total

    hidden = torch.zeros(width, t, t)
    for w in range(width):
        for i in range(t):
            for j in range(i + 1):
                hidden[w, i, j] = F.leaky_relu(conv(features, convolutions.expand, i, j, w))
    for h in range(heads):
        for i in range(t):
            for j in range(i + 1):
                expected = logits[0, h, i, j] + bias[0, h, i, j] + conv(hidden, convolutions.reduce, i, j, h)
                assert scores[0, h, i, j].item() == pytest.approx(expected.item(), abs=1e-5)


def test_zeroing_the_future_is_what_keeps_dape_causal(monkeypatch):
    """Changing a later token must not change an earlier output; without the zeroing before each convolution
    the diagonal's window reads the next key and the model leaks."""
    model = randomised(build_backbone(small_config("dape_v2+cable")).eval())
    x = torch.randint(0, 97, (1, 12))
    y = x.clone()
    y[0, 7] = (x[0, 7] + 1) % 97

    def first_seven_equal():
        with torch.no_grad():
            return torch.equal(model(x)[:, :7], model(y)[:, :7])

    assert first_seven_equal()
    monkeypatch.setattr(DapeScores, "future",
                        lambda self, start, stop, n, device, first_key=0: torch.zeros(stop - start, n - first_key,
                                                                                      dtype=bool))
    assert not first_seven_equal()


# --- blocked path == dense reference, values and gradients ------------------------------------------

def inputs(t, seed=0):
    torch.manual_seed(seed)
    return [torch.randn(2, HEADS, t, 8, dtype=torch.float64, requires_grad=True) for _ in range(3)]


def assert_same_values_and_gradients(out, ref, tensors):
    torch.testing.assert_close(out, ref, atol=1e-9, rtol=1e-7)
    weight = torch.randn_like(out)
    used = 0
    for g_out, g_ref in zip(torch.autograd.grad((out * weight).sum(), tensors, allow_unused=True),
                            torch.autograd.grad((ref * weight).sum(), tensors, allow_unused=True)):
        assert (g_out is None) == (g_ref is None)
        if g_ref is not None:
            torch.testing.assert_close(g_out, g_ref, atol=1e-9, rtol=1e-7)
            used += 1
    assert used >= 4  # q, k, v and at least one parameter of the scores


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidirectional"])
def test_cope_blocks_match_the_dense_reference(causal, monkeypatch):
    monkeypatch.setattr(attn_mod, "CHUNK_ELEMENTS", 2 * HEADS * 33 * 8 * 5)  # about 5 rows a block
    q, k, v = inputs(33)
    table = (torch.randn(8, 6, dtype=torch.float64) * 0.5).requires_grad_()
    out = attention(q, k, v, CopeScores(table, 0, causal), causal, backend="chunked")
    assert_same_values_and_gradients(out, cope_dense_reference(q, k, v, table, causal), [q, k, v, table])


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidirectional"])
@pytest.mark.parametrize("pe", ["cable", "kerple_log"])
def test_dape_blocks_match_the_dense_reference(pe, causal, monkeypatch):
    monkeypatch.setattr(attn_mod, "CHUNK_ELEMENTS", 2 * HEADS * 33 * 8 * 5)
    q, k, v = inputs(33)
    config = small_config(pe, causal=causal)
    base = randomised(build_positional(config)).double()
    convolutions = randomised(DapeConvolutions(HEADS, 4, 3)).double()
    h = torch.randn(2, 33, WIDTH, dtype=torch.float64, requires_grad=True)
    tensors = [q, k, v, h] + list(base.parameters()) + list(convolutions.parameters())
    out = attention(q, k, v, convolutions.augment(base.score_bias(h, 1, 0, None)), causal, backend="chunked")
    bias_rows = base.score_bias(h, 1, 0, None).rows(0, 33, 33, 2, HEADS, "cpu")
    reference = dape_dense_reference(q, k, v, bias_rows, convolutions, causal)
    assert_same_values_and_gradients(out, reference, tensors)
    with torch.no_grad():  # evaluation's path (channels-last maps on CPU)
        out = attention(q, k, v, convolutions.augment(base.score_bias(h, 1, 0, None)), causal, backend="chunked")
    torch.testing.assert_close(out, reference, atol=1e-9, rtol=1e-7)


@pytest.mark.parametrize("pe", ["cope", "dape_v2+cable"])
def test_rows_onto_a_cache_match_the_full_rows(pe):
    """Queries at positions 20..32 against all 33 keys (a step onto a KV cache) are rows 20..32 of the full pass."""
    model = randomised(build_backbone(small_config(pe)))
    attn, pe_module = model.blocks[1].attn, model.pe
    h = torch.randn(1, 33, WIDTH)
    q, k, v = attn.queries_keys_values(h, pe_module, 0)
    full = attention(q, k, v, pe_module.score_bias(h, 1, 0, {}), True)
    state = {}
    pe_module.score_bias(h[:, :20], 1, 0, state)
    tail = attention(q[:, :, 20:], k, v, pe_module.score_bias(h[:, 20:], 1, 20, state), True, q_offset=20)
    torch.testing.assert_close(tail, full[:, :, 20:], atol=1e-5, rtol=1e-4)


# --- configuration and backends -----------------------------------------------------------------------

def test_dape_without_a_score_bias_is_a_one_line_error_naming_the_valid_encodings():
    for pe in ("rope", "nope", "cope"):
        with pytest.raises(ValueError) as err:
            build_backbone(small_config(f"dape_v2+{pe}"))
        message = str(err.value)
        assert "\n" not in message and repr(pe) in message and ", ".join(score_bias_encodings()) in message


@pytest.mark.parametrize("make, bad", [(lambda: DapeV2(kernel=4), "kernel=4"), (lambda: DapeV2(width=0), "width=0"),
                                       (lambda: {"class_path": "dape_v2", "init_args": {"version": 3}}, "'version'"),
                                       (lambda: Cope(positions=1), "got 1")])
def test_bad_dape_and_cope_settings_are_named(make, bad):
    with pytest.raises(ValueError, match=bad):
        BackboneConfig(pos_encoding=make())


@pytest.mark.parametrize("backend", ["fold", "flex", "sdpa"])
@pytest.mark.parametrize("pe", ["cope", "dape_v2+alibi"])
def test_logit_scores_refuse_fused_backends_in_one_line_before_building(pe, backend):
    with pytest.raises(ValueError, match=rf"backend '{backend}' cannot run .*valid: auto, chunked, materialized$"):
        small_config(pe, attention_backend=backend)


@pytest.mark.parametrize("backend", ["fold", "flex", "sdpa"])
def test_logit_scores_refuse_fused_backends_at_attention_too(backend):
    q = torch.randn(1, HEADS, 4, 8)
    with pytest.raises(ValueError, match=rf"backend '{backend}' cannot run .*use auto, chunked or materialized"):
        attention(q, q, q, CopeScores(torch.zeros(8, 4), 0, True), True, backend=backend)


def test_labels_round_trip_and_reject_what_wraps_nothing():
    for pe in score_bias_encodings():
        assert from_label(f"dape_v2+{pe}").label() == f"dape_v2+{pe}"
    assert from_label("cable").label() == "cable"
    with pytest.raises(ValueError, match="unknown positional encoding 'rerope'"):
        from_label("rerope+cable")
    with pytest.raises(ValueError, match="'rope' does not wrap another encoding.*dape_v2"):
        from_label("rope+cable")


@pytest.mark.parametrize("pe", ["cope", "dape_v2+cable"])
def test_long_evaluation_of_logit_scores_stays_in_row_blocks(pe, monkeypatch):
    from conftest import LargestTensor

    monkeypatch.setattr(attn_mod, "CHUNK_ELEMENTS", 2**18)  # what 2**24 is to 8k tokens, at 1024
    t = 1024
    config = BackboneConfig(pos_encoding=pe, n_layer=1, n_head=2, n_embd=16, vocab_size=500, block_size=128)
    model = build_backbone(config).eval()
    x = torch.randint(0, 500, (1, t))
    with torch.no_grad(), LargestTensor(config.padded_vocab_size) as probe:
        model.token_nll(x, x)
    # every map (DAPE's 32 hidden channels too) fits the block budget; a full (heads x T x T) map would be 8x it
    assert probe.largest <= attn_mod.CHUNK_ELEMENTS < 2 * t * t


# --- pictures ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("pe", ["fox", "cope", "dape_v2+cable", "dape_v2+kerple_log"])
def test_pictures_show_what_each_adds_to_the_logits(pe):
    model = randomised(build_backbone(small_config(pe)).eval())
    tokens = torch.randint(0, 97, (1, 10))
    maps, what = last_layer_maps(model, tokens)
    past = torch.ones(10, 10, dtype=torch.bool).tril()
    assert maps.shape == (HEADS, 10, 10) and torch.isfinite(maps[:, past]).all() and maps[:, ~past].isnan().all()
    assert "additive bias" in what
    if pe.startswith("dape"):  # the correction shows: not the plain PE's bias
        plain = build_backbone(small_config(pe.split("+")[1]))
        plain.load_state_dict(model.state_dict(), strict=False)
        assert not torch.allclose(last_layer_maps(plain, tokens)[0][:, past], maps[:, past])
