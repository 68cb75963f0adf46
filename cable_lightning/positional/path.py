"""PaTH attention (Yang et al., 2025, "PaTH Attention: Position Encoding via Accumulating Householder
Transformations"), and PaTH-FoX, PaTH with FoX's forget gate.

Each token s gives, per head, a Householder-like transform H_s = I - beta_s w_s w_s^T, w_s a unit vector and
beta_s = 2 sigmoid(.) in (0, 2) (negative eigenvalues allowed). A key is carried to its query through the transforms
of the tokens after it, up to the query's own:
    logit[i, j] = q_i^T H_i H_{i-1} ... H_{j+1} k_j / sqrt(d)          (j <= i; j = i: q_i . k_j)
which is what the authors' decoding does (each new token multiplies every cached key by its H). w comes from a
low-rank projection of the layer's input, a short causal depthwise convolution (restarting at each document of a
layout), SiLU and an L2 norm; beta from a linear map with an offset (flash-linear-attention, fla/layers/path_attn.py).
Weights N(0, 0.02) and offsets 0, as there: beta starts near 1, where H is a projection.

Bidirectional (masked LM), the earlier vector is carried forward to the later's position through the same tokens:
for j > i, logit[i, j] = k_j^T H_j ... H_{i+1} q_i / sqrt(d), the causal formula with queries and keys exchanged.
Under a layout the tokens between a query and a key of its own document are all of that document, so the product
needs no restart; only the convolution does. Positions are never read (the order of the tokens is the position).

PaTH-FoX adds FoX's bias, sum_{j < u <= i} log f_u (fox.py's module, unscaled; fla scales it by 1/sqrt(d) with the
logits, so its kernel gets the log gates times sqrt(d)).

The logits are neither q.k plus a bias nor a function of q.k, so the scores are :class:`LogitScores` computing their
own logits (:meth:`PathScores.logits`): the materialized reference carries every key token by token; the chunked path
uses the compact form of blocks of transforms (:func:`chunked_logits`). On CUDA with flash-linear-attention installed
(the ``path`` extra), ``auto`` runs its Triton kernel where it applies (training, no documents or padding).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..errors import ConfigError
from .base import Encoding, LogitScores, PositionalEncoding
from .cable import CableBias, CumulativeBias
from .fox import Fox

# Tokens per block of the chunked path's compact (UT) form: a block costs C^2 D per block pair of the walk.
CHUNK = 64
# Head sizes and devices fla's kernel takes.
FLA_HEAD_DIMS = (16, 32, 64, 128)
FLA_DEVICES = ("cuda",)


def fla_kernel():
    """flash-linear-attention's PaTH kernel, or None where it is not installed (it is an optional extra)."""
    try:
        from fla.ops.path_attn.parallel import parallel_path_attn
    except ImportError:
        return None
    return parallel_path_attn


def carried_logits(q: Tensor, k: Tensor, w: Tensor, beta: Tensor, q_start: int) -> Tensor:
    """The obvious form (the reference): q (B, H, R, D) at positions q_start.., k (B, H, Tk, D) at 0..Tk-1, w and beta
    for those tokens. Every key is carried through each later token's transform in turn, and each query reads the keys
    as carried to it: (B, H, R, Tk), zero where j > i. O(T^2 D) work, O(T^2 D) memory for the backward."""
    rows = []
    carried = k[..., :0, :]
    for t in range(q_start + q.shape[-2]):
        w_t, beta_t = w[..., t : t + 1, :], beta[..., t : t + 1, None]
        carried = carried - beta_t * (carried * w_t).sum(-1, keepdim=True) * w_t
        carried = torch.cat([carried, k[..., t : t + 1, :]], dim=-2) if t < k.shape[-2] else carried
        if t >= q_start:
            row = q[..., t - q_start : t - q_start + 1, :] @ carried.transpose(-1, -2)
            rows.append(F.pad(row, (0, k.shape[-2] - row.shape[-1])))
    return torch.cat(rows, dim=-2)


def block_form(w: Tensor, beta: Tensor) -> tuple[Tensor, Tensor]:
    """(T, Z) of blocks of transforms, w (..., C, D), beta (..., C): with T = (I + strictly lower(beta_t w_t . w_s))^-1
    and Z = T (beta w), H_b ... H_a = I - sum_{a <= s <= b} w_s z_s^T where z is that of T's [a, b] block; for a block
    starting at a, T's leading block, so z_s = Z[s]. (T is lower triangular: the block of its inverse is the inverse of
    its block.)"""
    scaled = w * beta[..., None]
    c = w.shape[-2]
    eye = torch.eye(c, dtype=w.dtype, device=w.device)
    gram = (scaled @ w.transpose(-1, -2)).tril(-1)
    t = torch.linalg.solve_triangular(eye + gram, eye.expand_as(gram), upper=False, unitriangular=True)
    return t, t @ scaled


