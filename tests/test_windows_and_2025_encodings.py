"""Stick-breaking attention, SSMax and per-layer patterns with sliding windows: each formula against a slow reference
written from its paper's definition (values and gradients), windows on every backend against a dense band mask,
what a window hides, cached decoding through windows, the errors.

The properties every encoding shares (no future leak, cached decoding, bidirectional encoders, export, CLI parsing)
run for these too in test_backbone.py, test_export.py and test_encodings.py, whose lists come from the registry."""

import math

import pytest
import torch
import torch.nn.functional as F
from conftest import dense_attention, randomised

from cable_lightning.models import BackboneConfig, KVCache, build_backbone
from cable_lightning.models import attention as attn_mod
from cable_lightning.models.attention import attention
from cable_lightning.positional import build_positional, from_label
from cable_lightning.positional.base import Chunks
from cable_lightning.positional.layers import Layers
from cable_lightning.positional.ssmax import keys_seen
from cable_lightning.positional.stick_breaking import StickBreakingScores

HEADS, WIDTH = 2, 16  # small heads, as test_context_aware's


def small_config(pe, **overrides):
    shape = dict(n_layer=2, n_head=HEADS, n_embd=WIDTH, vocab_size=97, block_size=16) | overrides
    return BackboneConfig(pos_encoding=pe, **shape)


def inputs(t, seed=0, batch=2):
    torch.manual_seed(seed)
    return [torch.randn(batch, HEADS, t, 8, dtype=torch.float64, requires_grad=True) for _ in range(3)]


def assert_same_values_and_gradients(out, ref, tensors, atol=1e-9, rtol=1e-7):
    torch.testing.assert_close(out, ref, atol=atol, rtol=rtol)
    weight = torch.randn_like(out)
    for g_out, g_ref in zip(torch.autograd.grad((out * weight).sum(), tensors, allow_unused=True),
                            torch.autograd.grad((ref * weight).sum(), tensors, allow_unused=True)):
        assert (g_out is None) == (g_ref is None)
        if g_ref is not None:
            torch.testing.assert_close(g_out, g_ref, atol=atol, rtol=rtol)


# --- stick-breaking ----------------------------------------------------------------------------------

def stick_breaking_reference(q, k, v, causal):
    """Tan et al.'s definition, one (query, key) pair at a time: A_ij = sigmoid(z_ij) prod_{k between j and i}
    (1 - sigmoid(z_ik)), keys j < i (causal) or j != i (bidirectional, a stick on each side), out_i = sum_j A_ij v_j."""
    t = q.shape[-2]
    beta = torch.sigmoid(q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1]))
    rows = []
    for i in range(t):
        weights = []
        for j in range(t):
            if j == i or (causal and j > i):
                weights.append(torch.zeros_like(beta[..., i, 0]))
                continue
            between = range(j + 1, i) if j < i else range(i + 1, j)
            left = torch.ones_like(beta[..., i, 0])
            for m in between:
                left = left * (1 - beta[..., i, m])
            weights.append(beta[..., i, j] * left)
        rows.append(torch.stack(weights, -1))
    return torch.stack(rows, -2) @ v


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidirectional"])
def test_stick_breaking_blocks_match_the_papers_formula_in_values_and_gradients(causal, monkeypatch):
    monkeypatch.setattr(attn_mod, "CHUNK_ELEMENTS", 2 * HEADS * 13 * 6 * 3)  # about 3 rows a block
    q, k, v = inputs(13)
    for backend in ("chunked", "materialized"):
        out = attention(q, k, v, StickBreakingScores(0, causal), causal, backend=backend)
        assert_same_values_and_gradients(out, stick_breaking_reference(q, k, v, causal), [q, k, v])


