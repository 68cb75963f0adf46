"""One attention function, five backends (docs/attention.md tells each whole):

- ``sdpa``: no score bias -> PyTorch SDPA with no mask tensor (flash / memory-efficient kernels).
- ``fold``: a causal bias that factorises (CABLE, CABLE_NW, ALiBi) folded into extra head dimensions, then plain
  causal SDPA: the same fused kernels as no bias at all (see :func:`fold_bias`).
- ``flex``: FlexAttention with the bias as ``score_mod`` and a causal block mask (compiled on CUDA).
- ``chunked``: query rows in blocks; the bias is built for one block of rows at a time, so memory is O(rows x T).
- ``materialized``: the obvious formula with the full (B, H, T, T) bias; the reference for tests, written as the weights
  of :func:`attention_map` (what the attention diagnostics read) times v.

Scores that need the logits themselves (:class:`LogitScores`: CoPE, DAPEv2, PaTH) run only ``chunked`` or
``materialized`` (``auto`` first asks the scores for a fused kernel of their own: PaTH's, from flash-linear-attention).
Query row i sits at absolute position ``q_offset + i``; keys at 0..Tk-1 (a KV cache prefix). ``key_padding`` hides
padded keys, a sliding ``window`` limits each row to its last ``window`` positions, and a ``layout`` with documents
keeps every query inside its own document, on every backend, none of them building a (T x T) mask.

A learned ``sink`` (gpt-oss; the backbone's ``attn_sink``) is one more logit in every row's normaliser, with no value:
the fused paths carry it as one more key that every row sees (:func:`with_sink_key`), the paths that build scores as
one more column, and FlexAttention through its log-sum-exp.
"""

from __future__ import annotations

import dataclasses
import math
import typing
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor

from ..errors import ConfigError
from ..positional.base import Chunks, LogitScores, ScoreBias, visible_keys, window_keys, window_span
from ..positional.layout import Layout
from .flex import FLEX_MIN_HEAD_DIM, attend_flex

Backend = Literal["auto", "sdpa", "fold", "flex", "chunked", "materialized"]
BACKENDS = typing.get_args(Backend)
# The chunked path sizes its row blocks so one block's bias holds at most this many elements.
CHUNK_ELEMENTS = 2**24
# ... and inside a compiled block (`compile: true`), this many: Dynamo unrolls the loop over row blocks into the graph,
# whose compile time grows with the blocks (CoPE at 16 x 1024 tokens took 103, and compiling outlasted 6 minutes on an
# H100; on the 2-core VM, inductor compiled a 2-layer CoPE step in 48 s with 1 block, 160 s with 8, 668 s with 32).
# 2 blocks for CoPE, DAPEv2 or stick-breaking at 16 x 1024; a block's maps hold 4 GiB in fp32 at most.
COMPILED_CHUNK_ELEMENTS = 2**30
# Folded heads are zero-padded to a multiple of this width (CUDA's flash kernels need it).
FOLD_HEAD_MULTIPLE = 8
# bf16/fp16 hold 8/11 significant bits; the folded key column is split into this many pieces of that
# dtype, which sum back to it to about fp32 precision (CABLE's S and ALiBi's positions reach thousands).
FOLD_PIECES_LOW_PRECISION = 3


def backends_for(scores: str, causal: bool) -> tuple[str, ...]:
    """The backends that can run an encoding that adds ``scores`` (:data:`positional.base.ScoreKind`) to the logits."""
    if scores == "none":
        return BACKENDS
    if scores == "logits":
        return ("auto", "chunked", "materialized")
    fold = ("fold",) if scores == "foldable_bias" and causal else ()
    return ("auto", *fold, "flex", "chunked", "materialized")


def check_backend(backend: str, encoding, causal: bool, head_dim: int | None = None) -> None:
    """Before anything is built: ``backend`` must be one that can run ``encoding`` (an :class:`Encoding`), and
    ``flex`` needs heads FlexAttention's CUDA kernels take (on CPU it runs forward only, so no fit could use it)."""
    valid = backends_for(encoding.scores, causal)
    if backend not in valid:
        raise ConfigError(f"attention_backend {backend!r} cannot run {encoding.label()} "
                          f"({'causal' if causal else 'bidirectional'}); valid: {', '.join(valid)}")
    if backend == "flex" and head_dim is not None and head_dim < FLEX_MIN_HEAD_DIM:
        raise ConfigError(_flex_head_error(head_dim, [b for b in valid if b != "flex"]))


