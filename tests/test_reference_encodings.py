"""Each encoding with a public reference against an independent implementation, on the same inputs, past training."""

# References: transformers (installed) for RoPE and its scalings (ROPE_INIT_FUNCTIONS, Llama's rotary embedding),
# p-RoPE (transformers' proportional RoPE), ALiBi (BLOOM's build_alibi_tensor), T5 (T5Attention), GPT-2's learned
# table (GPT2Model) and the sinusoidal table (DistilBERT's create_sinusoidal_embeddings). For the others the oracle is
# written in this file, in float64: from the authors' released code for CABLE (axiomlab/Cable), KERPLE
# (chijames/KERPLE), FoX (zhixuan-lin/forgetting-transformer), stick-breaking (shawntan/stickbreaking-attention) and
# CoPE (the listing in Golovneva et al., 2024); from the paper's equation where no code was released or could be
# read: weighted CABLE and K-CABLE (Veisi et al., 2025), FIRE (Li et al., 2024), DAPEv2 (Zheng et al., 2024), SSMax
# (Nakanishi, 2025). The project runs in float32; each test states its tolerance.
# No public reference: cable_dir (the project's own form); nope and layers add no formula of their own.

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from cable_lightning.models import BackboneConfig
from cable_lightning.models.attention import attention
from cable_lightning.positional.alibi import Alibi
from cable_lightning.positional.cable import Cable, CableNw, KCable
from cable_lightning.positional.cope import Cope
from cable_lightning.positional.dape import DapeV2
from cable_lightning.positional.fire import HIDDEN, Fire
from cable_lightning.positional.fox import Fox
from cable_lightning.positional.kerple import KerpleLog, KerplePower
from cable_lightning.positional.p_rope import PRope
from cable_lightning.positional.rope import Rope
from cable_lightning.positional.ssmax import Ssmax
from cable_lightning.positional.stick_breaking import StickBreaking
from cable_lightning.positional.t5 import T5

TRAINED = 32  # the training length every module below is built for; the tests run past it
LONG = 3 * TRAINED


def built(encoding, n_head=4, head_dim=16, n_layer=1, causal=True, block_size=TRAINED):
    """The encoding's module for a backbone of this shape, in eval mode."""
    config = BackboneConfig(pos_encoding=encoding, n_layer=n_layer, n_head=n_head, n_embd=n_head * head_dim,
                            vocab_size=97, block_size=block_size, causal=causal)
    return config.pos_encoding.build(config).eval()


def assert_causal_layer(pe, x, qkv, want_bias, want, bias_atol, out_atol, bias_rtol=0.0, backend="auto"):
    """The encoding's causal bias at ``x`` (the seen part of its matrix) and one attention layer's output on ``qkv``
    with it, against an oracle's ``want_bias`` and ``want``."""
    q, k, v = qkv
    bias = pe.score_bias(x, 0, 0, None)
    seen = torch.ones(LONG, LONG, dtype=torch.bool).tril()
    got_bias = bias_matrix(bias, LONG, batch=2).double()
    torch.testing.assert_close(got_bias[..., seen], want_bias[..., seen], rtol=bias_rtol, atol=bias_atol)
    with torch.no_grad():
        got = attention(q, k, v, bias, causal=True, backend=backend)
    torch.testing.assert_close(got.double(), want, rtol=0, atol=out_atol)


def bias_matrix(bias, length, batch=1, heads=4):
    """(batch|1, heads, length, length) of a ScoreBias for queries and keys at 0..length-1."""
    return bias.rows(0, length, length, batch, heads, torch.device("cpu"))


def causal_softmax(scores):
    """Softmax over keys j <= i (float64 reference attention)."""
    t = scores.shape[-1]
    future = torch.ones(t, t, dtype=torch.bool).triu(1)
    return scores.masked_fill(future, float("-inf")).softmax(-1)


def qkv(batch=2, heads=4, length=LONG, head_dim=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(batch, heads, length, head_dim, generator=g) for _ in range(3)]


# --- RoPE and its scalings: transformers ---------------------------------------------------------------------------

def hf_rope_config(head_dim, n_head, base, scaling, factor, original_length):
    from transformers import LlamaConfig

    parameters = {"rope_type": "default", "rope_theta": base}
    if scaling != "none":
        parameters = {"rope_type": {"linear": "linear", "yarn": "yarn", "ntk": "dynamic"}[scaling], "rope_theta": base,
                      "factor": factor}
        if scaling == "yarn":
            parameters["original_max_position_embeddings"] = original_length
    return LlamaConfig(hidden_size=head_dim * n_head, num_attention_heads=n_head, head_dim=head_dim,
                       max_position_embeddings=original_length, rope_parameters=parameters)