def chunked_logits(q: Tensor, k: Tensor, w: Tensor, beta: Tensor, q_start: int, k_start: int = 0,
                   chunk: int | None = None) -> Tensor:
    """The causal logits (unscaled) of queries q (B, H, R, D) at positions q_start.. against keys k (B, H, S, D) at
    k_start.. (k_start <= q_start, k_start + S <= q_start + R), w (B, H, >= q_start + R, D) and beta for every token:
    (B, H, R, S), exact where j <= i (anything elsewhere).

    Blocks of ``chunk`` tokens (aligned at 0) in compact form (:func:`block_form`). Inside a block, with
    QW = q.w masked to s <= i and M = T (beta w . k masked to s > j): logit = q.k - QW M. A key is carried to its
    block's end (k - M^T w) and a query back to its block's start (q - QW Z); a query block then meets each earlier
    key block after crossing the blocks between, each crossing a rank-C update q - (q.w) Z (or, walking the keys
    forward, k - (k.z) w: whichever side has fewer blocks walks). Work O(R S D) (plus O(T C D) for the blocks), memory
    O(R S) for the logits and O(R S D / C) kept for the backward."""
    chunk = chunk or CHUNK
    b, h, r, d = q.shape
    lo, hi = k_start // chunk, -(-(q_start + r) // chunk)
    span = slice(lo * chunk, min(hi * chunk, w.shape[-2]))
    pad = hi * chunk - span.stop
    w_blocks = F.pad(w[..., span, :], (0, 0, 0, pad)).view(b, h, hi - lo, chunk, d)
    beta_blocks = F.pad(beta[..., span], (0, pad)).view(b, h, hi - lo, chunk)  # beta 0: no transform
    t, z = block_form(w_blocks, beta_blocks)
    q0, q1 = q_start // chunk - lo, (q_start + r - 1) // chunk - lo  # query and key blocks, relative to lo
    k1 = (k_start + k.shape[-2] - 1) // chunk - lo
    nq, nk = q1 - q0 + 1, k1 + 1
    qb = F.pad(q, (0, 0, q_start - (lo + q0) * chunk, (lo + q1 + 1) * chunk - q_start - r)).view(b, h, nq, chunk, d)
    kb = F.pad(k, (0, 0, k_start - lo * chunk, (lo + nk) * chunk - k_start - k.shape[-2])).view(b, h, nk, chunk, d)
    wq, wk = w_blocks[:, :, q0 : q1 + 1], w_blocks[:, :, :nk]
    qw = (qb @ wq.transpose(-1, -2)).tril()  # [i, s]: q_i . w_s, s <= i
    m = t[:, :, :nk] @ ((wk * beta_blocks[:, :, :nk, :, None]) @ kb.transpose(-1, -2)).tril(-1)  # [s, j], s > j
    queries = qb - qw @ z[:, :, q0 : q1 + 1]  # carried back to their block's start
    keys = kb - m.transpose(-1, -2) @ wk  # carried to their block's end
    out = q.new_zeros(b, h, nq, nk, chunk, chunk)
    same = min(nq, nk - q0)  # blocks holding both queries and keys: q0 .. q0 + same - 1
    if same > 0:
        n = slice(q0, q0 + same)
        inner = (qb[:, :, :same] @ kb[:, :, n].transpose(-1, -2)).tril() - qw[:, :, :same] @ m[:, :, n]
        out.diagonal(q0, 2, 3).copy_(inner.movedim(2, -1))
    walk_queries = nq <= nk
    base = 0  # walking queries: `queries` holds query blocks base..; walking keys: `keys` holds key blocks 0..
    for step in range(1, q1 + 1):
        first = max(0, step - q0)  # query blocks q0 + i with a block `step` earlier: i >= first
        last = min(nq - 1, k1 + step - q0)  # ... that holds keys
        if walk_queries and first > base:
            queries, base = queries[:, :, first - base :], first
        if first <= last:  # query blocks q0 + first..last meet the key blocks `step` earlier
            met = slice(q0 + first - step, q0 + last + 1 - step)
            if walk_queries:
                pair = queries[:, :, : last + 1 - base] @ keys[:, :, met].transpose(-1, -2)
            else:
                pair = queries[:, :, first : last + 1] @ keys[:, :, met].transpose(-1, -2)
            out.diagonal(q0 - step, 2, 3).copy_(pair.movedim(2, -1))
        if walk_queries:  # query block q0 + i crosses the key block it just met, q0 + i - step
            across = slice(q0 + base - step, q0 + nq - step)
            queries = queries - (queries @ w_blocks[:, :, across].transpose(-1, -2)) @ z[:, :, across]
        else:  # key block j crosses block j + step, to meet the query block after it; those past q1 are done
            top = min(keys.shape[2], q0 + nq - 1 - step)
            if top <= 0:
                break
            across = slice(step, step + top)
            keys = keys[:, :, :top] - (keys[:, :, :top] @ z[:, :, across].transpose(-1, -2)) @ w_blocks[:, :, across]
    rows = out.permute(0, 1, 2, 4, 3, 5).reshape(b, h, nq * chunk, nk * chunk)
    top = q_start - (lo + q0) * chunk
    left = k_start - lo * chunk
    return rows[:, :, top : top + r, left : left + k.shape[-2]]