def _flex_head_error(head_dim: int, valid) -> str:
    return (f"attention backend 'flex' needs a head size of at least {FLEX_MIN_HEAD_DIM} (FlexAttention's CUDA "
            f"kernels), got {head_dim}; valid: {', '.join(valid)}")


def resolve_backend(backend: str, bias: ScoreBias | LogitScores | None, device: torch.device, q_offset: int = 0,
                    padded: bool = False, head_dim: int | None = None) -> str:
    if backend not in BACKENDS:
        raise ConfigError(f"unknown attention backend {backend!r}; valid: {', '.join(BACKENDS)}")
    if padded and backend == "flex":
        raise ConfigError("attention backend 'flex' cannot take a key padding mask; use auto, chunked or materialized")
    small_heads = device.type == "cuda" and head_dim is not None and head_dim < FLEX_MIN_HEAD_DIM
    if backend == "flex" and small_heads and not isinstance(bias, LogitScores):
        raise ConfigError(_flex_head_error(head_dim, ("auto", "chunked", "materialized")))
    if isinstance(bias, LogitScores):
        if backend not in ("auto", "chunked", "materialized"):
            raise ConfigError(f"attention backend {backend!r} cannot run {type(bias).__name__}: its scores need the "
                              "q.k logits (CoPE, DAPEv2); use auto, chunked or materialized")
        return "chunked" if backend == "auto" else backend
    if backend != "auto":
        return backend
    if bias is None:
        return "sdpa"
    if bias.foldable:
        return "fold"
    # Decoding onto a cache goes chunked: O(t) per token, and no FlexAttention recompile per offset.
    return "flex" if device.type == "cuda" and q_offset == 0 and not padded and not small_heads else "chunked"


def attention(q: Tensor, k: Tensor, v: Tensor, bias: ScoreBias | LogitScores | None, causal: bool, q_offset: int = 0,
              backend: str = "auto", key_padding: Tensor | None = None, window: int | Chunks | None = None,
              layout: Layout | None = None, block_mask=None, sink: Tensor | None = None) -> Tensor:
    """softmax(q.k^T / sqrt(d) + bias + mask) v for q (B, H, Tq, D) and k, v (B, H, Tk, D); with
    :class:`LogitScores`, softmax(scores(q.k^T / sqrt(d)) + mask) v (or exp(scores + mask) v when the scores are
    log weights). The mask hides the future when ``causal``, padded keys (``key_padding``: (B, Tk), True at real
    keys), with a ``window``, keys ``window`` or more positions away, and with a ``layout``'s documents, keys of
    another document. ``block_mask``: that mask for ``flex`` (:func:`.flex.flex_block_mask`), built by the caller (a
    compiled block takes it as an input); None: built here. ``sink``: (H,) logits, one per head, each one more term
    exp(sink) in its rows' normaliser (the weights then sum to less than 1); None: no sink."""
    if sink is not None and sink.dim() == 1:
        sink = sink.view(1, -1, 1)  # (B|1, H, rows|1): a per-row logit, as the fold makes it
    width = v.shape[-1]
    if width < q.shape[-1]:  # q and k wider than v (PoPE): the fused kernels take equal widths only (else, on CPU,
        # the math path with the whole score matrix: 5.4x slower at 2048 tokens); zero columns of v add nothing
        out = attention(q, k, F.pad(v, (0, q.shape[-1] - width)), bias, causal, q_offset, backend, key_padding,
                        window, layout, block_mask, sink)
        return out[..., :width]
    requested = backend
    backend = resolve_backend(backend, bias, q.device, q_offset, padded=key_padding is not None, head_dim=q.shape[-1])
    documents = layout if layout is not None and layout.documents is not None else None
    if backend == "chunked" and requested == "auto" and isinstance(bias, LogitScores) and sink is None:
        fused = bias.kernel(q, k, v, q_offset, key_padding, window, documents)  # PaTH's Triton kernel, if installed
        if fused is not None:
            return fused
    if backend == "fold" and bias is not None:
        if not bias.foldable:
            raise ConfigError(f"attention backend 'fold' needs a causal bias that factorises; {type(bias).__name__} "
                             f"(causal={bias.causal}) does not: use auto, flex or chunked")
        head_dim = q.shape[-1]
        folded_q, folded_k, folded_v, row_shift = fold_bias(q, k, v, bias)
        shifted_sink = None if sink is None else sink + row_shift.squeeze(-1)  # the sink moves with the row's logits
        return _unbiased(folded_q, folded_k, folded_v, causal, q_offset, scale=head_dim**-0.5,
                         key_padding=key_padding, window=window, documents=documents, sink=shifted_sink)[..., :head_dim]
    if backend in ("sdpa", "fold"):
        if bias is not None:
            raise ConfigError("attention backend 'sdpa' cannot add a score bias; use auto, fold, flex or chunked")
        return _unbiased(q, k, v, causal, q_offset, key_padding=key_padding, window=window, documents=documents,
                         sink=sink)
    if backend == "flex":
        return attend_flex(q, k, v, bias, causal, q_offset, window, documents, block_mask, sink)
    if backend == "chunked":
        return _chunked(q, k, v, bias, causal, q_offset, key_padding=key_padding, window=window, documents=documents,
                        sink=sink)
    return _materialized(q, k, v, bias, causal, q_offset, key_padding, window, documents, sink)