@pytest.mark.parametrize("head_dim, base, factor, original_length", [(64, 10000.0, 4.0, 128), (16, 10000.0, 2.0, 32),
                                                                     (128, 500000.0, 8.0, 4096)])
def test_yarn_frequencies_and_temperature_are_transformers(head_dim, base, factor, original_length):
    """transformers' ``_compute_yarn_parameters`` (the YaRN authors' find_correction_range and linear_ramp): the kept
    share of each frequency ramps in the dimension index. At head 64, base 10000, factor 4, length 128 it keeps
    1.00, 0.91, 0.82, ... of the first frequencies; the paper's ramp in rotations (``yarn_paper``) keeps 0.62, 0.46,
    0.34, ..., which this test refuses. Tolerance: 4e-7 relative (float32 rounding of the same formula)."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = hf_rope_config(head_dim, 2, base, "yarn", factor, original_length)
    reference, attention_factor = ROPE_INIT_FUNCTIONS["yarn"](config, "cpu")
    pe = built(Rope(base=base, scaling="yarn", scaling_factor=factor), n_head=2, head_dim=head_dim,
               block_size=original_length)
    torch.testing.assert_close(pe.inv_freq, reference, rtol=4e-7, atol=0)
    assert pe.mscale == pytest.approx(attention_factor, rel=1e-12)
    assert pe.mscale == pytest.approx(0.1 * math.log(factor) + 1) and pe.position_divisor == 1.0
    paper = built(Rope(base=base, scaling="yarn_paper", scaling_factor=factor), n_head=2, head_dim=head_dim,
                  block_size=original_length)
    assert not torch.allclose(paper.inv_freq, reference, rtol=1e-3)


def test_yarn_keeps_the_share_the_reference_keeps():
    from cable_lightning.positional.rope import rope_frequencies

    inv_freq, _, _ = rope_frequencies(64, 10000.0, "yarn", 4.0, 128)
    plain = 10000.0 ** -(torch.arange(0, 64, 2, dtype=torch.float64) / 64)
    kept = (inv_freq.double() - plain / 4) / (plain - plain / 4)
    # ramp from dimension 0 (32 rotations lie below it) to dimension ceil(10.47) = 11 (one rotation)
    torch.testing.assert_close(kept[:12], 1 - torch.arange(12, dtype=torch.float64) / 11, rtol=0, atol=1e-6)
    assert kept[11:].abs().max() < 1e-6


@pytest.mark.parametrize("scaling, factor", [("none", 1.0), ("linear", 4.0), ("yarn", 4.0), ("ntk", 4.0)])
def test_rope_rotations_are_llamas(scaling, factor):
    """q and k rotated at positions 0..LONG-1 (and from an offset, as a cache decodes) against Llama's rotary
    embedding and ``apply_rotary_pos_emb``, same head size, base and scaling. ``ntk``: transformers has NTK-aware
    scaling only in its dynamic form, base * a^(d/(d-2)) with a = s T / L - (s - 1) recomputed from the current
    length T; at T = L (2s - 1) / s, a = s, which is the static scaling ``ntk`` applies at every length (the dynamic
    form is no rope setting here: it would rotate a cached key differently from the same key in one forward).
    Tolerance: 2e-5 absolute on unit-variance q, k (float32 angles up to ~100 rad)."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

    head_dim, heads = 32, 4
    pe = built(Rope(scaling=scaling, scaling_factor=factor), n_head=heads, head_dim=head_dim)
    config = hf_rope_config(head_dim, heads, 10000.0, scaling, factor, TRAINED)
    q, k, _ = qkv(heads=heads, head_dim=head_dim)
    positions = torch.arange(LONG)[None].expand(2, -1)
    if scaling == "ntk":
        at = TRAINED * (2 * factor - 1) / factor
        inv_freq, scale = ROPE_INIT_FUNCTIONS["dynamic"](config, "cpu", seq_len=int(at))
        angles = positions[..., None].float() * inv_freq
        cos, sin = torch.cat([angles, angles], -1).cos() * scale, torch.cat([angles, angles], -1).sin() * scale
    else:
        cos, sin = LlamaRotaryEmbedding(config)(q, positions)
    want_q, want_k = apply_rotary_pos_emb(q, k, cos, sin)
    got_q, got_k = pe.rotate(q, k, 0)
    torch.testing.assert_close(got_q, want_q, rtol=0, atol=2e-5)
    torch.testing.assert_close(got_k, want_k, rtol=0, atol=2e-5)
    tail_q, tail_k = pe.rotate(q[:, :, 70:], k[:, :, 70:], 70)
    torch.testing.assert_close(tail_q, want_q[:, :, 70:], rtol=0, atol=2e-5)
    torch.testing.assert_close(tail_k, want_k[:, :, 70:], rtol=0, atol=2e-5)