class PathScores(LogitScores):
    """PaTH's logits from the queries, the keys and every token's w (B, H, T, D) and beta (B, H, T), plus FoX's bias
    (``forget``: a :class:`~.cable.CableBias`, and its per-token log gates ``log_gates`` for fla) in PaTH-FoX."""

    maps_per_head = 4  # the block grid of logits, its rows, the bias or the scores, the weights

    def __init__(self, w: Tensor, beta: Tensor, forget, log_gates: Tensor | None, q_offset: int, causal: bool,
                 layout=None):
        super().__init__(q_offset, causal, layout)
        self.w, self.beta, self.forget, self.log_gates = w, beta, forget, log_gates

    def logits(self, q, k, start, stop, reference=False):
        wide = torch.promote_types(q.dtype, torch.float32)
        q, k = q.to(wide) * q.shape[-1] ** -0.5, k.to(wide)
        w, beta = self.w.to(wide), self.beta.to(wide)
        first, n_keys = self.q_offset + start, k.shape[-2]
        seen = k[..., : first + q.shape[-2], :]  # the keys up to the last row's position
        causal = (carried_logits if reference else chunked_logits)(q, seen, w, beta, first)
        if self.causal:
            return causal
        causal = F.pad(causal, (0, n_keys - seen.shape[-2]))
        # j > i: the causal logits of the keys as queries against these rows' queries as keys, transposed
        if reference:  # rows as the keys at their positions (zero elsewhere: columns left out)
            as_keys = F.pad(q, (0, 0, first, n_keys - first - q.shape[-2]))
            later = carried_logits(k, as_keys, w, beta, 0)[..., first : first + q.shape[-2]]
        else:
            later = F.pad(chunked_logits(k[..., first:, :], q, w, beta, first, first), (0, 0, first, 0))
        keys = torch.arange(n_keys, device=q.device)
        own = torch.arange(first, first + q.shape[-2], device=q.device)[:, None]
        return torch.where(keys > own, later.transpose(-1, -2), causal)

    def scores(self, logits, q, start, stop, key_padding=None):
        if self.forget is None:
            return logits
        batch, heads, _, n_keys = logits.shape
        return logits + self.forget.rows(start, stop, n_keys, batch, heads, logits.device).to(logits.dtype)

    def kernel(self, q, k, v, q_offset, key_padding, window, documents):
        """fla's kernel where it runs: a causal forward from position 0 (training, evaluation), no padding, window
        or documents, on its devices and head sizes."""
        if not (q.device.type in FLA_DEVICES and self.causal and q_offset == 0 and q.shape[-2] == k.shape[-2]
                and key_padding is None and window is None and documents is None and q.shape[-1] in FLA_HEAD_DIMS):
            return None
        parallel_path_attn = fla_kernel()
        if parallel_path_attn is None:
            return None
        scale = q.shape[-1] ** -0.5
        gates = None if self.log_gates is None else (self.log_gates / scale).float().transpose(1, 2).contiguous()
        heads_last = [x.transpose(1, 2).contiguous() for x in (q, k, v)]
        out, _ = parallel_path_attn(*heads_last, w=self.w.float().transpose(1, 2).contiguous(),
                                    beta=self.beta.float().transpose(1, 2).contiguous(), g=gates, scale=scale)
        return out.transpose(1, 2).to(q.dtype)