def visible(start: int, stop: int, n_keys: int, causal: bool, q_offset: int, key_padding: Tensor | None,
            device, first_key: int = 0, window: int | Chunks | None = None,
            documents: Layout | None = None) -> Tensor | None:
    """(B|1, 1, rows, keys) True where query rows [start, stop) may attend keys [first_key, n_keys): not in its
    future (causal), inside its ``window``, in its own document (a layout's ``documents``) and not padding (a padded
    query sees itself, so no row is empty); None where every key is visible."""
    allowed = None
    if causal or window is not None:
        allowed = visible_keys(start, stop, first_key, n_keys, q_offset, causal, window, device)
    if documents is not None:
        same = documents.same_document(slice(q_offset + start, q_offset + stop), slice(first_key, n_keys))
        allowed = same if allowed is None else same & allowed
    if key_padding is None:
        return allowed
    q_pos = torch.arange(start, stop, device=device)[:, None] + q_offset
    own = torch.arange(first_key, n_keys, device=device) == q_pos
    seen = key_padding[:, None, None, first_key:n_keys] | own
    return seen if allowed is None else seen & allowed


def _unbiased(q, k, v, causal, q_offset, scale=None, key_padding=None, window=None, documents=None, sink=None):
    """Plain attention with no mask tensor wherever the shapes allow, so SDPA may pick a fused kernel."""
    tq, tk = q.shape[-2], k.shape[-2]
    if documents is not None:  # blocks of rows, each with its mask of documents
        return _chunked(q, k, v, None, causal, q_offset, scale, key_padding=key_padding, window=window,
                        documents=documents, sink=sink)
    if window is not None and window_span(window) < tk:  # blocks of rows, each against the keys it sees
        return _chunked(q, k, v, None, causal, q_offset, scale, key_padding=key_padding, window=window, sink=sink)
    if sink is not None:
        if key_padding is None and (not causal or tq == 1 or tq == tk):
            return _unmasked_with_sink(q, k, v, sink, causal and tq > 1, scale)
        return _chunked(q, k, v, None, causal, q_offset, scale, key_padding=key_padding, sink=sink)
    if key_padding is not None:
        mask = visible(0, tq, tk, causal, q_offset, key_padding, q.device)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    if not causal or tq == 1:
        return F.scaled_dot_product_attention(q, k, v, scale=scale)
    if tq == tk:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
    return _chunked(q, k, v, None, causal, q_offset, scale)  # a multi-token step onto a cache


