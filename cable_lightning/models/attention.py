"""One attention function, four backends (DESIGN.md):

- ``sdpa``: no score bias -> PyTorch SDPA with no mask tensor (flash / memory-efficient kernels).
- ``flex``: FlexAttention with the bias as ``score_mod`` and a causal block mask (compiled on CUDA).
- ``chunked``: query rows in blocks; the bias is built for one block of rows at a time, so memory
  is O(rows x T), never O(T^2).
- ``materialized``: the obvious formula with the full (B, H, T, T) bias; the reference for tests.

Query row i sits at absolute position ``q_offset + i``; keys at 0..Tk-1 (a KV cache prefix).
"""

from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F
from torch import Tensor

from ..positional.base import ScoreBias

BACKENDS = ("auto", "sdpa", "flex", "chunked", "materialized")
# The chunked path sizes its row blocks so one block's bias holds at most this many elements.
CHUNK_ELEMENTS = 2**24

_compiled_flex = None


def resolve_backend(backend: str, bias: ScoreBias | None, device: torch.device, q_offset: int = 0) -> str:
    if backend not in BACKENDS:
        raise ValueError(f"unknown attention backend {backend!r}; valid: {', '.join(BACKENDS)}")
    if backend != "auto":
        return backend
    if bias is None:
        return "sdpa"
    # Decoding onto a cache goes chunked: O(t) per token, and no FlexAttention recompile per offset.
    return "flex" if device.type == "cuda" and q_offset == 0 else "chunked"


def attention(q: Tensor, k: Tensor, v: Tensor, bias: ScoreBias | None, causal: bool, q_offset: int = 0, backend: str = "auto") -> Tensor:
    """softmax(q.k^T / sqrt(d) + bias + mask) v for q (B, H, Tq, D) and k, v (B, H, Tk, D)."""
    backend = resolve_backend(backend, bias, q.device, q_offset)
    if backend == "sdpa":
        if bias is not None:
            raise ValueError("attention backend 'sdpa' cannot add a score bias; use auto, flex or chunked")
        tq, tk = q.shape[-2], k.shape[-2]
        if not causal or tq == 1:
            return F.scaled_dot_product_attention(q, k, v)
        if tq == tk:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return _chunked(q, k, v, None, causal, q_offset)  # a multi-token step onto a cache
    if backend == "flex":
        return _flex(q, k, v, bias, causal, q_offset)
    if backend == "chunked":
        return _chunked(q, k, v, bias, causal, q_offset)
    return _materialized(q, k, v, bias, causal, q_offset)


def _causal_allowed(rows: range, n_keys: int, q_offset: int, device) -> Tensor:
    q_pos = torch.arange(rows.start, rows.stop, device=device)[:, None] + q_offset
    return torch.arange(n_keys, device=device)[None, :] <= q_pos


def _materialized(q, k, v, bias, causal, q_offset):
    b, h, tq, d = q.shape
    tk = k.shape[-2]
    scores = (q.float() @ k.float().transpose(-1, -2)) / math.sqrt(d)
    if bias is not None:
        scores = scores + bias.rows(0, tq, tk, b, h, q.device)
    if causal:
        scores = scores.masked_fill(~_causal_allowed(range(tq), tk, q_offset, q.device), float("-inf"))
    return (scores.softmax(dim=-1) @ v.float()).to(q.dtype)


def _chunked(q, k, v, bias, causal, q_offset):
    b, h, tq, _ = q.shape
    tk = k.shape[-2]
    rows_per_block = max(1, CHUNK_ELEMENTS // (b * h * tk))
    outputs = []
    for start in range(0, tq, rows_per_block):
        stop = min(tq, start + rows_per_block)
        # Causal rows never see keys past their own position: drop those columns entirely.
        n_keys = min(tk, q_offset + stop) if causal else tk
        mask = bias.rows(start, stop, n_keys, b, h, q.device) if bias is not None else None
        if causal:
            allowed = _causal_allowed(range(start, stop), n_keys, q_offset, q.device)
            if mask is None:
                mask = allowed
            else:
                mask = mask.masked_fill(~allowed, float("-inf"))
        if mask is not None and mask.dtype != torch.bool:
            mask = mask.to(q.dtype)
        outputs.append(F.scaled_dot_product_attention(q[:, :, start:stop], k[:, :, :n_keys], v[:, :, :n_keys], attn_mask=mask))
    return torch.cat(outputs, dim=2)


@functools.lru_cache(maxsize=32)
def _causal_block_mask(tq: int, tk: int, q_offset: int, device: str):
    """Built once per shape and reused by every layer and step (building it is a kernel launch)."""
    from torch.nn.attention.flex_attention import create_block_mask

    def causal_mask(b, h, q_idx, kv_idx):
        return kv_idx <= q_idx + q_offset

    return create_block_mask(causal_mask, None, None, tq, tk, device=device)


def _flex(q, k, v, bias, causal, q_offset):
    from torch.nn.attention.flex_attention import flex_attention

    global _compiled_flex
    tq, tk = q.shape[-2], k.shape[-2]
    block_mask = _causal_block_mask(tq, tk, q_offset, str(q.device)) if causal else None
    score_mod = bias.score_mod() if bias is not None else None
    if q.is_cuda:
        if _compiled_flex is None:
            _compiled_flex = torch.compile(flex_attention, dynamic=False)
        return _compiled_flex(q, k, v, score_mod=score_mod, block_mask=block_mask)
    # CPU: the uncompiled path (forward only on the CPU build; evaluation and tests).
    return flex_attention(q, k, v, score_mod=score_mod, block_mask=block_mask)
