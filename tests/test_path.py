"""PaTH and PaTH-FoX: the reference against explicit products of the transforms, the chunked path against the
reference, the forget gate against FoX's bias, the authors' chunked formulation as an oracle, and the dispatch to
flash-linear-attention's kernel."""

import sys
import types

import pytest
import torch
import torch.nn.functional as F

from cable_lightning.models import BackboneConfig, build_backbone
from cable_lightning.models import attention as attn_mod
from cable_lightning.models.attention import attention
from cable_lightning.models.backbone import KVCache
from cable_lightning.positional import build_positional
from cable_lightning.positional import path as path_mod
from cable_lightning.positional.path import PathScores

B, H, D = 2, 3, 8


def inputs(t, seed=0, dtype=torch.float64):
    """q, k, v (B, H, t, D), unit w and beta in (0, 2) per token, all requiring gradients."""
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, H, t, D, generator=g, dtype=dtype) for _ in range(3))
    w = F.normalize(torch.randn(B, H, t, D, generator=g, dtype=dtype), dim=-1)
    beta = 2 * torch.rand(B, H, t, generator=g, dtype=dtype)
    return [x.requires_grad_() for x in (q, k, v, w, beta)]


def explicit_logits(q, k, w, beta, causal=True):
    """logit[i, j] = q_i^T (H_i ... H_{j+1}) k_j / sqrt(d) for j <= i, and k_j^T (H_j ... H_{i+1}) q_i / sqrt(d) for
    j > i, each product of (D x D) matrices built for its own pair."""
    t = q.shape[-2]
    eye = torch.eye(D, dtype=q.dtype)
    householder = eye - beta[..., None, None] * w[..., :, None] * w[..., None, :]  # (B, H, t, D, D)
    rows = []
    for i in range(t):
        row = []
        for j in range(t):
            product = eye.expand(B, H, D, D)
            for s in range(min(i, j) + 1, max(i, j) + 1):
                product = householder[:, :, s] @ product  # later tokens on the left
            if j <= i:
                value = (q[:, :, i, None, :] @ product @ k[:, :, j, :, None])[..., 0, 0]
            elif causal:
                value = torch.zeros(B, H, dtype=q.dtype)
            else:
                value = (k[:, :, j, None, :] @ product @ q[:, :, i, :, None])[..., 0, 0]
            row.append(value)
        rows.append(torch.stack(row, dim=-1))
    return torch.stack(rows, dim=-2) * D**-0.5


def explicit_attention(q, k, v, w, beta, causal=True, bias=None):
    logits = explicit_logits(q, k, w, beta, causal)
    if bias is not None:
        logits = logits + bias
    if causal:
        t = q.shape[-2]
        logits = logits.masked_fill(~torch.ones(t, t, dtype=torch.bool).tril(), float("-inf"))
    return logits.softmax(-1) @ v


def path_attention(backend, q, k, v, w, beta, causal=True, forget=None, q_offset=0):
    scores = PathScores(w, beta, forget, None, q_offset, causal)
    return attention(q, k, v, scores, causal, q_offset=q_offset, backend=backend)


def grads(out, tensors, seed=1):
    weight = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed), dtype=out.dtype)
    return torch.autograd.grad((out * weight).sum(), tensors)


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidirectional"])
def test_the_reference_is_the_product_of_the_transforms_between_query_and_key(causal):
    """The materialized backend carries keys token by token; this checks it against the definition, a product of
    explicit (D x D) matrices per pair, in fp64, values and gradients (w and beta included)."""
    tensors = inputs(9)
    out = path_attention("materialized", *tensors, causal=causal)
    expected = explicit_attention(*tensors, causal=causal)
    torch.testing.assert_close(out, expected, atol=1e-10, rtol=1e-9)
    for got, want in zip(grads(out, tensors), grads(expected, tensors)):
        torch.testing.assert_close(got, want, atol=1e-10, rtol=1e-9)


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidirectional"])
@pytest.mark.parametrize("chunk, t, row_elements", [(4, 13, 10**9), (5, 37, B * H * 37 * 7), (16, 40, B * H * 40 * 9),
                                                     (64, 23, 10**9), (1, 6, B * H * 6 * 2)])