def with_sink_key(q: Tensor, k: Tensor, v: Tensor, sink: Tensor, scale: float, first: bool = False):
    """(q', k', v') whose attention at ``scale`` equals that of (q, k, v) with ``sink`` (B|1, H, rows|1: a logit per
    row) in each row's normaliser: one more key, with value 0, whose logit is the row's sink, carried by extra query
    columns (the sink / scale, in pieces of q's dtype that sum to it to about fp32 precision, as the fold's key
    columns are: the fold's shifted sinks reach the hundreds) against ones in that key and zeros in every other. The
    key goes last, or ``first`` (for causal attention, which then needs a leading row of its own: see
    :func:`_unmasked_with_sink`). Widths are padded to a multiple of :data:`FOLD_HEAD_MULTIPLE` and v to q's width,
    for the fused kernels; the caller keeps v's columns of the output."""
    batch, heads, tq, width = q.shape
    pieces = FOLD_PIECES_LOW_PRECISION if q.dtype in (torch.bfloat16, torch.float16) else 1
    target = (sink.to(torch.promote_types(sink.dtype, torch.float32)) / scale).expand(batch, heads, tq)[..., None]
    columns = [target.to(q.dtype)]  # the first piece carries the gradient, the rest are its rounding errors
    rest = target.detach()
    for _ in range(pieces - 1):
        rest = rest - columns[-1].detach().to(rest.dtype)
        columns.append(rest.to(q.dtype))
    pad = -(width + pieces) % FOLD_HEAD_MULTIPLE
    wide = width + pieces + pad
    folded_q = torch.cat([q, *columns, q.new_zeros(batch, heads, tq, pad)], dim=-1)
    folded_k = F.pad(k, (0, wide - width))
    sink_key = torch.cat([k.new_zeros(batch, heads, 1, width), k.new_ones(batch, heads, 1, pieces),
                          k.new_zeros(batch, heads, 1, pad)], dim=-1)
    folded_v = F.pad(v, (0, wide - v.shape[-1]))
    sink_value = v.new_zeros(batch, heads, 1, wide)
    if first:
        return folded_q, torch.cat([sink_key, folded_k], dim=2), torch.cat([sink_value, folded_v], dim=2)
    return folded_q, torch.cat([folded_k, sink_key], dim=2), torch.cat([folded_v, sink_value], dim=2)