@pytest.mark.parametrize("fraction", [0.25, 0.5, 0.75, 1.0])
def test_p_rope_frequencies_are_transformers_proportional_rope(fraction):
    """p-RoPE against transformers' proportional RoPE (``partial_rotary_factor``, the form Gemma runs): the first
    (highest) int(p D / 2) frequencies of RoPE's, zero for the rest. Tolerance: 4e-7 relative."""
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = LlamaConfig(hidden_size=128, num_attention_heads=2, head_dim=64, rope_parameters={
        "rope_type": "proportional", "rope_theta": 10000.0, "partial_rotary_factor": fraction})
    reference, _ = ROPE_INIT_FUNCTIONS["proportional"](config, "cpu")
    pe = built(PRope(fraction=fraction), n_head=2, head_dim=64)
    torch.testing.assert_close(pe.inv_freq, reference, rtol=4e-7, atol=0)


# --- ALiBi, T5, learned and sinusoidal tables: transformers -------------------------------------------------------

@pytest.mark.parametrize("heads", [8, 12])
def test_alibi_is_blooms(heads):
    """BLOOM's ``build_alibi_tensor`` adds m_h * j to row i (softmax ignores a constant per row): its bias minus its
    diagonal is -m_h (i - j), the project's causal bias. 12 heads take the ALiBi paper's interpolated slopes (8 of
    the power of two below, then every other of 16). Tolerance: 2e-5 absolute (both round m_h j to float32, at |bias|
    up to 67)."""
    from transformers.models.bloom.modeling_bloom import build_alibi_tensor

    bloom = build_alibi_tensor(torch.ones(1, LONG), heads, torch.float64).view(heads, LONG)
    reference = bloom[:, None, :] - bloom[:, :, None]  # (heads, i, j): m_h j - m_h i
    pe = built(Alibi(), n_head=heads)
    got = bias_matrix(pe.score_bias(None, 0, 0, None), LONG, heads=heads)[0].double()
    seen = torch.ones(LONG, LONG, dtype=torch.bool).tril()
    torch.testing.assert_close(got[:, seen], reference[:, seen], rtol=0, atol=2e-5)


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidirectional"])
def test_t5_buckets_and_bias_are_t5attentions(causal):
    """``T5Attention._relative_position_bucket`` (32 buckets, max distance 128; causal: bidirectional=False) on
    distances up to 400 either way, and ``compute_bias`` with the project's table as its embedding, 300 x 300 (past
    the last bucket's start). Exact: both are integer bucket indices into the same table."""
    from transformers import T5Config
    from transformers.models.t5.modeling_t5 import T5Attention

    from cable_lightning.positional.t5 import relative_bucket

    rel = torch.arange(-400, 401)  # i - j
    want = T5Attention._relative_position_bucket(-rel, bidirectional=not causal, num_buckets=32, max_distance=128)
    assert torch.equal(relative_bucket(rel, causal), want)

    pe = built(T5(), causal=causal)
    with torch.no_grad():
        pe.table.copy_(torch.randn(pe.table.shape, generator=torch.Generator().manual_seed(1)))
    config = T5Config(d_model=64, d_kv=16, num_heads=4, relative_attention_num_buckets=32,
                      relative_attention_max_distance=128, is_decoder=causal)
    layer = T5Attention(config, has_relative_attention_bias=True, layer_idx=0)
    with torch.no_grad():
        layer.relative_attention_bias.weight.copy_(pe.table)
        reference = layer.compute_bias(300, 300)
        got = bias_matrix(pe.score_bias(None, 0, 0, None), 300)
    assert torch.equal(got, reference)