def test_the_chunked_path_equals_the_reference_in_values_and_gradients(causal, chunk, t, row_elements, monkeypatch):
    """Blocks of the compact form against the token-by-token reference: block sizes that do not divide the length,
    and row blocks (the attention's) that start inside a block of transforms, walking queries back and (bidirectional)
    keys forward."""
    monkeypatch.setattr(path_mod, "CHUNK", chunk)
    monkeypatch.setattr(attn_mod, "CHUNK_ELEMENTS", row_elements * PathScores.maps_per_head)
    tensors = inputs(t, seed=chunk)
    ref = path_attention("materialized", *tensors, causal=causal)
    out = path_attention("chunked", *tensors, causal=causal)
    torch.testing.assert_close(out, ref, atol=1e-10, rtol=1e-9)
    for got, want in zip(grads(out, tensors), grads(ref, tensors)):
        torch.testing.assert_close(got, want, atol=1e-10, rtol=1e-9)


def test_rows_onto_a_cache_get_the_logits_of_the_full_forward(monkeypatch):
    """Query rows at an offset (decoding onto a KV cache) against every key so far: the last rows of the full map."""
    monkeypatch.setattr(path_mod, "CHUNK", 4)
    q, k, v, w, beta = inputs(19)
    full = path_attention("chunked", q, k, v, w, beta)
    for offset in (18, 13, 8):
        step = path_attention("chunked", q[:, :, offset:], k, v, w, beta, q_offset=offset)
        torch.testing.assert_close(step, full[:, :, offset:], atol=1e-12, rtol=1e-10)


def backbone(pe, n_embd=16):
    torch.manual_seed(0)
    config = BackboneConfig(pos_encoding=pe, n_layer=2, n_head=2, n_embd=n_embd, vocab_size=31, block_size=64)
    model = build_backbone(config).eval()
    with torch.no_grad():  # transforms far from the identity, and gates far from 1/2
        for p in model.pe.parameters():
            p.add_(torch.randn_like(p) * 0.5)
    return model


def test_path_fox_is_path_plus_fox_s_bias():
    """PaTH-FoX's scores are PaTH's logits plus sum_{j < u <= i} log f_u, f = sigmoid(w . x + c), written out here
    from the gate's own weights."""
    model = backbone("path_fox")
    pe = model.pe
    h = torch.randn(2, 11, 16)
    scores = pe.score_bias(h, 1, 0, None)
    assert scores.forget is not None
    q, k, v = (torch.randn(2, 2, 11, 8) for _ in range(3))
    proj = pe.forget.proj[1]
    log_f = F.logsigmoid(h @ proj.weight.T + proj.bias).transpose(1, 2)  # (B, H, T)
    sums = log_f.cumsum(-1)
    bias = sums[..., :, None] - sums[..., None, :]  # sum over j < u <= i
    plain = PathScores(scores.w, scores.beta, None, None, 0, True)
    logits = plain.logits(q, k, 0, 11, reference=True)
    causal = torch.ones(11, 11, dtype=torch.bool).tril()
    expected = (logits + bias).masked_fill(~causal, float("-inf")).softmax(-1) @ v
    torch.testing.assert_close(attention(q, k, v, scores, True, backend="materialized"), expected, atol=1e-5,
                               rtol=1e-4)
    torch.testing.assert_close(attention(q, k, v, scores, True, backend="chunked"), expected, atol=1e-5, rtol=1e-4)
    assert not torch.allclose(attention(q, k, v, plain, True, backend="materialized"), expected, atol=1e-3)


