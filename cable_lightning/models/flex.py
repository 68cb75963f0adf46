"""FlexAttention for :func:`attention.attention`'s ``flex`` backend: its block masks (causal, windows, chunks,
documents), its score_mod (a positional bias tabulated where a gradient flows), and how it is compiled on CUDA (eager
on the CPU, whose build runs it forward only).
"""

from __future__ import annotations

import functools
import warnings

import torch
from torch import Tensor

from ..positional.base import Chunks, PositionalBias, ScoreBias
from ..positional.layout import Layout

# FlexAttention's CUDA kernels need heads at least this wide ("NYI: embedding dimension of the query, key, and value
# must be at least 16"); ``auto`` takes ``chunked`` below it, an explicit ``flex`` is refused.
FLEX_MIN_HEAD_DIM = 16

# How flex_kernel compiles FlexAttention on CUDA, by whether a gradient flows: a training step's shape never changes
# (one static kernel); evaluation runs many lengths and a partial last batch, and each static shape would be a compile
# of its own against Dynamo's recompile limit (8), past which FlexAttention ran uncompiled without a word: kernels
# with symbolic shapes serve them all (at most 5: Dynamo compiles a size of 1, batch or mask blocks, apart).
FLEX_COMPILE = {True: dict(dynamic=False), False: dict(dynamic=True)}
FLEX_BACKEND = "inductor"
FLEX_DEVICES = ("cuda",)  # where FlexAttention runs compiled (the CPU build's flex is forward only: eager there)
_compiled_flex: dict = {}  # grad enabled -> FlexAttention compiled for it
_warned_flex_fallback = False
# The tile sizes FlexAttention trains with on CUDA. Inductor's defaults for a compiled block whose score_mod reads a
# position table (KERPLE-log, FIRE, gpt2-small, 1024 tokens, bf16) need more shared memory than an H100 has, and the
# fit fails to compile ("No valid triton configs"); with these tiles the same step compiles and runs (docs/speed.md,
# the flex fits). Evaluation keeps inductor's choice: its kernels compile with it on the same card.
FLEX_TRAIN_KERNEL_OPTIONS = {"BLOCK_M": 64, "BLOCK_N": 64, "num_stages": 2}
# The most entries (heads x positions^2, fp32: 256 MiB) of the table a positional bias is read from in a FlexAttention
# training step (flex_score_mod); a longer training length computes the bias at each score instead.
FLEX_TABLE_ELEMENTS = 2**26


def _create_block_mask(mask_mod, batch: int | None, tq: int, tk: int, device):
    """``create_block_mask`` outside inference mode: the masks are cached and reused by training, and one first built
    in a validation (Lightning's run under ``torch.inference_mode``) held inference tensors that a training step at
    the same shape could not save for its backward."""
    from torch.nn.attention.flex_attention import create_block_mask

    with torch.inference_mode(False):
        return create_block_mask(mask_mod, batch, None, tq, tk, device=device)


@functools.lru_cache(maxsize=32)
def _causal_block_mask(tq: int, tk: int, q_offset: int, device: str):
    """Built once per shape and reused by every layer and step (building it is a kernel launch)."""

    def causal_mask(b, h, q_idx, kv_idx):
        return kv_idx <= q_idx + q_offset

    return _create_block_mask(causal_mask, None, tq, tk, device)


def in_window(q_pos: Tensor, kv_idx: Tensor, window: int | Chunks) -> Tensor:
    """A block mask's test that key ``kv_idx`` lies in the window of the query at ``q_pos`` (either side)."""
    if isinstance(window, Chunks):
        return q_pos // window.size == kv_idx // window.size
    distance = q_pos - kv_idx
    return (distance < window) & (distance > -window)


@functools.lru_cache(maxsize=32)
def _window_block_mask(tq: int, tk: int, q_offset: int, causal: bool, window: int | Chunks, device: str):
    """A sliding window's block mask: FlexAttention skips every key block outside it."""

    def window_mask(b, h, q_idx, kv_idx):
        inside = in_window(q_idx + q_offset, kv_idx, window)
        return inside & (kv_idx <= q_idx + q_offset) if causal else inside

    return _create_block_mask(window_mask, None, tq, tk, device)


def _document_block_mask(documents: Layout, tq: int, tk: int, q_offset: int, causal: bool, window: int | Chunks | None):
    """The block mask of a layout's documents (with the causal mask and a window), built once per layout and shape:
    FlexAttention skips every key block outside a query block's documents."""
    key = ("flex", tq, tk, q_offset, causal, window)
    if key not in documents.masks:
        ids = documents.documents

        def document_mask(b, h, q_idx, kv_idx):
            distance = q_idx + q_offset - kv_idx
            inside = ids[b, q_idx + q_offset] == ids[b, kv_idx]
            if causal:
                inside = inside & (distance >= 0)
            if window is not None:
                inside = inside & in_window(q_idx + q_offset, kv_idx, window)
            return inside

        documents.masks[key] = _create_block_mask(document_mask, ids.shape[0], tq, tk, ids.device)
    return documents.masks[key]


def flex_block_mask(tq: int, tk: int, q_offset: int, causal: bool, window: int | Chunks | None,
                    documents: Layout | None, device: torch.device):
    """The block mask FlexAttention runs with (None: every key visible): a layout's documents (with the causal mask
    and a window), else a window, else the causal mask; built once per shape and device, or once per layout."""
    if documents is not None:
        return _document_block_mask(documents, tq, tk, q_offset, causal, window)
    if window is not None:
        return _window_block_mask(tq, tk, q_offset, causal, window, str(device))
    return _causal_block_mask(tq, tk, q_offset, str(device)) if causal else None