def test_learned_positions_are_gpt2s():
    """GPT2Model's embedding output (the first hidden state: wte(ids) + wpe(positions)) with the project's table as
    wpe, the whole table and from an offset (a cache). Exact: the same additions in float32."""
    from transformers import GPT2Config, GPT2Model

    pe = built("learnable", n_head=4, head_dim=16)
    model = GPT2Model(GPT2Config(vocab_size=97, n_positions=TRAINED, n_embd=64, n_layer=1, n_head=4, embd_pdrop=0.0,
                                bos_token_id=None, eos_token_id=None))
    model.eval()
    with torch.no_grad():
        model.wpe.weight.copy_(pe.table.weight)
        ids = torch.randint(0, 97, (2, TRAINED), generator=torch.Generator().manual_seed(0))
        want = model(ids, output_hidden_states=True).hidden_states[0]
        tokens = model.wte(ids)
        assert torch.equal(pe.embed(tokens, 0), want)
        tail = model(ids[:, 20:], position_ids=torch.arange(20, TRAINED)[None], output_hidden_states=True)
        assert torch.equal(pe.embed(tokens[:, 20:], 20), tail.hidden_states[0])


def test_sinusoidal_is_the_transformers_table_at_the_token_scale():
    """DistilBERT's ``create_sinusoidal_embeddings`` (sin at even, cos at odd dimensions, position / 10000^(2i/d)),
    at 3x the training length. The project scales the table by 0.02 sqrt(2) (RMS 0.02, as GPT-2-initialised token
    embeddings; ``absolute.SINUSOIDAL_SCALE``): the original Transformer instead multiplied the token embeddings by
    sqrt(d). Tolerance: 2e-5 absolute on the unscaled table (float32 angles up to LONG rad)."""
    from transformers.models.distilbert.modeling_distilbert import create_sinusoidal_embeddings

    from cable_lightning.positional.absolute import SINUSOIDAL_SCALE

    dim = 64
    reference = create_sinusoidal_embeddings(LONG, dim, torch.empty(LONG, dim))
    pe = built("sinusoidal", n_head=4, head_dim=16)
    got = pe.embed(torch.zeros(1, LONG, dim), 0)[0]
    assert SINUSOIDAL_SCALE == pytest.approx(0.02 * math.sqrt(2))
    torch.testing.assert_close(got / SINUSOIDAL_SCALE, reference, rtol=0, atol=2e-5)


# --- KERPLE and FIRE: the released code and the paper's equation ----------------------------------------------------