@pytest.mark.parametrize("pe", ["path", "path_fox"])
def test_decoding_token_by_token_equals_the_full_forward(pe, monkeypatch):
    """The cache keeps every token's w and beta and the convolution's last inputs: a prefill, a multi-token step and
    single tokens give the logits of one forward, across blocks of the compact form."""
    monkeypatch.setattr(path_mod, "CHUNK", 4)
    model = backbone(pe)
    x = torch.randint(0, 31, (2, 17))
    with torch.no_grad():
        full = model(x)
        cache = KVCache(2)
        steps = [model(x[:, :6], cache), model(x[:, 6:9], cache)]
        steps += [model(x[:, i : i + 1], cache) for i in range(9, 17)]
    torch.testing.assert_close(torch.cat(steps, dim=1), full, atol=1e-5, rtol=1e-4)


def test_each_token_gives_a_unit_direction_and_a_beta_between_0_and_2():
    """w is L2-normalised and beta = 2 sigmoid(.), so each H has eigenvalues 1 and 1 - beta in (-1, 1): with large
    weights too (convolution outputs of about 10, sigmoids near 0 and 1). (A direction whose SiLU underflows to zero in
    every channel, at far larger weights, is zero: H = I, as in the authors' code.)"""
    pe = build_positional(BackboneConfig(pos_encoding="path", n_layer=1, n_head=4, n_embd=32))
    with torch.no_grad():
        for p in [*pe.w_down.parameters(), *pe.w_up.parameters(), pe.w_conv]:
            p.mul_(20.0)
        for p in pe.beta_proj.parameters():
            p.mul_(30.0)
    with torch.no_grad():
        w, beta = pe.directions(torch.randn(3, 50, 32), 0, 0, None)
    assert w.shape == (3, 4, 50, 8) and beta.shape == (3, 4, 50)
    torch.testing.assert_close(w.norm(dim=-1), torch.ones(3, 4, 50))
    assert bool((beta > 0).all() and (beta < 2).all())
    assert float(beta.min()) < 0.05 and float(beta.max()) > 1.95  # near both ends, not rounded onto them


def authors_form(q, k, v, w, beta, log_gates, scale, chunk):
    """The authors' reference formulation (fla/ops/path_attn/naive.py), written here: per block, T by forward
    substitution, the in-block logits q.k - (q.w) T (beta w . k), queries and keys carried to the block's edges, dense
    (D x D) block transforms to walk each query block back; the log gates added before the scale, as there."""
    b, h, t, d = q.shape
    pad = -t % chunk
    q_, k_, w_ = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, w))
    beta_ = F.pad(beta, (0, pad))
    n = (t + pad) // chunk
    qb, kb, wb = (x.view(b, h, n, chunk, d) for x in (q_, k_, w_))
    wbeta = wb * beta_.view(b, h, n, chunk, 1)
    upper = torch.ones(chunk, chunk, dtype=torch.bool).triu()
    tm = -(wbeta @ wb.transpose(-1, -2)).masked_fill(upper, 0)
    rows = [tm[..., 0, :]]
    for i in range(1, chunk):  # forward substitution, one row at a time
        prev = torch.stack(rows + [torch.zeros_like(rows[0])] * (chunk - i), dim=-2)
        rows.append(tm[..., i, :] + (tm[..., i, :, None] * prev).sum(-2) * (torch.arange(chunk) < i))
    tm = torch.stack(rows, dim=-2) + torch.eye(chunk, dtype=q.dtype)
    twbk = tm @ (wbeta @ kb.transpose(-1, -2)).masked_fill(upper, 0)
    qw = (qb @ wb.transpose(-1, -2)).tril()
    twb = tm @ wbeta
    local = (qb @ kb.transpose(-1, -2)).tril() - qw @ twbk
    qb = qb - qw @ twb
    kb = kb - twbk.transpose(-1, -2) @ wb
    block = wb.transpose(-1, -2) @ twb  # (D x D) per block: its transform is I - block^T on the right
    a = torch.zeros(b, h, n * chunk, n * chunk, dtype=q.dtype)
    for i in range(n):
        qi = qb[:, :, i]
        for j in range(i - 1, -1, -1):
            a[:, :, i * chunk : (i + 1) * chunk, j * chunk : (j + 1) * chunk] = qi @ kb[:, :, j].transpose(-1, -2)
            qi = qi - qi @ block[:, :, j]
        a[:, :, i * chunk : (i + 1) * chunk, i * chunk : (i + 1) * chunk] = local[:, :, i]
    a = a[..., :t, :t].masked_fill(~torch.ones(t, t, dtype=torch.bool).tril(), float("-inf"))
    sums = log_gates.cumsum(-1)
    a = a + sums[..., :, None] - sums[..., None, :]
    return (a * scale).softmax(-1) @ v