def test_stick_breaking_weights_sum_to_at_most_one_and_favour_near_keys():
    """With equal logits the weights fall geometrically with distance: A_ij = beta (1 - beta)^(i - 1 - j)."""
    logits = torch.full((1, 1, 1, 6), 0.4, dtype=torch.float64)
    weights = StickBreakingScores(5, True).scores(logits, None, 0, 1).exp()[0, 0, 0]
    beta = torch.sigmoid(torch.tensor(0.4, dtype=torch.float64))
    expected = torch.tensor([beta * (1 - beta) ** (4 - j) for j in range(5)] + [0.0], dtype=torch.float64)
    torch.testing.assert_close(weights, expected)
    assert weights.sum() < 1 and weights[4] > weights[0]


def test_stick_breaking_at_16k_keys_neither_underflows_nor_loses_the_near_keys():
    """The last of 16384 positions: a product of 16383 factors 1 - sigmoid(3) underflows fp32 long before the far
    keys; in log space the near keys' weights are exact, the far ones exactly 0, and nothing is NaN."""
    t = 2**14
    logits = torch.full((1, 1, 1, t), 3.0, requires_grad=True)
    log_weights = StickBreakingScores(t - 1, True).scores(logits, None, 0, 1)[0, 0, 0]
    distance = torch.arange(t - 2, -2, -1, dtype=torch.float64)  # i - 1 - j
    expected = F.logsigmoid(torch.tensor(3.0, dtype=torch.float64)) + distance * F.logsigmoid(torch.tensor(-3.0,
                                                                                                         dtype=torch.float64))
    torch.testing.assert_close(log_weights[:-1].double(), expected[:-1], rtol=1e-6, atol=1e-5)
    weights = log_weights.exp()
    assert weights[-1] == 0 and weights[0] == 0  # the query itself; a far key, exp(-16k x 0.049) in fp32
    assert weights[-2].item() == pytest.approx(torch.sigmoid(torch.tensor(3.0)).item())
    (gradient,) = torch.autograd.grad(weights.sum(), logits)
    assert torch.isfinite(gradient).all() and torch.isfinite(log_weights[:-1]).all()


@pytest.mark.parametrize("backend", ["fold", "flex", "sdpa"])
def test_stick_breaking_refuses_fused_backends_in_one_line(backend):
    with pytest.raises(ValueError, match=rf"backend '{backend}' cannot run stick_breaking .*valid: auto, chunked, "
                                         r"materialized$"):
        small_config("stick_breaking", attention_backend=backend)


# --- SSMax -------------------------------------------------------------------------------------------