def randomised(pe, seed=0, scale=1.0):
    """``pe`` with every parameter drawn at random (so a per-head or per-layer mix-up shows)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in pe.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * scale)
    return pe


@pytest.mark.parametrize("encoding", [KerpleLog(), KerplePower()], ids=["log", "power"])
def test_kerple_is_the_released_kernel(encoding):
    """chijames/KERPLE's ParallelKerpleLog and ParallelKerplePower (megatron/mpu/layers.py): with d = tril(i - j),
    log: -p log(1 + a d); power: -a d^p (0 < p <= 2), per head, p and a the project's r1, r2 (log) and r2, r1
    (power). The released code keeps p and a positive by clamping them at 0.01 (and p at 2) in place; the project
    maps raw parameters through softplus (power: r2 = 2 sigmoid) and starts at r1 = r2 = 1 rather than uniform draws.
    Tolerance: 1e-5 relative (float32)."""
    pe = randomised(built(encoding, n_layer=2), seed=3)
    layer = 1
    r1, r2 = (c.double() for c in pe.coefficients(layer))
    i, j = torch.arange(LONG)[:, None], torch.arange(LONG)[None, :]
    d = (i - j).clamp(min=0).double()
    if encoding.name == "kerple_log":
        reference = -r1[:, None, None] * torch.log(1 + r2[:, None, None] * d)
    else:
        reference = -r1[:, None, None] * d.pow(r2[:, None, None])
    got = bias_matrix(pe.score_bias(None, layer, 0, None), LONG)[0].double()
    seen = (i >= j).expand(LONG, LONG)
    torch.testing.assert_close(got[:, seen], reference[:, seen], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidirectional"])
def test_fire_is_the_papers_equation(causal):
    """FIRE (Li et al., 2024; no code was released): b(i, j) = f(psi(i - j) / psi(max(L, i))), psi(x) = log(c x + 1),
    f an MLP 1 -> 32 -> heads with ReLU; bidirectional, |i - j| over psi(max(L, i, j)). Written here with nn.Linear
    layers holding the project's weights, c and L. L = 20 below 96 positions, so the normaliser's max is exercised.
    Tolerance: 1e-5 absolute (float32)."""
    pe = randomised(built(Fire(), causal=causal), seed=4)
    with torch.no_grad():
        pe.c_raw.fill_(0.3)
        pe.threshold.fill_(20.0)
    c, threshold = F.softplus(pe.c_raw[0]).double(), pe.threshold[0].abs().double()
    mlp = nn.Sequential(nn.Linear(1, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, 4)).double()
    with torch.no_grad():
        mlp[0].weight.copy_(pe.w1[0][:, None])
        mlp[0].bias.copy_(pe.b1[0])
        mlp[2].weight.copy_(pe.w2[0])
        mlp[2].bias.copy_(pe.b2[0])
        i = torch.arange(LONG, dtype=torch.float64)[:, None]
        j = torch.arange(LONG, dtype=torch.float64)[None, :]
        position = i.expand(LONG, LONG) if causal else torch.maximum(i, j)
        normalised = torch.log(c * (i - j).abs() + 1) / torch.log(c * torch.maximum(position, threshold) + 1)
        reference = mlp(normalised[..., None]).permute(2, 0, 1)
        got = bias_matrix(pe.score_bias(None, 0, 0, None), LONG)[0].double()
    seen = (i >= j).expand(LONG, LONG) if causal else torch.ones(LONG, LONG, dtype=torch.bool)
    torch.testing.assert_close(got[:, seen], reference[:, seen], rtol=0, atol=1e-5)


# --- CABLE, K-CABLE and FoX: one attention layer with the same weights ----------------------------------------------

def layer_input(length=LONG, width=64, seed=5):
    """A layer's normalised input (B, T, C), unit scale, as the released code's ln_1 output."""
    return F.layer_norm(torch.randn(2, length, width, generator=torch.Generator().manual_seed(seed)), (width,))


def released_cable_layer(x, w, offset, q, k, v):
    """axiomlab/Cable src/Cable.py, CausalSelfAttention, in float64: b = cumsum(-softplus(h_attn(x))) per head,
    Bias = b_i - b_j, softmax(q.k scale + Bias) v. The released code divides q and k by sqrt(C / n_embd), which is 1
    (C is n_embd): its logits are unscaled. The project scales them by 1/sqrt(d), as the paper's equation and every
    other encoding here; this oracle does too."""
    b = torch.cumsum(-F.softplus(x.double() @ w.double().T + offset.double()), dim=1).transpose(1, 2)  # (B, H, T)
    bias = b[..., :, None] - b[..., None, :]
    scores = (q.double() @ k.double().transpose(-1, -2)) / math.sqrt(q.shape[-1]) + bias
    return bias, causal_softmax(scores) @ v.double()


def test_cable_nw_with_softplus_is_the_released_cable():
    """The project's ``cable_nw`` with ``bias_activation: softplus`` against the authors' released layer, bias matrix
    and attention output (the fold backend ``auto`` picks for it), 96 tokens against a training length of 32. The
    released projection also has a per-head offset (its nn.Linear bias, initialised to 0); the project's CABLE has
    none, so the oracle's is 0. Tolerance: 2e-5 absolute on the bias (sums of 96 softplus terms), 1e-5 on outputs."""
    pe = built(CableNw(bias_activation="softplus"))
    with torch.no_grad():
        pe.proj[0].weight.normal_(0, 0.3, generator=torch.Generator().manual_seed(6))
    x, (q, k, v) = layer_input(), qkv()
    want_bias, want = released_cable_layer(x, pe.proj[0].weight.detach(), torch.zeros(4), q, k, v)
    assert_causal_layer(pe, x, (q, k, v), want_bias, want, bias_atol=2e-5, out_atol=1e-5)