@pytest.mark.parametrize("gated", [False, True], ids=["path", "path_fox"])
def test_the_authors_chunked_formulation_gives_the_same_attention(gated):
    """An oracle from the authors' code (its order of the product, its form of T), at a block size of its own; the
    gate there is scaled with the logits, so PaTH-FoX's unscaled bias is its log gates times sqrt(d)."""
    q, k, v, w, beta = (x.detach() for x in inputs(21, seed=3))
    g = torch.Generator().manual_seed(4)
    log_f = F.logsigmoid(torch.randn(B, H, 21, generator=g, dtype=torch.float64) + 1) if gated else None
    forget = None
    if gated:
        sums = (-log_f).cumsum(-1)
        from cable_lightning.positional.cable import CableBias
        forget = CableBias(sums, sums, None, 0, True)
    ours = path_attention("chunked", q, k, v, w, beta, forget=forget)
    scale = D**-0.5
    gates = log_f / scale if gated else torch.zeros(B, H, 21, dtype=torch.float64)
    theirs = authors_form(q, k, v, w, beta, gates, scale, chunk=8)
    torch.testing.assert_close(ours, theirs, atol=1e-10, rtol=1e-9)


def test_auto_takes_fla_s_kernel_where_it_is_installed_and_the_chunked_path_where_not(monkeypatch):
    """Without flash-linear-attention (an optional extra) ``auto`` runs the chunked path; with it, on its devices,
    its kernel, given (B, T, H, D) tensors, fp32 w and beta, and the log gates divided by the scale. A stand-in module
    answers for fla here, computing the authors' formulation from what it is given."""
    model = backbone("path_fox", n_embd=32)  # heads of 16, a size fla takes
    h = torch.randn(2, 10, 32)
    scores = model.pe.score_bias(h, 0, 0, None)
    q, k, v = (torch.randn(2, 2, 10, 16) for _ in range(3))
    chunked = attention(q, k, v, scores, True, backend="chunked")
    monkeypatch.setattr(path_mod, "FLA_DEVICES", ("cpu",))
    monkeypatch.setitem(sys.modules, "fla", None)  # not installed: the import fails
    assert path_mod.fla_kernel() is None
    torch.testing.assert_close(attention(q, k, v, scores, True, backend="auto"), chunked)
    calls = []

    def parallel_path_attn(q, k, v, w, beta, g, scale):
        calls.append((w.dtype, beta.dtype, tuple(q.shape)))
        heads = [x.transpose(1, 2).double() for x in (q, k, v, w)]
        out = authors_form(*heads, beta.transpose(1, 2).double(), g.transpose(1, 2).double(), scale, chunk=4)
        return out.transpose(1, 2).float(), None

    fake = types.ModuleType("fla.ops.path_attn.parallel")
    fake.parallel_path_attn = parallel_path_attn
    for name in ("fla", "fla.ops", "fla.ops.path_attn"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, "fla.ops.path_attn.parallel", fake)
    fused = attention(q, k, v, scores, True, backend="auto")
    assert calls == [(torch.float32, torch.float32, (2, 10, 2, 16))]
    torch.testing.assert_close(fused, chunked, atol=1e-5, rtol=1e-4)
    attention(q, k, v, scores, True, backend="chunked")  # an explicit backend is what it says
    decoding = PathScores(scores.w, scores.beta, None, None, 9, True)
    attention(q[:, :, 9:], k, v, decoding, True, q_offset=9, backend="auto")  # onto a cache: no kernel
    assert len(calls) == 1


def test_path_reads_the_order_of_the_tokens_not_their_positions():
    pe = build_positional(BackboneConfig(pos_encoding="path_fox", n_layer=1, n_head=2, n_embd=16))
    assert pe.reads_positions is False
