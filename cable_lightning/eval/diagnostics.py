"""Why an encoding extrapolates or fails: its attention per layer and head at every length (docs/diagnostics.md defines
every quantity).

Per query row of a few fixed evaluation windows, from the weights attention actually applies (read through
``models.attention.attention_map``, the reference path every backend is tested against; no encoding is a special
case): entropy, the distance the weight reaches, the sink's and the local share, the largest logit, the mass. Rows are
computed one block at a time, so memory is O(rows x length), never O(length^2) per head (docs/diagnostics.md#cost).
Also the context-aware increments of encodings built on per-token quantities (docs/diagnostics.md#increments), and the
tokens that need the long context (LongPPL's key tokens, with the model itself as the reference: a target past the
training length whose loss with the whole window drops by at least ``threshold`` nats against the training length's).
"""

from __future__ import annotations

import contextlib
import itertools
import math
import time
from dataclasses import dataclass, field
from typing import Optional

import torch
from torch import Tensor

from ..data.windows import window_plan
from ..models.attention import attention_map
from ..records.schema import ContextGain

# Attention quantities per (layer, head), in the order records, tables and figures give them.
QUANTITIES = ("entropy", "entropy_norm", "distance_mean", "distance_p90", "sink_mass", "local_mass", "max_logit",
              "mass")
MAXIMA = ("max_logit",)  # reduced by the maximum over rows (the others: the mean)
# (row, key) maps one block of rows holds at once per head besides the score object's own (weights, scores,
# logits, w log w, the cumulative sum or the distance bins and their sum, the distance grid, a comparison): sizes the
# row blocks against block_elements(device).
MAPS = 8
BLOCK_ELEMENTS = 2**24
# On a GPU each block costs its ~60 operators' launches however small it is: 16x larger blocks there (about 1 GiB of
# fp32 maps at once, below what training the same model holds), so 16x fewer launches at long lengths.
GPU_BLOCKS = 16
P90 = 0.9
DEFAULT_SINK = 4  # StreamingLLM's attention-sink tokens
DEFAULT_THRESHOLD = 2.0  # LongPPL's: a key token's log-probability gains at least 2 nats from the long context


def row_quantities(weights: Tensor, scores: Tensor, logits: Tensor, start: int, q_offset: int, sink: int,
                   local: int, causal: bool) -> dict[str, Tensor]:
    """Each quantity of :data:`QUANTITIES` per query row, (B, H, rows), NaN where undefined (a row that applies no
    weight; ``entropy_norm`` of a row that sees fewer than two keys). ``weights``, ``scores`` (masked with -inf) and
    ``logits`` as :class:`models.attention.AttentionMap` gives them for query rows [start, start + rows) at positions
    q_offset + start + i against keys [0, n_keys). A causal row's keys all lie behind it, so its distances come from
    cumulative sums over the keys; a bidirectional row's weights are first binned by distance."""
    weights = weights.float()
    rows, n_keys = weights.shape[-2:]
    device = weights.device
    position = torch.arange(start, start + rows, device=device) + q_offset  # (rows,)
    total = weights.sum(-1)
    attends = total > 0
    inverse = 1.0 / total.clamp(min=torch.finfo(weights.dtype).tiny)
    # -sum p log p of p = w / total, as log(total) - sum(w log w) / total: no pass to normalise the map
    entropy = total.clamp(min=torch.finfo(weights.dtype).tiny).log() - torch.special.xlogy(weights, weights).sum(-1) \
        * inverse
    seen = (scores > float("-inf")).sum(-1).float()
    # summed elementwise: i - E[j] as a matmul would round to bf16 under autocast (steps of 8 at 2048), and even in
    # fp32 it cancels below zero where a row's weight sits on the query itself
    distance = position[:, None] - torch.arange(n_keys, device=device)[None, :]
    if not causal:
        distance = distance.abs()
    distance_mean = (weights * distance).sum(-1) * inverse
    if causal:
        before = weights.cumsum(-1)  # mass on keys 0..j
        # the farthest key j* whose keys j*..i still hold 90%: every j < j* has mass(0..j) <= 10%
        farthest = (before[..., :-1] <= (1 - P90) * total[..., None]).sum(-1)
        distance_p90 = position - farthest
        outside = position - local  # the last key outside the local window
        gathered = before.gather(-1, outside.clamp(min=0).expand(*before.shape[:-2], -1)[..., None]).squeeze(-1)
        local_mass = (total - torch.where(outside >= 0, gathered, 0.0)) * inverse
    else:
        by_distance = torch.zeros_like(weights).scatter_add_(-1, distance.expand_as(weights), weights)
        distance_p90 = (by_distance.cumsum(-1) < P90 * total[..., None]).sum(-1)
        local_mass = by_distance[..., :local].sum(-1) * inverse
    nan = torch.tensor(float("nan"), device=device)
    out = {
        "entropy": entropy,
        "entropy_norm": torch.where(seen >= 2, entropy / seen.clamp(min=2).log(), nan),
        "distance_mean": distance_mean,
        "distance_p90": distance_p90.float(),
        "sink_mass": weights[..., :sink].sum(-1) * inverse,
        "local_mass": local_mass,
    }
    out = {name: torch.where(attends, value, nan) for name, value in out.items()}
    out["max_logit"] = logits.float().amax(-1)
    out["mass"] = total
    return out