@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidirectional"])
@pytest.mark.parametrize("window", [None, 1, 4, Chunks(4)], ids=["all", "1", "4", "chunks4"])
@pytest.mark.parametrize("offset", [0, 1001])
def test_ssmax_counts_the_positions_each_query_sees(causal, window, offset):
    t = 9
    total = offset + t
    got = keys_seen(offset, t, causal, window, total, "cpu")
    for row in range(t):
        i = offset + row
        inside = (lambda j: i // 4 == j // 4) if isinstance(window, Chunks) else \
            (lambda j: window is None or abs(i - j) < window)
        seen = [j for j in range(total) if (j <= i or not causal) and inside(j)]
        assert got[row] == len(seen)


@pytest.mark.parametrize("base, backend", [("cable", "fold"), ("cable", "chunked"), ("alibi", "fold"),
                                           ("nope", "sdpa"), ("rope", "sdpa"), ("cope", "chunked")])
def test_ssmax_is_softmax_of_s_log_n_times_the_logits_on_the_bases_backends(base, backend):
    """softmax(s_h log(n_i) q.k / sqrt(d) + bias) v, written out densely, against SSMax's scaled queries on the
    backends of its base (a per-row scale of q keeps the fold, which ``auto`` still picks for CABLE): values, and the
    gradient of s."""
    config = small_config(f"ssmax+{base}")
    assert attn_mod.resolve_backend("auto", build_positional(small_config("ssmax+cable")).score_bias(
        torch.randn(1, 3, WIDTH), 0, 0, None), torch.device("cpu")) == "fold"
    pe = randomised(build_positional(config)).double()
    t, offset, layer = 11, 30, 1  # rows 30..40: past the training length (16), onto a cache
    torch.manual_seed(1)
    h = torch.randn(2, offset + t, WIDTH, dtype=torch.float64)
    q, k, v = (torch.randn(2, HEADS, offset + t, 8, dtype=torch.float64) for _ in range(3))
    state = {}
    pe.score_bias(h[:, :offset], layer, 0, state)
    scores = pe.score_bias(h[:, offset:], layer, offset, state)
    base_q, base_k = pe.base.rotate(q, k, 0, layer)  # the base's rotation of every position (RoPE)
    base_q = base_q[:, :, offset:]
    scaled_q, _ = pe.rotate(q[:, :, offset:], k[:, :, offset:], offset, layer)
    out = attention(scaled_q, base_k, v, scores, True, q_offset=offset, backend=backend)
    n = torch.arange(offset + 1, offset + t + 1, dtype=torch.float64)
    s = pe.scale[layer].view(-1, 1, 1)
    logits = (s * n.log().view(-1, 1)) * (base_q @ base_k.transpose(-1, -2)) / math.sqrt(8)
    if scores is not None and hasattr(scores, "rows"):
        logits = logits + scores.rows(0, t, offset + t, 2, HEADS, "cpu")
    elif scores is not None:  # CoPE: its positions come from the scaled logits
        logits = scores.scores(logits, s * n.log().view(-1, 1) * base_q, 0, t)
    future = torch.arange(offset + t) > (torch.arange(t) + offset).view(-1, 1)
    ref = logits.masked_fill(future, float("-inf")).softmax(-1) @ v
    tolerance = dict(atol=2e-6, rtol=1e-5) if backend == "fold" else dict(atol=1e-9, rtol=1e-7)  # fold: fp32 factors
    torch.testing.assert_close(out, ref, **tolerance)
    weight = torch.randn_like(out)
    (g_out,) = torch.autograd.grad((out * weight).sum(), pe.scale)
    (g_ref,) = torch.autograd.grad((ref * weight).sum(), pe.scale)
    torch.testing.assert_close(g_out, g_ref, **tolerance)
    assert g_out[layer].abs().min() > 0


def test_ssmax_starts_as_its_base_at_the_training_length():
    pe = build_positional(small_config("ssmax+nope", block_size=64))
    q = torch.randn(1, HEADS, 1, 8)
    scaled, _ = pe.rotate(q, q, 63, 0)  # the 64th position sees 64 keys
    torch.testing.assert_close(scaled, q)


# --- sliding windows ---------------------------------------------------------------------------------

def band_reference(q, k, v, bias_rows, causal, window, q_offset=0):
    """softmax(q.k / sqrt(d) + bias) v with keys beyond the window (and the future) masked, from a dense mask."""
    tq, tk = q.shape[-2], k.shape[-2]
    i = torch.arange(tq).view(-1, 1) + q_offset
    j = torch.arange(tk).view(1, -1)
    return dense_attention(q, k, v, bias_rows, ((i - j).abs() < window) & ((j <= i) if causal else True))


@pytest.mark.parametrize("pe, backend, causal", [
    (pe, backend, causal) for causal in (True, False)
    for pe, backend in [("nope", "sdpa"), ("cable", "fold"), ("alibi", "fold"), ("kerple_log", "chunked"),
                        ("cable", "chunked"), ("cable", "materialized")]
    if causal or backend != "fold"])  # fold runs causal biases only
def test_windows_on_every_backend_match_a_dense_band_mask(pe, backend, causal, monkeypatch):
    monkeypatch.setattr(attn_mod, "CHUNK_ELEMENTS", 2 * HEADS * 24 * 6)
    t = 23
    q, k, v = inputs(t)
    module = randomised(build_positional(small_config(pe, causal=causal))).double()
    h = torch.randn(2, t, WIDTH, dtype=torch.float64, requires_grad=True)
    tolerance = dict(atol=2e-6, rtol=1e-5) if backend == "fold" else {}  # fold: fp32 factors
    for window in (1, 5, 100):
        bias = module.score_bias(h, 1, 0, None)
        out = attention(q, k, v, bias, causal, backend=backend, window=window)
        bias = module.score_bias(h, 1, 0, None)
        rows = bias.rows(0, t, t, 2, HEADS, "cpu") if bias is not None else 0.0
        assert_same_values_and_gradients(out, band_reference(q, k, v, rows, causal, window), [q, k, v, h],
                                         **tolerance)


def test_windows_on_flex_match_a_dense_band_mask():
    """FlexAttention's block mask; on CPU it runs forward only."""
    q, k, v = (x.detach().float() for x in inputs(21))
    module = randomised(build_positional(small_config("alibi")))
    bias = module.score_bias(torch.randn(2, 21, WIDTH), 1, 0, None)
    with torch.no_grad():
        out = attention(q, k, v, bias, True, backend="flex", window=6)
    rows = bias.rows(0, 21, 21, 2, HEADS, "cpu")
    torch.testing.assert_close(out, band_reference(q, k, v, rows, True, 6), atol=2e-5, rtol=1e-4)


def test_a_window_hides_what_lies_behind_it():
    """One layer over a 4-token window: changing token p changes outputs p..p+3 and nothing after (beyond rounding:
    the fold measures CABLE's sums from the middle key, a constant per row that moves the rounding only)."""
    model = randomised(build_backbone(small_config("layers-cable@4", n_layer=1)).eval())
    x = torch.randint(0, 97, (1, 20))
    y = x.clone()
    y[0, 8] = (x[0, 8] + 1) % 97
    with torch.no_grad():
        changed = (model(x) - model(y)).abs().amax(-1)[0] > 1e-4
    assert changed.tolist() == [False] * 8 + [True] * 4 + [False] * 8


def test_windowed_evaluation_never_builds_a_full_mask_or_bias(monkeypatch):
    from conftest import LargestTensor

    t = 2048
    for pe in ("layers-nope@64", "layers-cable@64", "layers-kerple_log@64"):
        model = build_backbone(BackboneConfig(pos_encoding=pe, n_layer=1, n_head=2, n_embd=16, vocab_size=50,
                                              block_size=128)).eval()
        x = torch.randint(0, 50, (1, t))
        with torch.no_grad(), LargestTensor(model.config.padded_vocab_size) as probe:
            model.token_nll(x, x)
        assert probe.largest < t * t / 16, pe  # blocks of (heads, window rows, 2 x window keys), never (T x T)


PATTERNS = ["layers-cable@3-nope", "layers-stick_breaking@3-cope@5", "ssmax+layers-rope@3-alibi",
            "layers-dape_v2+kerple_log@4-fox@2", "layers-rope@c4x2-nope", "ssmax+layers-cable@c5-cope@c3"]


@pytest.mark.parametrize("pe", PATTERNS)
def test_windowed_patterns_decode_onto_a_cache_as_the_full_forward_and_keep_the_future_out(pe, monkeypatch):
    monkeypatch.setattr(attn_mod, "CHUNK_ELEMENTS", 2 * HEADS * 12 * 4)
    torch.manual_seed(0)
    model = randomised(build_backbone(small_config(pe, n_layer=3)).eval())
    x = torch.randint(0, 97, (2, 12))
    with torch.no_grad():
        full = model(x)
        cache = KVCache(3)
        steps = [model(x[:, :5], cache), model(x[:, 5:8], cache)] + [model(x[:, i : i + 1], cache)
                                                                     for i in range(8, 12)]
        torch.testing.assert_close(torch.cat(steps, dim=1), full, atol=1e-5, rtol=1e-4)
        y = x.clone()
        y[:, 9] = (x[:, 9] + 1) % 97
        assert torch.equal(model(y)[:, :9], full[:, :9]) and not torch.allclose(model(y)[:, 9], full[:, 9])


def test_each_layer_runs_its_own_encoding_with_the_modules_of_its_layers_only():
    model = build_backbone(small_config("layers-cable@8x2-rope-nope", n_layer=7))
    pe = model.pe
    one_round = [("cable", 8), ("cable", 8), ("rope", None), ("nope", None)]
    assert [(e.label(), w) for e, w in pe.settings.per_layer(7)] == one_round + one_round[:3]
    assert [pe.window(i) for i in range(7)] == [8, 8, None, None, 8, 8, None]
    assert len(pe.parts[0].proj) == 4  # CABLE's projections: one per CABLE layer (0, 1, 4, 5)
    q = torch.randn(1, HEADS, 5, 8)
    plain = build_positional(small_config("rope"))
    torch.testing.assert_close(pe.rotate(q, q, 3, 2)[0], plain.rotate(q, q, 3)[0])  # layer 2: RoPE
    assert pe.rotate(q, q, 3, 3)[0] is q and pe.score_bias(torch.randn(1, 5, WIDTH), 3, 0, None) is None  # NoPE
    assert pe.score_bias(torch.randn(1, 5, WIDTH), 5, 0, None) is not None  # layer 5: CABLE's 4th layer
    assert model.pe.settings.label() == "layers-cable@8x2-rope-nope"


def test_pattern_labels_round_trip_through_from_label():
    for label in ["layers-rope@512x3-nope", "layers-rope@c8192x3-nope", "ssmax+layers-cable@5-stick_breaking@3x2-fox",
                  "layers-dape_v2+cable@6-cope", "dape_v2+ssmax+cable"]:
        assert from_label(label).label() == label
    assert from_label("layers-dape_v2@6x1-cope").label() == "layers-dape_v2+cable@6-cope"  # written the one way
    assert Layers(pattern="rope@64x3-nope") == from_label("layers-rope@64x3-nope")


@pytest.mark.parametrize("make, message", [
    (lambda: from_label("layers-rope@-nope"), "entry 'rope@' is not LABEL[@WINDOW|@cCHUNK][xCOUNT]"),
    (lambda: from_label("layers-rope@0"), "needs a window and a count >= 1"),
    (lambda: from_label("layers-ropee"), "unknown positional encoding 'ropee'"),
    (lambda: from_label("layers-ssmax+rope@8"), "wrap the pattern instead: ssmax+layers-"),
    (lambda: from_label("rope-x"), "rope's label carries no settings"),
    (lambda: small_config("layers-rope@8-cable", attention_backend="sdpa"),
     "attention_backend 'sdpa' cannot run layers-rope@8-cable (causal); valid: auto, fold, flex, chunked, "
     "materialized"),
    (lambda: small_config("layers-rope-stick_breaking", attention_backend="fold"),
     "valid: auto, chunked, materialized"),
    (lambda: small_config("layers-rope@4-nope", n_embd=30), "head size 15"),
])
def test_bad_patterns_are_one_line_errors(make, message):
    with pytest.raises(ValueError) as err:
        make()
    assert message in str(err.value) and "\n" not in str(err.value)


def test_a_pattern_and_ssmaxs_base_are_set_by_name_on_the_command_line(capsys):
    from conftest import printed_backbone

    backbone = printed_backbone(capsys, "--model.init_args.backbone.pos_encoding", "layers",
                                "--model.init_args.backbone.pos_encoding.pattern", "rope@64x3-nope")
    assert BackboneConfig.from_dict(backbone).pos_encoding.label() == "layers-rope@64x3-nope"
    backbone = printed_backbone(capsys, "--model.init_args.backbone.pos_encoding", "ssmax",  # a wrapped one by label
                                "--model.init_args.backbone.pos_encoding.base", "layers-cable@8-nope")
    assert BackboneConfig.from_dict(backbone).pos_encoding.label() == "ssmax+layers-cable@8-nope"


def test_the_picture_of_stick_breaking_is_its_log_weights():
    from cable_lightning.callbacks.bias_pictures import last_layer_maps

    model = build_backbone(small_config("stick_breaking")).eval()
    maps, what = last_layer_maps(model, torch.randint(0, 97, (1, 8)))
    assert what == "log attention weights (no softmax)"
    before = torch.ones(8, 8, dtype=torch.bool).tril(-1)
    assert (maps[:, before] < 0).all() and maps[:, ~before].isnan().all()  # weights below 1; none on or past i
    assert (maps.nan_to_num(float("-inf")).exp().sum(-1) <= 1 + 1e-6).all()  # each row's stick: at most 1