def _unmasked_with_sink(q, k, v, sink, causal, scale=None):
    """Attention with a sink where nothing but the causal mask hides a key (Tq = Tk then): fused SDPA, no mask tensor.
    Causal, the sink key goes first, behind a leading query row of zeros that SDPA's causal mask (row i sees keys
    0..i) gives the sink alone, so real row i sees the sink and keys 0..i; that row is dropped."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    folded_q, folded_k, folded_v = with_sink_key(q, k, v, sink, scale, first=causal)
    if causal:
        folded_q = F.pad(folded_q, (0, 0, 1, 0))
        out = F.scaled_dot_product_attention(folded_q, folded_k, folded_v, is_causal=True, scale=scale)[:, :, 1:]
    else:
        out = F.scaled_dot_product_attention(folded_q, folded_k, folded_v, scale=scale)
    return out[..., : v.shape[-1]]


def fold_bias(q: Tensor, k: Tensor, v: Tensor, bias: ScoreBias) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Heads (q', k', v') whose plain causal attention, at scale 1/sqrt(d) of the original head size,
    equals softmax(q.k^T / sqrt(d) + bias + causal mask) v, in values and gradients.

    The bias is ``a_i . (c_j - c_i)`` (:meth:`ScoreBias.factors`). Its ``-a_i . c_i`` part is
    constant along a query row, so softmax ignores it; ``a_i . c_j`` is one more dot product:
    q' = [q, a sqrt(d)], k' = [k, c]. Three refinements keep this exact in practice:

    - centring per block of query rows: any constant r may replace c_i in a row, and the kernel rounds
      the folded logit a_i . (c_j - r), so r should be near c_i. Each block of query rows gets its own
      key column c_j - r_block (its middle row's c), and its queries carry a only in that column (zero
      elsewhere, which adds nothing exactly): one fused call, every row centred near itself. The blocks
      fill the columns that padding the width to a multiple of 8 leaves, so they cost nothing (fp32;
      bf16/fp16 use one block);
    - low precision: c grows with position (CABLE's S, ALiBi's j), beyond bf16's 8 bits, so in
      bf16/fp16 c is split into pieces of that dtype that sum to it to about fp32 precision, each
      against its own copy of a (tensor cores multiply exactly and accumulate in fp32);
    - the row constant's gradients: the kernel's score gradients d_ij are rounded, so their row sums
      are not exactly zero. One more column pair, value 0 in q' against 1 in k', carries the gradients
      of the row constant -a_i . c_i: for a, sum_j d_ij (c_j - c_i) instead of sum_j d_ij c_j (whose
      rounding noise grows with c_i, i.e. with position); for c_i, -a_i sum_j d_ij, zero in exact
      arithmetic, whose rounding balances that of the key terms sum_i d_ij a_i, so the gradient of a
      shift of every c stays zero. Without it, FoX's gate offset (whose gradient is such a sum over
      every position) was 5e-3 off at 1000 tokens; with it, 2e-4 (docs/speed.md).

    Widths are zero-padded to a multiple of :data:`FOLD_HEAD_MULTIPLE`, v to the same width (the
    CPU flash kernel takes only equal widths); the caller drops the padded output columns. Also returned: each row's
    shift a_i . (c_i - r) (B, H, Tq, 1), by which the folded logits exceed the true ones in value (the centre column
    takes its gradients back), with a as the kernel reads it (rounded to q's dtype): what a sink's logit must add.
    """
    batch, heads, tq, head_dim = q.shape
    tk = k.shape[-2]
    a, c = bias.factors(tk)
    a = a.float().expand(batch, heads, tq, -1)
    c = c.float().expand(batch, heads, tk, -1)
    pieces = FOLD_PIECES_LOW_PRECISION if q.dtype in (torch.bfloat16, torch.float16) else 1
    factor_width = pieces * a.shape[-1]
    # As many blocks as fit in the zero padding the kernel needs anyway (head 64, fp32: 7): they cost nothing. In
    # bf16/fp16 one: the pieces carry the precision, and more blocks measured worse for CABLE's weight gradient.
    padded_width = -(-(head_dim + factor_width + 1) // FOLD_HEAD_MULTIPLE) * FOLD_HEAD_MULTIPLE
    blocks = 1 if pieces > 1 else max(1, min(tq, (padded_width - head_dim - 1) // factor_width))
    rows = -(-tq // blocks)
    block_of = torch.arange(tq, device=q.device) // rows
    starts = torch.arange(0, tq, rows, device=q.device)
    middles = (starts + torch.clamp(starts + rows, max=tq) - 1) // 2 + bias.q_offset
    refs = c[:, :, middles].detach()  # (B, H, blocks, E): each block's reference, its middle row's c
    c_blocks = (c.unsqueeze(-2) - refs.unsqueeze(-3)).flatten(-2)  # (B, H, Tk, blocks * E)
    # (Tq, blocks); a comparison, not F.one_hot, which reads its input's range back to the host (a sync per layer)
    one_hot = (block_of[:, None] == torch.arange(len(starts), device=q.device)).to(a.dtype)
    a_blocks = (one_hot[..., None] * a.unsqueeze(-2)).flatten(-2)  # a in its own block's columns only
    c_pieces = [c_blocks.to(q.dtype)]  # the first piece carries c's gradient, the rest are its rounding errors
    rest = c_blocks.detach()
    for _ in range(pieces - 1):
        rest = rest - c_pieces[-1].detach().float()
        c_pieces.append(rest.to(q.dtype))
    # c_i - r: the key column at the query's own position, in its block's centring
    c_own = c[:, :, bias.q_offset : bias.q_offset + tq] - refs[:, :, block_of]
    row_constant = (a * c_own).sum(-1, keepdim=True)
    centre = row_constant.detach() - row_constant  # zero, with gradients -(c_i - r) for a and -a_i for c_i
    root_d = math.sqrt(head_dim)
    # By how much the kernel's folded logits exceed the true ones, in value: a_i . (c_i - r), a as the kernel reads it
    a_read = (a * root_d).to(q.dtype).float() / root_d
    row_shift = (a_read * c_own).sum(-1, keepdim=True).detach()
    q_cols = [q] + [(a_blocks * root_d).to(q.dtype)] * pieces + [(centre * root_d).to(q.dtype)]
    k_cols = [k] + c_pieces + [k.new_ones(batch, heads, tk, 1)]
    width = sum(x.shape[-1] for x in q_cols)
    pad = -width % FOLD_HEAD_MULTIPLE
    q_cols.append(q.new_zeros(batch, heads, tq, pad))
    k_cols.append(k.new_zeros(batch, heads, tk, pad))
    folded_v = torch.cat([v, v.new_zeros(batch, heads, tk, width + pad - head_dim)], dim=-1)
    return torch.cat(q_cols, dim=-1), torch.cat(k_cols, dim=-1), folded_v, row_shift


def with_sink_column(scores: Tensor, sink: Tensor | None, start: int, stop: int) -> Tensor:
    """``scores`` (B, H, rows, keys) and one more column, each row's sink logit (rows [start, stop) of ``sink``)."""
    if sink is None:
        return scores
    rows = sink if sink.shape[-1] == 1 else sink[..., start:stop]
    column = rows.to(scores.dtype).expand(*scores.shape[:2], stop - start)[..., None]
    return torch.cat([scores, column], dim=-1)


def _from_logits(q, k, v, scores: LogitScores, start: int, causal: bool, q_offset: int, key_padding=None,
                 window=None, documents=None, reference=False, sink=None):
    """Attention of query rows [start, start + rows) whose scores are a function of their logits (against keys
    [0, Tk) whatever the window: the window masks keys after the scores are computed)."""
    wide = torch.promote_types(q.dtype, torch.float32)
    stop = start + q.shape[-2]
    logits = scores.logits(q, k, start, stop, reference)
    out = scores.scores(logits, q, start, stop, key_padding)
    # In place; causal and unpadded only on the keys from the block's second row on: every earlier key is seen.
    plain = causal and key_padding is None and window is None and documents is None
    first = min(k.shape[-2], q_offset + start + 1) if plain else 0
    allowed = visible(start, stop, k.shape[-2], causal, q_offset, key_padding, q.device, first, window, documents)
    if allowed is not None:
        out[..., first:].masked_fill_(~allowed, float("-inf"))
    weights = scores.weights(with_sink_column(out, sink, start, stop))[..., : k.shape[-2]]
    return (weights @ v.to(wide)).to(q.dtype)


def _materialized(q, k, v, bias, causal, q_offset, key_padding=None, window=None, documents=None, sink=None):
    if isinstance(bias, LogitScores):
        return _from_logits(q, k, v, bias, 0, causal, q_offset, key_padding, window, documents, reference=True,
                            sink=sink)
    wide = torch.promote_types(q.dtype, torch.float32)  # fp32, or fp64 for a double-precision reference
    weights = attention_map(q, k, bias, causal, q_offset, 0, key_padding, window, documents, sink).weights
    return (weights @ v.to(wide)).to(q.dtype)


@dataclasses.dataclass
class AttentionMap:
    """What the reference path computes for a block of query rows against keys [0, Tk), each (B, H, rows, Tk):
    ``weights``, what each row puts on each key (0 where hidden; a row sums to 1, or to at most 1 for log-weight
    scores: stick-breaking); ``scores``, what the weights are normalised from (:meth:`ScoreBias.scores`), -inf where
    hidden (or where the encoding gives a key nothing); ``logits``, the largest-logit view: ``scores`` when they are
    softmax's input, or for log-weight scores the scaled q.k logits they come from, -inf where hidden."""

    weights: Tensor
    scores: Tensor
    logits: Tensor


def attention_map(q: Tensor, k: Tensor, scores: ScoreBias | LogitScores | None, causal: bool, q_offset: int = 0,
                  start: int = 0, key_padding: Tensor | None = None, window: int | Chunks | None = None,
                  documents: Layout | None = None, sink: Tensor | None = None) -> AttentionMap:
    """The weights attention applies to query rows [start, start + rows) (``q``: those rows, (B, H, rows, D), at
    positions q_offset + start + i) over keys ``k`` (B, H, Tk, D), through the score contract alone
    (:meth:`ScoreBias.scores`, :meth:`ScoreBias.weights`; no score object: softmax over the logits). The
    ``materialized`` backend is this map times v, and every other backend is tested against it. ``documents``: a
    layout whose documents keep each row inside its own; ``sink``: (B|1, H, rows|1) logits, one more term in each
    row's softmax (its weights then sum to less than 1)."""
    wide = torch.promote_types(q.dtype, torch.float32)
    stop = start + q.shape[-2]
    if isinstance(scores, LogitScores):
        logits = scores.logits(q, k, start, stop, reference=True)
    else:
        logits = (q.to(wide) * q.shape[-1] ** -0.5) @ k.to(wide).transpose(-1, -2)
    out = logits if scores is None else scores.scores(logits, q, start, stop, key_padding)
    allowed = visible(start, stop, k.shape[-2], causal, q_offset, key_padding, q.device, window=window,
                      documents=documents)
    if allowed is not None:  # in place when nothing keeps `out` for a backward (it is new: the contract's scores are)
        out = out.masked_fill_(~allowed, float("-inf")) if not torch.is_grad_enabled() else \
            out.masked_fill(~allowed, float("-inf"))
    if sink is not None:
        if scores is not None and not scores.softmax:
            raise ConfigError(f"{type(scores).__name__}'s weights are no softmax: a sink has no normaliser to join")
        if sink.dim() == 1:
            sink = sink.view(1, -1, 1)
        keys = out.shape[-1]
        weights = with_sink_column(out, sink, start, stop).softmax(dim=-1)[..., :keys]
        return AttentionMap(weights, out, out)
    if scores is None:
        return AttentionMap(out.softmax(dim=-1), out, out)
    if scores.softmax:
        return AttentionMap(scores.weights(out), out, out)
    shown = logits if allowed is None else logits.masked_fill(~allowed, float("-inf"))
    return AttentionMap(scores.weights(out), out, shown)


def _chunked(q, k, v, bias, causal, q_offset, scale=None, key_padding=None, window=None, documents=None, sink=None):
    b, h, tq, head_dim = q.shape
    tk = k.shape[-2]
    logit_scores = isinstance(bias, LogitScores)
    maps = h * (bias.maps_per_head if logit_scores else 1)
    windowed = window is not None and not logit_scores  # logit scores need every key up to the row (then masked)
    span = window_span(window)
    budget = COMPILED_CHUNK_ELEMENTS if torch.compiler.is_compiling() else CHUNK_ELEMENTS
    rows_per_block = max(1, budget // (b * maps * (min(tk, 2 * span) if windowed else tk)))
    if windowed:
        rows_per_block = min(rows_per_block, span)  # a block then sees at most 2 x span keys
    outputs = []
    for start in range(0, tq, rows_per_block):
        stop = min(tq, start + rows_per_block)
        # Causal rows never see keys past their own position, windowed ones none outside their window: drop those
        # columns entirely.
        n_keys = min(tk, q_offset + stop) if causal else tk
        first_key = 0
        if windowed:
            first_key, n_keys = window_keys(window, q_offset + start, q_offset + stop - 1, tk, causal)
        if logit_scores:
            outputs.append(_from_logits(q[:, :, start:stop], k[:, :, :n_keys], v[:, :, :n_keys], bias, start, causal,
                                        q_offset, key_padding, window, documents, sink=sink))
            continue
        mask = bias.rows(start, stop, n_keys, b, h, q.device, first_key) if bias is not None else None
        allowed = visible(start, stop, n_keys, causal, q_offset, key_padding, q.device, first_key, window, documents)
        if allowed is not None:
            if mask is None:
                mask = allowed
            else:
                mask = mask.masked_fill(~allowed, float("-inf"))
        if mask is not None and mask.dtype != torch.bool:
            mask = mask.to(q.dtype)
        rows_q, rows_k, rows_v = q[:, :, start:stop], k[:, :, first_key:n_keys], v[:, :, first_key:n_keys]
        if sink is not None:  # the sink as one more key, last, that every row sees
            rows_sink = sink if sink.shape[-1] == 1 else sink[..., start:stop]
            rows_q, rows_k, rows_v = with_sink_key(rows_q, rows_k, rows_v, rows_sink,
                                                   head_dim**-0.5 if scale is None else scale)
            if mask is not None:
                seen = True if mask.dtype == torch.bool else 0.0
                mask = F.pad(mask, (0, 1), value=seen)
            scale = head_dim**-0.5 if scale is None else scale
        out = F.scaled_dot_product_attention(rows_q, rows_k, rows_v, attn_mask=mask, scale=scale)
        outputs.append(out[..., : v.shape[-1]])
    return torch.cat(outputs, dim=2)