def block_elements(device: torch.device) -> int:
    """How many (row, key) elements a block of rows holds at once, over all its maps and heads."""
    return BLOCK_ELEMENTS * (GPU_BLOCKS if device.type == "cuda" else 1)


def reduce_rows(values: Tensor) -> Tensor:
    """(3, Q, H) from one layer's row quantities (Q, B, H, rows): per quantity and head the sum and the count of the
    rows that define it, and the maximum over rows (float64)."""
    values = values.double().transpose(1, 2).flatten(2)  # (Q, H, B * rows)
    defined = ~values.isnan()
    return torch.stack([torch.where(defined, values, 0.0).sum(-1), defined.sum(-1).double(), values.amax(-1)])


@dataclass
class AttentionStats:
    """Per layer, each quantity's sum and count over the rows of every window (the maximum for :data:`MAXIMA`) per
    head, kept where the model runs until :meth:`results` reads them all back at once (on a GPU, a read back waits
    for the device: one per length, not one per layer, head and quantity)."""

    sink: int = DEFAULT_SINK
    local: int = 16
    sums: dict = field(default_factory=dict)  # layer -> (3, Q, H): sums, counts, maxima (:func:`reduce_rows`)

    def add(self, layer: int, q: Tensor, k: Tensor, scores, causal: bool, window: Optional[int],
            key_padding: Optional[Tensor] = None, q_offset: int = 0, attn_sink: Optional[Tensor] = None) -> None:
        """One layer's rows: q (B, H, T, D) after the encoding's rotation, k (B, H, Tk, D), its score object and its
        learned sink (the weights a row puts on the keys then sum to less than 1: ``mass``); in
        blocks of rows, each against the keys it can see (causal: none past its last row), each block's quantities
        written into one (Q, B, H, T) tensor that is reduced once for the layer."""
        batch, heads, t, _ = q.shape
        n_all = k.shape[-2]
        maps = MAPS + getattr(scores, "maps_per_head", 1)
        rows_per_block = max(1, block_elements(q.device) // (batch * heads * maps * n_all))
        rows = None
        for start in range(0, t, rows_per_block):
            stop = min(t, start + rows_per_block)
            n_keys = min(n_all, q_offset + stop) if causal else n_all
            attn = attention_map(q[:, :, start:stop], k[:, :, :n_keys], scores, causal, q_offset, start, key_padding,
                                 window, sink=attn_sink)
            found = row_quantities(attn.weights, attn.scores, attn.logits, start, q_offset, self.sink, self.local,
                                   causal)
            block = torch.stack([found[name] for name in QUANTITIES])
            if rows is None:
                rows = block.new_empty(len(QUANTITIES), batch, heads, t)
            rows[..., start:stop] = block
        found = reduce_rows(rows)
        held = self.sums.get(layer)
        self.sums[layer] = found if held is None else \
            torch.stack([held[0] + found[0], held[1] + found[1], torch.maximum(held[2], found[2])])

    def results(self) -> list[dict]:
        """One dict per (layer, head): ``layer``, ``head`` and each quantity (None where no row defined it)."""
        layers = sorted(self.sums)
        held = torch.stack([self.sums[layer] for layer in layers]).tolist() if layers else []  # the one read back
        out = []
        for layer, (sums, counts, maxima) in zip(layers, held):
            for head in range(len(sums[0])):
                row = {"layer": layer, "head": head}
                for i, name in enumerate(QUANTITIES):
                    if name in MAXIMA:
                        value = maxima[i][head]
                    else:
                        value = sums[i][head] / counts[i][head] if counts[i][head] > 0 else None
                    row[name] = None if value is None or not math.isfinite(value) else round(value, 6)
                out.append(row)
        return out


@contextlib.contextmanager
def recording(backbone, stats: AttentionStats):
    """While inside, every attention layer of ``backbone`` adds its rows to ``stats`` as it runs (a hook before each
    layer's attention: the same queries, keys and score object the layer then uses). Without a gradient the blocks
    run eagerly (``Backbone._blocks``), so the hook runs, and each layer's attention through its own kernel: on CUDA a
    compiled FlexAttention, which never holds the score matrix (forcing everything eager once made it materialize
    B x H x L^2 scores at 16k)."""

    def hook(module, args):
        h, pe, offset, state, *rest = args
        key_padding = rest[0] if rest else None
        q, k, _ = module.queries_keys_values(h, pe, offset, key_padding)
        scores = pe.score_bias(h, module.layer, offset, None)
        stats.add(module.layer, q, k, scores, module.causal, pe.window(module.layer), key_padding, offset,
                  module.sink)

    handles = [block.attn.register_forward_pre_hook(hook) for block in backbone.blocks]
    try:
        with torch.no_grad():
            yield stats
    finally:
        for handle in handles:
            handle.remove()


def short_context_nll(backbone, inputs: Tensor, targets: Tensor, context: int, stride: int,
                      batch_size: Optional[int] = None) -> Tensor:
    """(B, T) each target's NLL when the model sees at most ``context`` tokens: windows of ``context`` tokens
    advancing by ``stride`` (the sliding protocol of :func:`data.windows.window_plan`), each scoring the targets after
    the previous one's, so every target is scored once with at least ``context - stride`` tokens before it (all of
    them in the first window). The windows of every row run ``batch_size`` at a time (None: all in one pass through
    the model, so a length costs one forward however many windows it has); the head runs only on the targets each
    window scores. Where each target comes from and goes is known on the host: nothing is read back."""
    rows, t = inputs.shape
    if t <= context:
        return backbone.token_nll(inputs, targets)
    plan = window_plan(t + 1, context, stride)
    pieces = [(row, start, first) for row, (start, first) in itertools.product(range(rows), plan)]
    out = torch.zeros(rows * t, dtype=torch.float32, device=inputs.device)
    for at in range(0, len(pieces), batch_size or len(pieces)):
        part = pieces[at : at + (batch_size or len(pieces))]
        window_inputs = torch.stack([inputs[row, start : start + context] for row, start, _ in part])
        window_targets = torch.stack([targets[row, start : start + context] for row, start, _ in part])
        source = torch.tensor([i * context + j for i, (_, _, first) in enumerate(part) for j in range(first, context)],
                              device=inputs.device)
        scored = backbone.hidden_states(window_inputs).flatten(0, 1)[source]
        nll = backbone.hidden_nll(scored[None], window_targets.flatten()[source][None])[0]
        out[[row * t + start + j for row, start, first in part for j in range(first, context)]] = nll.float()
    return out.view(rows, t)


def context_gain(long_nll: Tensor, short_nll: Tensor, scored: Tensor, context: int, threshold: float) -> ContextGain:
    """From each target's NLL with the whole window and with at most ``context`` tokens (B, T), ``scored`` (B, T) the
    targets that count: those at index >= ``context`` (which see more than ``context`` tokens in the window). Every
    count and sum is read back at once."""
    candidates = scored.clone()
    candidates[:, :context] = False
    drop = short_nll - long_nll
    where = torch.stack([candidates, candidates & (drop >= threshold), candidates & (-drop >= threshold)])
    figures = torch.stack([where.sum((1, 2)).double()] + [torch.where(where, nll.double(), 0.0).sum((1, 2))
                                                          for nll in (long_nll, short_nll)], dim=-1).tolist()
    out = {}
    # every target past the context, the key tokens, the hurt ones
    for kind, (count, long_sum, short_sum) in zip(("", "key_", "hurt_"), figures):
        out |= {f"{kind}tokens": int(count), f"{kind}loss": long_sum / count if count else None,
                f"{kind}loss_short": short_sum / count if count else None}
    return ContextGain(**out)


@dataclass
class LengthDiagnostics:
    """One length's diagnostics: per (layer, head) attention quantities, the long context's gain (None for a
    bidirectional model or a length within the training length) and the seconds they took."""

    attention: list[dict]
    gain: Optional[ContextGain]
    windows: int
    seconds: float


@torch.no_grad()
def diagnose(backbone, inputs: Tensor, targets: Tensor, train_length: int, sink: int = DEFAULT_SINK,
             local: Optional[int] = None, threshold: float = DEFAULT_THRESHOLD, short_stride: Optional[int] = None,
             batch_size: Optional[int] = None) -> LengthDiagnostics:
    """The diagnostics of windows ``inputs`` (B, L) with ``targets`` (B, L) (-100: not scored): one forward with the
    attention recorded (its per-token NLL is the long context's), and for a causal model longer than
    ``train_length`` the short-context pass (windows of ``train_length`` advancing by ``short_stride``, default a
    quarter of it). ``local`` defaults to an eighth of ``train_length``."""
    started = time.perf_counter()
    stats = AttentionStats(sink=sink, local=local or max(1, train_length // 8))
    with recording(backbone, stats):
        long_nll = backbone.token_nll(inputs, targets)
    gain = None
    if backbone.causal and inputs.shape[1] > train_length:
        stride = short_stride or max(1, train_length // 4)
        short = short_context_nll(backbone, inputs, targets, train_length, stride, batch_size)
        gain = context_gain(long_nll.float(), short, targets != -100, train_length, threshold)
    attention = stats.results()  # read back after everything else was queued: the time includes the device's
    return LengthDiagnostics(attention, gain, inputs.shape[0], time.perf_counter() - started)


INCREMENT_FIGURES = ("count", "zero_share", "mean", "p10", "p50", "p90")  # per (layer, quantity, tokens, head)
QUANTILES = (0.1, 0.5, 0.9)


def has_increments(backbone) -> bool:
    """Whether the backbone's encoding has per-token quantities (asked of the encoding itself, on one zero token)."""
    h = torch.zeros(1, 1, backbone.config.n_embd, device=backbone.wte.weight.device)
    return bool(backbone.pe.token_increments(h, 0))


def selected_figures(values: Tensor, where: Tensor) -> Tensor:
    """(6, H) of :data:`INCREMENT_FIGURES` over the tokens ``where`` (B, T) of ``values`` (B, H, T), on the device:
    masks and a sort, not a boolean index (whose size a GPU would have to read back)."""
    values = values.float().transpose(0, 1).flatten(1)  # (H, B*T)
    where = where.flatten()[None, :].expand_as(values)
    count = where.sum(-1).float()
    zero = ((values == 0) & where).sum(-1) / count
    mean = torch.where(where, values, 0.0).sum(-1) / count
    ordered = torch.where(where, values, float("inf")).sort(-1).values
    ranks = ((count[0] - 1).clamp(min=0) * torch.tensor(QUANTILES, device=values.device)).round().long()
    return torch.cat([torch.stack([count, zero, mean]), ordered[:, ranks].T])


def relative_difference(hidden: Tensor, first: Tensor, second: Tensor) -> Tensor:
    """(B,) ||h_a - h_b|| / max(||h_a||, ||h_b||) of each row's final hidden states at positions ``first`` and
    ``second`` (B,)."""
    rows = torch.arange(hidden.shape[0], device=hidden.device)
    a, b = hidden[rows, first].float(), hidden[rows, second].float()
    scale = torch.maximum(a.norm(dim=-1), b.norm(dim=-1)).clamp(min=torch.finfo(torch.float32).tiny)
    return (a - b).norm(dim=-1) / scale


@dataclass
class IncrementDiagnostics:
    """One length's increments: one dict per (layer, head, quantity, tokens) with :data:`INCREMENT_FIGURES` (sets
    with no token left out), and the pair's relative differences (``examples``, ``mean``, ``min``, ``max``; None
    without a pair)."""

    increments: list[dict]
    pair: Optional[dict]
    seconds: float


@torch.no_grad()
def increment_diagnostics(backbone, inputs: Tensor, tokens: dict[str, Tensor],
                          pair: Optional[tuple[Tensor, Tensor]] = None, layout=None) -> IncrementDiagnostics:
    """One forward of ``inputs`` (B, T) with every layer's per-token quantities (``token_increments`` of the
    layer's normalised input, taken by a hook before its attention) reduced over each set of ``tokens`` (name ->
    (B, T) bool), and the relative difference of the final hidden states at ``pair`` (first, second), positions
    (B,) per row; ``layout``: the inputs' positions (None: 0, 1, 2, ...). Everything is read back at once."""
    started = time.perf_counter()
    found: list[tuple[int, str, str, Tensor]] = []

    def hook(module, args):
        h, pe = args[0], args[1]
        for quantity, values in pe.token_increments(h, module.layer).items():
            found.extend((module.layer, quantity, name, selected_figures(values, where))
                         for name, where in tokens.items())

    handles = [block.attn.register_forward_pre_hook(hook) for block in backbone.blocks]
    try:
        hidden = backbone.hidden_states(inputs, layout=layout)
    finally:
        for handle in handles:
            handle.remove()
    parts = [figures.flatten() for *_, figures in found]
    if pair is not None:
        difference = relative_difference(hidden, *pair)
        parts.append(torch.stack([difference.mean(), difference.min(), difference.max()]))
    held = torch.cat(parts).double().tolist() if parts else []  # the one read back
    rows, at = [], 0
    for layer, quantity, name, figures in found:
        size = figures.numel()
        values = torch.tensor(held[at : at + size]).view(figures.shape).T.tolist()  # (H, 6)
        at += size
        for head, numbers in enumerate(values):
            if numbers[0] > 0:
                rows.append({"layer": layer, "head": head, "quantity": quantity, "tokens": name,
                             "count": int(numbers[0])} | {k: round(v, 6) for k, v in
                                                          zip(INCREMENT_FIGURES[1:], numbers[1:])})
    summary = None
    if pair is not None:
        summary = {"examples": inputs.shape[0]} | dict(zip(("mean", "min", "max"), (round(v, 6) for v in held[at:])))
    return IncrementDiagnostics(rows, summary, time.perf_counter() - started)