def compiled_block_mask(backend: str, length: int, causal: bool, window: int | Chunks | None, layout: Layout | None,
                        key_padding: Tensor | None, device: torch.device):
    """The block mask a compiled block's FlexAttention takes as an input (:meth:`Backbone._blocks`), or None where the
    layer cannot run ``flex``. Built here, outside the block's graph: traced into it, Dynamo ignores the cache and the
    graph built the mask again at every step. A layer that ``auto`` sends elsewhere gets one it does not read (built
    once per training shape)."""
    if key_padding is not None or not (backend == "flex" or (backend == "auto" and device.type == "cuda")):
        return None
    documents = layout if layout is not None and layout.documents is not None else None
    return flex_block_mask(length, length, 0, causal, window, documents, device)


def flex_kernel(device: torch.device):
    """FlexAttention compiled on CUDA (:data:`FLEX_COMPILE`: static for training, symbolic-shape kernels shared by every
    evaluation shape), eager on CPU (forward only on the CPU build: evaluation and tests). Inside a compiled region (a
    compiled block) the plain function: Dynamo puts it in the region's graph, compiled with it (compiling a kernel
    there was a side effect of the trace, which made every block compile again)."""
    from torch.nn.attention.flex_attention import flex_attention

    if device.type not in FLEX_DEVICES or torch.compiler.is_compiling():
        return flex_attention
    grad = torch.is_grad_enabled()
    if grad not in _compiled_flex:
        _compiled_flex[grad] = torch.compile(flex_attention, backend=FLEX_BACKEND, **FLEX_COMPILE[grad])
    return functools.partial(_run_compiled_flex, _compiled_flex[grad])


def _run_compiled_flex(compiled, *args, **kwargs):
    """``compiled`` FlexAttention, never silently uncompiled: past Dynamo's recompile limit it would run eagerly
    (the full score matrix) without a word. Where Dynamo is set to fail on that limit (the test suite) the failure
    propagates; elsewhere (a run) one warning line says so and the call runs eagerly, as Dynamo would have."""
    global _warned_flex_fallback
    from torch._dynamo.exc import FailOnRecompileLimitHit
    from torch.nn.attention.flex_attention import flex_attention

    strict = torch._dynamo.config.fail_on_recompile_limit_hit
    try:
        with torch._dynamo.config.patch(fail_on_recompile_limit_hit=True):
            return compiled(*args, **kwargs)
    except FailOnRecompileLimitHit:
        if strict:
            raise
        if not _warned_flex_fallback:
            _warned_flex_fallback = True
            warnings.warn(f"FlexAttention hit Dynamo's recompile limit ({torch._dynamo.config.recompile_limit} "
                          "compiled versions): shapes it has not compiled run uncompiled, materializing the score "
                          "matrix; raise torch._dynamo.config.recompile_limit or run fewer encodings in one process",
                          stacklevel=2)
        return flex_attention(*args, **kwargs)


def flex_score_mod(bias: ScoreBias | None, heads: int, extent: int, device):
    """The score_mod FlexAttention runs for ``bias``. Where a gradient flows, a :class:`PositionalBias` is
    tabulated first (:meth:`PositionalBias.position_table`, heads x ``extent``^2 entries, at most
    :data:`FLEX_TABLE_ELEMENTS`) and read from the table: FlexAttention's backward scatters the gradient of whatever
    the score_mod reads with one atomic add per score, and a per-head parameter (KERPLE's r1 and r2, FIRE's MLP, T5's
    table) read at every score made those adds collide on a few addresses (the flex path trained at 0.03x NoPE on an
    H200). Without a gradient, or past the table's size, the bias is computed at each score."""
    if bias is None:
        return None
    if torch.is_grad_enabled() and isinstance(bias, PositionalBias) and heads * extent**2 <= FLEX_TABLE_ELEMENTS:
        return bias.table_score_mod(bias.position_table(heads, extent, device))
    return bias.score_mod()


def attend_flex(q, k, v, bias, causal, q_offset, window=None, documents=None, block_mask=None, sink=None):
    """FlexAttention of (q, k, v) with the bias as its score_mod, under the block mask of the causal mask, a window and
    documents (built here unless given); a sink through the log-sum-exp FlexAttention returns."""
    tq, tk = q.shape[-2], k.shape[-2]
    if block_mask is None:
        block_mask = flex_block_mask(tq, tk, q_offset, causal, window, documents, q.device)
    extent = bias.layout.extent if bias is not None and bias.layout is not None else tk
    score_mod = flex_score_mod(bias, q.shape[1], extent, q.device)
    options = flex_kernel_options(q.device, torch.is_grad_enabled())
    if sink is None:
        return flex_kernel(q.device)(q, k, v, score_mod=score_mod, block_mask=block_mask, kernel_options=options)
    out, lse = flex_kernel(q.device)(q, k, v, score_mod=score_mod, block_mask=block_mask, kernel_options=options,
                                     return_lse=True)
    # The row's weights, renormalised with exp(sink) beside exp(lse): out * Z / (Z + e^sink)
    return (out * torch.sigmoid(lse.float() - sink.float())[..., None]).to(out.dtype)


def flex_kernel_options(device: torch.device, grad: bool) -> dict | None:
    """The tiles FlexAttention runs with: :data:`FLEX_TRAIN_KERNEL_OPTIONS` where it trains on CUDA (inductor's own
    choice asked for more shared memory than an H100 has), inductor's choice elsewhere."""
    return dict(FLEX_TRAIN_KERNEL_OPTIONS) if grad and device.type in FLEX_DEVICES else None