@pytest.mark.parametrize("encoding", [Cable(), KCable()], ids=["cable", "k_cable"])
def test_cable_and_k_cable_are_the_papers_equations(encoding):
    """CABLE (the paper's final form): b = ReLU(w_c . x), S its cumulative sum, g = softplus(w_s . x):
    bias = -g_i (S_i - S_j); K-CABLE: -log(1 + (g_i (S_i - S_j))^2). No released code has the weight g or the kernel;
    the oracle is the equation, and the output one attention layer's (materialized) with the same weights.
    Tolerance: 1e-4 relative on the bias (float32 sums S up to ~100), 5e-5 absolute on outputs."""
    pe = built(encoding)
    with torch.no_grad():
        pe.proj[0].weight.normal_(0, 0.3, generator=torch.Generator().manual_seed(7))
    x, (q, k, v) = layer_input(), qkv()
    w = pe.proj[0].weight.detach().double()
    logits = (x.double() @ w.T).transpose(1, 2)  # (B, 2H, T): the increments' logits, then the weights'
    s, g = torch.cumsum(F.relu(logits[:, :4]), dim=-1), F.softplus(logits[:, 4:])
    distance = g[..., :, None] * (s[..., :, None] - s[..., None, :])
    want_bias = -distance if encoding.kernel == "linear" else -torch.log(1 + distance**2)
    want = causal_softmax((q.double() @ k.double().transpose(-1, -2)) / 4.0 + want_bias) @ v.double()
    assert_causal_layer(pe, x, (q, k, v), want_bias, want, bias_atol=1e-6, out_atol=5e-5, bias_rtol=1e-4,
                        backend="materialized")


def test_fox_is_the_released_forgetting_attention():
    """zhixuan-lin/forgetting-transformer (ForgettingAttentionLayer, fgate_type "full"): log f = logsigmoid(W x + b)
    per head, log_lambda its cumulative sum, scores q.k / sqrt(d) + log_lambda_i - log_lambda_j, causal softmax. The
    project's gate offset c is b. Bias and the attention output (fold backend), 96 tokens. Tolerance: 2e-5 absolute on
    the bias, 1e-5 on outputs."""
    pe = built(Fox())
    g = torch.Generator().manual_seed(8)
    with torch.no_grad():
        pe.proj[0].weight.normal_(0, 0.3, generator=g)
        pe.proj[0].bias.normal_(2.0, 1.0, generator=g)
    x, (q, k, v) = layer_input(), qkv()
    w, b = pe.proj[0].weight.detach().double(), pe.proj[0].bias.detach().double()
    log_lambda = torch.cumsum(F.logsigmoid(x.double() @ w.T + b), dim=1).transpose(1, 2)
    want_bias = log_lambda[..., :, None] - log_lambda[..., None, :]
    want = causal_softmax((q.double() @ k.double().transpose(-1, -2)) / 4.0 + want_bias) @ v.double()
    assert_causal_layer(pe, x, (q, k, v), want_bias, want, bias_atol=2e-5, out_atol=1e-5)


# --- encodings whose scores read the logits: stick-breaking, CoPE, DAPEv2; SSMax's scale ----------------------------

def test_stick_breaking_weights_are_the_released_reference():
    """shawntan/stickbreaking-attention's ``sb_ref.stickbreaking`` (the kernel's reference): z = q.k / sqrt(d),
    log A_ij = logsigmoid(z_ij) + sum_{j < k < i} logsigmoid(-z_ik) for keys j < i, by a matrix product with the
    strictly lower triangle; the output A v. The released models (and the kernel's own tests) add the remainder
    (1 - sum_j A_ij) times the query's own value; the project gives it to no value (``stick_breaking``'s docstring),
    so the oracle is A v alone. 96 tokens. Tolerance: 1e-5 absolute."""
    pe = built(StickBreaking())
    q, k, v = qkv()
    logits = (q.double() @ k.double().transpose(-1, -2)) / math.sqrt(q.shape[-1])
    hidden = torch.ones(LONG, LONG, dtype=torch.bool).triu(0)  # the query itself and its future
    log_z = F.logsigmoid(logits).masked_fill(hidden, -1e5)
    log_beta = F.logsigmoid(-logits).masked_fill(hidden, 0.0)
    strictly_lower = torch.ones(LONG, LONG, dtype=torch.float64).tril(-1)
    weights = (log_z + log_beta @ strictly_lower).exp()
    with torch.no_grad():
        got = attention(q, k, v, pe.score_bias(None, 0, 0, None), causal=True)
    torch.testing.assert_close(got.double(), weights @ v.double(), rtol=0, atol=1e-5)