class PathModule(PositionalEncoding):
    """Per layer: the low-rank projection of w (down, up), its depthwise convolution taps (layer, channels, taps),
    the projection of beta; and, for PaTH-FoX, FoX's module for the forget gate."""

    def __init__(self, settings, config):
        super().__init__(settings, config)
        width, layers = config.n_head * self.head_dim, config.n_layer
        self.w_down = nn.ModuleList(nn.Linear(config.n_embd, settings.rank, bias=False) for _ in range(layers))
        self.w_up = nn.ModuleList(nn.Linear(settings.rank, width, bias=False) for _ in range(layers))
        self.w_conv = nn.Parameter(torch.randn(layers, width, settings.conv_size) * 0.02)
        self.beta_proj = nn.ModuleList(nn.Linear(config.n_embd, config.n_head) for _ in range(layers))
        for linear in [*self.w_down, *self.w_up, *self.beta_proj]:
            nn.init.normal_(linear.weight, std=0.02)
            if linear.bias is not None:
                nn.init.zeros_(linear.bias)
        self.forget = CumulativeBias(Fox(), config) if settings.forget_gate else None

    per_layer = ("w_down", "w_up", "w_conv", "beta_proj")

    reads_positions = False  # the order of the tokens; a query's product spans its own document's tokens only

    def layer_view(self, layer):
        view = super().layer_view(layer)
        if self.forget is not None:
            view._modules["forget"] = self.forget.layer_view(layer)
        return view

    def directions(self, h: Tensor, layer: int, offset: int, state: dict | None, layout=None):
        """(w, beta) of these tokens, (B, H, T, D) and (B, H, T), in fp32 or wider; with a cache, those of every
        token so far (the convolution continues from the cache's last inputs)."""
        dtype = torch.promote_types(self.w_conv.dtype, torch.float32)
        b, t, _ = h.shape
        taps = self.w_conv.shape[-1]
        with torch.autocast(device_type=h.device.type, enabled=False):
            x = h.to(dtype)
            low = F.linear(F.linear(x, self.w_down[layer].weight.to(dtype)), self.w_up[layer].weight.to(dtype))
            before = state["path_inputs"] if offset else low.new_zeros(b, taps - 1, low.shape[-1])
            inputs = torch.cat([before, low], dim=1)  # (B, taps - 1 + T, channels)
            conv = self.w_conv[layer].to(dtype)
            mixed = 0
            for tap in range(taps):
                lag = taps - 1 - tap
                shifted = inputs[:, tap : tap + t]
                if layout is not None and layout.documents is not None and lag:  # no tap across a document's start
                    same = F.pad(layout.documents[:, lag:] == layout.documents[:, :-lag], (lag, 0))
                    shifted = shifted * same[..., None].to(dtype)
                mixed = mixed + shifted * conv[:, tap]
            w = F.normalize(F.silu(mixed).view(b, t, self.n_head, self.head_dim).transpose(1, 2), dim=-1)
            bp = self.beta_proj[layer]
            beta = 2 * torch.sigmoid(F.linear(x, bp.weight.to(dtype), bp.bias.to(dtype))).transpose(1, 2)
            if state is not None:
                if offset:
                    w, beta = torch.cat([state["path_w"], w], dim=2), torch.cat([state["path_beta"], beta], dim=2)
                state["path_inputs"] = inputs[:, inputs.shape[1] - taps + 1 :]
                state["path_w"], state["path_beta"] = w, beta
        return w, beta

    def score_bias(self, h, layer, offset, state, layout=None):
        w, beta = self.directions(h, layer, offset, state, layout)
        forget, log_gates = None, None
        if self.forget is not None:  # FoX's bias, as its module builds it, and the log gates fla's kernel takes
            increment = self.forget.per_token(h, layer)["increment"]
            s_q, s_k = self.forget.sums(increment, offset, state, layout)
            forget, log_gates = CableBias(s_q, s_k, None, offset, self.causal, layout=layout), -increment
        return PathScores(w, beta, forget, log_gates, offset, self.causal, layout)

    def token_increments(self, h, layer, layout=None):
        return {} if self.forget is None else self.forget.token_increments(h, layer, layout)


@dataclass
class Path(Encoding):
    """PaTH: keys carried to each query through the data-dependent Householder transforms of the tokens between;
    w from a rank-``rank`` projection and a ``conv_size``-tap causal convolution, as the authors' layer."""

    rank: int = 32
    conv_size: int = 3

    name = "path"
    module = PathModule
    scores = "logits"
    forget_gate = False

    def __post_init__(self):
        super().__post_init__()
        if self.rank < 1 or self.conv_size < 1:
            raise ConfigError(f"{self.name}.rank and .conv_size must be >= 1, got {self.rank} and {self.conv_size}")


@dataclass
class PathFox(Path):
    """PaTH-FoX: PaTH's logits plus FoX's forget-gate bias sum_{j < u <= i} log f_u."""

    name = "path_fox"
    forget_gate = True
