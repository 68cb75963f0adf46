"""The estimate a fit's row puts beside its measured peak memory: what a bf16-mixed AdamW step holds."""

from __future__ import annotations

import torch


def memory_estimate(model, rows: int, length: int) -> tuple[float, float, float, float]:
    """Bytes a bf16-mixed AdamW training step peaks near: (state, activations, logits, tables). State: fp32 weights,
    their gradients and AdamW's two moments, 16 bytes a parameter. Activations: 34 bytes per token, width and layer
    (what autograd keeps of a transformer layer with 16-bit activations and a fused attention kernel, no T x T term;
    Korthikanti et al. 2022). Logits: their bf16 values and fp32 log-softmax, kept for the backward, 6 bytes per token
    and vocabulary entry. Tables: the encoding's own position tables (:func:`table_bytes`)."""
    c, tokens = model.config, rows * length
    state = 16 * sum(p.numel() for p in model.parameters())
    return state, 34 * tokens * c.n_embd * c.n_layer, 6 * tokens * c.vocab_size, table_bytes(c, length)


def table_bytes(config, length: int) -> int:
    """Bytes an encoding's own position tables hold through a training step on CUDA: in each layer whose bias is a
    function of positions alone on the flex path, the (heads, length, length) fp32 table FlexAttention's score_mod
    reads (``models.flex.flex_score_mod``), kept for the backward, and what autograd keeps to differentiate it (eager:
    FIRE keeps its MLP's hidden units over the whole table; a compiled block may keep less). Each layer's encoding
    module (the registry's) is asked: which bias it adds (at 2 tokens on the CPU), then its tables on the meta
    device, where nothing is allocated."""
    from ..models.attention import resolve_backend
    from ..models.flex import FLEX_TABLE_ELEMENTS
    from ..positional.base import PositionalBias
    from ..positional.registry import build_positional

    heads, probe = config.n_head, build_positional(config)
    with torch.device("meta"):
        pe, h = build_positional(config), torch.empty(1, length, config.n_embd)
    tables, saved = {}, {}
    with torch.no_grad():
        kinds = [probe.score_bias(torch.zeros(1, 2, config.n_embd), layer, 0, None) for layer in range(config.n_layer)]
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.setdefault(id(t), t), lambda t: t):
        for layer, kind in enumerate(kinds):
            if (isinstance(kind, PositionalBias) and heads * length**2 <= FLEX_TABLE_ELEMENTS
                    and resolve_backend(config.attention_backend, kind, torch.device("cuda"),
                                        head_dim=config.head_dim) == "flex"):
                table = pe.score_bias(h, layer, 0, None).position_table(heads, length, "meta")
                tables[id(table)] = table
    kept = {**saved, **tables}.values()  # not the parameters: the state counts them
    return sum(t.numel() * t.element_size() for t in kept if not (t.is_leaf and t.requires_grad))