def test_cope_is_the_papers_listing():
    """CoPE's listing in Golovneva et al., 2024 (class CoPE and SelfAttn): gates sigmoid of the scaled, masked logits,
    positions their reversed cumulative sum clamped to npos - 1, the position logit q . e interpolated between
    floor and ceil, added to the logits; causal softmax. The project divides q . e by sqrt(d) and the listing does
    not: the same model with e scaled by 1/sqrt(d), so the oracle takes the project's table / sqrt(d). 8 positions,
    96 tokens (most positions clamp). Tolerance: 1e-5 absolute."""
    pe = randomised(built(Cope(positions=8)), seed=9)
    q, k, v = qkv()
    d = q.shape[-1]
    table = pe.table[0].detach().double() / math.sqrt(d)  # (D, positions)
    future = torch.ones(LONG, LONG, dtype=torch.bool).triu(1)
    logits = (q.double() @ k.double().transpose(-1, -2)) / math.sqrt(d)
    logits = logits.masked_fill(future, float("-inf"))
    position = torch.sigmoid(logits).flip(-1).cumsum(-1).flip(-1).clamp(max=7)
    per_position = q.double() @ table
    ceil, floor = per_position.gather(-1, position.ceil().long()), per_position.gather(-1, position.floor().long())
    fraction = position - position.floor()
    want = (logits + ceil * fraction + floor * (1 - fraction)).softmax(-1) @ v.double()
    with torch.no_grad():
        got = attention(q, k, v, pe.score_bias(None, 0, 0, None), causal=True)
    torch.testing.assert_close(got.double(), want, rtol=0, atol=1e-5)


def test_dape_v2_is_the_papers_equation():
    """DAPEv2 (Zheng et al., 2024), from the paper's equation: scores = z + B + f([z, B]),
    f two (1 x 3) convolutions along the keys through LeakyReLU (2H -> 32 -> H), the future zeroed before each, then
    the causal softmax; here over ALiBi's B, written with F.conv2d in float64 on the project's weights. 96 tokens.
    Tolerance: 1e-5 absolute."""
    pe = randomised(built(DapeV2(base=Alibi())), seed=10, scale=0.1)
    q, k, v = qkv()
    convolutions = pe.layers[0]
    logits = (q.double() @ k.double().transpose(-1, -2)) / math.sqrt(q.shape[-1])
    i, j = torch.arange(LONG)[:, None], torch.arange(LONG)[None, :]
    alibi_bias = (-pe.base.slopes.double()[:, None, None] * (i - j).abs()).expand(2, -1, -1, -1)
    future = (j > i).expand(LONG, LONG)

    def convolve(conv, x):
        return F.conv2d(x.masked_fill(future, 0.0), conv.weight.double(), conv.bias.double(), padding=(0, 1))

    hidden = F.leaky_relu(convolve(convolutions.expand, torch.cat([logits, alibi_bias], dim=1)))
    scores = logits + alibi_bias + convolve(convolutions.reduce, hidden)
    want = causal_softmax(scores) @ v.double()
    with torch.no_grad():
        got = attention(q, k, v, pe.score_bias(None, 0, 0, None), causal=True)
    torch.testing.assert_close(got.double(), want, rtol=0, atol=1e-5)


def test_ssmax_is_the_papers_scaled_softmax_over_rope():
    """SSMax (Nakanishi, 2025; the equation, no released code): softmax(s log(n) z) with n the keys a query sees
    (i + 1, causal) and s per head, over RoPE (q, k rotated by Llama's rotary embedding). 96 tokens, s drawn at
    random. Tolerance: 1e-5 absolute."""
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

    pe = built(Ssmax())
    with torch.no_grad():
        pe.scale.uniform_(0.1, 0.6, generator=torch.Generator().manual_seed(11))
    q, k, v = qkv()
    config = hf_rope_config(16, 4, 10000.0, "none", 1.0, TRAINED)
    cos, sin = LlamaRotaryEmbedding(config)(q, torch.arange(LONG)[None])
    q_rotated, k_rotated = apply_rotary_pos_emb(q.double(), k.double(), cos.double(), sin.double())
    seen = torch.arange(1, LONG + 1, dtype=torch.float64)[:, None]
    logits = (q_rotated @ k_rotated.transpose(-1, -2)) / 4.0
    want = causal_softmax(pe.scale[0].double()[:, None, None] * torch.log(seen) * logits) @ v.double()
    with torch.no_grad():
        scaled_q, rotated_k = pe.rotate(q, k, 0)
        got = attention(scaled_q, rotated_k, v, None, causal=True)
    torch.testing.assert_close(got.double(), want, rtol=0, atol=1e-5)
