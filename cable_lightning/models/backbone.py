"""GPT-2-shaped transformer (pre-LayerNorm, GELU MLP, tied embeddings) with a pluggable PE.

Causal for language modelling, bidirectional for masked LM. Long sequences are safe: attention
never builds a (T x T) bias outside the reference backend, and :meth:`Backbone.token_nll` runs the LM
head and the loss over chunks of positions, so (T x vocab) logits are never whole.

A :class:`Layout` (each token's position index and document; docs/training_distances.md) reaches every encoding hook
and attention: documents keep attention inside each document, and the encoding reads the positions.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from ..positional import build_positional
from ..positional.layout import Layout, with_layout
from .attention import attention
from .config import BackboneConfig
from .flex import compiled_block_mask

# Positions per LM-head chunk in token_nll (512 x 50304 fp32 logits = 100 MB).
LOSS_CHUNK = 512
# RMSNorm's epsilon for QK-norm (OLMo 2's and Qwen3's).
QK_NORM_EPS = 1e-6
# A padded batch runs in groups of rows whose padding is at most this share of their group's longest row.
PADDING_WASTE = 0.125


def length_groups(lengths: list[int], waste: float) -> list[list[int]]:
    """Row indices of a padded batch in groups, longest rows first: each group takes the longest row left and every
    row at least (1 - ``waste``) of its length (rows of no length are left out: they have nothing to run).

    Why this rule: on a CPU a call's time grows with its padded tokens (and attention's with their square), so a
    group pays for its padding, and a group of equal lengths runs with no mask at all; one call per distinct length
    (no padding) pays instead a call's fixed cost per length. Padding capped at 1/8 of a padded row costs at most 1/7
    more tokens than the row's own (1.3x its attention), and a batch of similar lengths (lm-eval's and
    sentence-transformers' encoding sort by length) still runs as one call. One group for the whole batch (``waste``
    1.0) made a batch of lengths mixed in 1-512 1.6-4.4x slower than one call per length on CPU (docs/speed.md)."""
    order = sorted((row for row, n in enumerate(lengths) if n > 0), key=lambda row: -lengths[row])
    groups: list[list[int]] = []
    for row in order:
        if groups and lengths[row] >= (1 - waste) * lengths[groups[-1][0]]:
            groups[-1].append(row)
        else:
            groups.append([row])
    return groups


HOOKS = ("embed", "rotate", "score_bias")


def check_takes_layout(pe) -> None:
    """Every hook the encoding overrides must take a layout; one that does not is a one-line error, before any work."""
    import inspect

    for hook in HOOKS:
        method = getattr(type(pe), hook)
        if "layout" not in inspect.signature(method).parameters:
            raise ValueError(f"encoding {pe.settings.label()}'s {type(pe).__name__}.{hook} takes no layout: it "
                             "cannot run document masking or explicit positions; give the hook a layout=None "
                             "parameter (docs/training_distances.md)")


class SelfAttention(nn.Module):
    """Multi-head attention with the backbone's switches, each independent of the encoding:

    - ``qk_norm`` (OLMo 2, Qwen3, Llama 4): RMSNorm over each head's q and k, with a learned scale per channel shared
      by the heads, before the encoding rotates them;
    - ``attn_sink`` (gpt-oss): a learned logit per head in every softmax's normaliser, a key with no value that
      any row may attend to instead of the keys;
    - ``attn_gate`` (Qiu et al. 2025, "Gated attention for large language models", its best variant): each head's
      output times an elementwise sigmoid gate computed from the layer's input, before the output projection."""

    def __init__(self, config: BackboneConfig, layer: int):
        super().__init__()
        self.layer, self.n_head, self.causal = layer, config.n_head, config.causal
        self.backend = config.attention_backend
        self.qkv = nn.Linear(config.n_embd, 3 * config.n_embd)
        self.out = nn.Linear(config.n_embd, config.n_embd)
        self.q_norm = nn.RMSNorm(config.head_dim, eps=QK_NORM_EPS) if config.qk_norm else None
        self.k_norm = nn.RMSNorm(config.head_dim, eps=QK_NORM_EPS) if config.qk_norm else None
        self.sink = nn.Parameter(torch.zeros(config.n_head)) if config.attn_sink else None
        self.gate = nn.Linear(config.n_embd, config.n_embd) if config.attn_gate else None

    def queries_keys_values(self, h: Tensor, pe, offset: int, key_padding: Tensor | None = None,
                            layout: Layout | None = None) -> tuple[Tensor, Tensor, Tensor]:
        """(B, H, T, D) each, after QK-norm and the PE's rotation."""
        b, t, c = h.shape
        q, k, v = (x.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for x in self.qkv(h).split(c, dim=-1))
        if self.q_norm is not None:  # in fp32 (under bf16 autocast, bf16 input beside fp32 weights has no fused kernel)
            q, k = self.q_norm(q.float()).to(q.dtype), self.k_norm(k.float()).to(k.dtype)
        q, k = pe.rotate(q, k, offset, pe.hook_layer(self.layer), key_padding, **with_layout(layout))
        return q, k, v

    def forward(self, h: Tensor, pe, offset: int, state: dict | None, key_padding: Tensor | None = None,
                layout: Layout | None = None, block_mask=None) -> Tensor:
        """``pe``: the encoding, or its :meth:`~PositionalEncoding.layer_view` for this layer; ``block_mask``: the
        FlexAttention mask, built by the caller (None: built by attention)."""
        b, t, c = h.shape
        q, k, v = self.queries_keys_values(h, pe, offset, key_padding, layout)
        if state is not None:
            if "k" in state:
                k, v = torch.cat([state["k"], k], dim=2), torch.cat([state["v"], v], dim=2)
            state["k"], state["v"] = k, v
        layer = pe.hook_layer(self.layer)
        scores = pe.score_bias(h, layer, offset, state, **with_layout(layout))
        y = attention(q, k, v, scores, self.causal, q_offset=offset, backend=self.backend, key_padding=key_padding,
                      window=pe.window(layer), layout=layout, block_mask=block_mask, sink=self.sink)
        y = y.transpose(1, 2).reshape(b, t, c)
        if self.gate is not None:
            y = y * torch.sigmoid(self.gate(h))
        return self.out(y)


class Block(nn.Module):
    def __init__(self, config: BackboneConfig, layer: int):
        super().__init__()
        hidden = int(config.mlp_ratio * config.n_embd)
        self.ln_attn = nn.LayerNorm(config.n_embd)
        self.attn = SelfAttention(config, layer)
        self.ln_mlp = nn.LayerNorm(config.n_embd)
        self.mlp = nn.Sequential(nn.Linear(config.n_embd, hidden), nn.GELU(approximate="tanh"),
                                 nn.Linear(hidden, config.n_embd))
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x, pe, offset, state, key_padding=None, layout=None, block_mask=None):
        x = x + self.dropout(self.attn(self.ln_attn(x), pe, offset, state, key_padding, layout, block_mask))
        return x + self.dropout(self.mlp(self.ln_mlp(x)))


class KVCache:
    """Per-layer keys/values plus whatever the PE keeps (CABLE: the cumulative sums S of past tokens)."""

    def __init__(self, n_layer: int):
        self.layers: list[dict] = [{} for _ in range(n_layer)]
        self.length = 0


class Backbone(nn.Module):
    def __init__(self, config: BackboneConfig):
        super().__init__()
        self.config = config
        self.wte = nn.Embedding(config.padded_vocab_size, config.n_embd)
        self.drop = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList(Block(config, i) for i in range(config.n_layer))
        self.ln_f = nn.LayerNorm(config.n_embd)
        self._init_gpt2()
        self.pe = build_positional(config)  # after the GPT-2 init: each encoding initialises its own
        # Recompute each block's activations in backward instead of storing them (memory for time).
        self.activation_checkpointing = False
        # A padded batch's groups: the most padding a row may get, as a share of its group's longest row
        # (length_groups; 1.0 runs every row in one group, padded to the batch's longest).
        self.padding_waste = PADDING_WASTE
        # The blocks compiled for training steps (compile_blocks), a plain list: the weights stay the blocks' own.
        self.compiled_blocks: list | None = None

    def compile_blocks(self) -> None:
        """Compile each block for the steps that need a gradient (training); evaluation runs the same blocks eagerly.

        Every layer's block runs one graph: what differs between layers reaches it as inputs made outside it, its
        encoding's weights through :meth:`PositionalEncoding.layer_view` and FlexAttention's block mask
        (:func:`compiled_block_mask`); a layer number read inside made each layer a graph of its own. A graph is
        compiled again for a new training shape (a length schedule: a second, dynamic one) and for each kind of layer
        a ``layers`` pattern has. Evaluation compiles nothing: at several lengths it added a compile per length and a
        12-layer fit hit Dynamo's recompile limit at its first validation (on an H200), falling back to eager; it is
        forward only, through the same fused kernels (SDPA, the fold; FlexAttention is compiled on CUDA either way).
        Idempotent."""
        if self.compiled_blocks is not None:
            return
        dynamo = torch._dynamo.config
        dynamo.recompile_limit = max(dynamo.recompile_limit, 2 * len(self.blocks))
        self.compiled_blocks = [torch.compile(block) for block in self.blocks]

    def _init_gpt2(self):
        """GPT-2 init: N(0, 0.02) weights, zero biases; residual projections scaled by (2 x layers)^-0.5."""
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, std=0.02)
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.zeros_(module.bias)
        residual_std = 0.02 / math.sqrt(2 * self.config.n_layer)
        for block in self.blocks:
            nn.init.normal_(block.attn.out.weight, std=residual_std)
            nn.init.normal_(block.mlp[2].weight, std=residual_std)

    @property
    def causal(self) -> bool:
        return self.config.causal

    def hidden_states(self, input_ids: Tensor, cache: KVCache | None = None, padding_mask: Tensor | None = None,
                      layout: Layout | None = None) -> Tensor:
        """Final-LayerNorm hidden states (B, T, C); with ``cache``, continue from its positions.

        ``padding_mask`` (B, T), 1 at real tokens, one run of them per row (left or right padding): the batch
        runs in one call and each row's real tokens get what running them alone would give (padding: zeros).
        ``layout``: each token's position index and document (:class:`Layout`; None: 0..T-1, one document).
        """
        if layout is not None:
            return self._laid_out_hidden_states(input_ids, cache, padding_mask, layout)
        if padding_mask is not None and not bool(padding_mask.all()):
            if cache is not None:
                raise ValueError("a padded batch cannot use the KV cache (each row would sit at another position); "
                                 "decode one prompt at a time or prompts of equal length")
            return self._padded_hidden_states(input_ids, padding_mask.bool())
        offset = cache.length if cache is not None else 0
        self.pe.check_length(offset + input_ids.shape[1])
        x = self._blocks(self.drop(self.pe.embed(self.wte(input_ids), offset)), offset, cache)
        if cache is not None:
            cache.length += input_ids.shape[1]
        return self.ln_f(x)

    def _laid_out_hidden_states(self, input_ids: Tensor, cache: KVCache | None, padding_mask: Tensor | None,
                                layout: Layout) -> Tensor:
        if cache is not None or padding_mask is not None:
            raise ValueError("a layout (positions or documents) is for a whole batch in one call; it cannot be "
                             "combined with a KV cache or a padding_mask")
        if tuple(layout.positions.shape) != tuple(input_ids.shape):
            raise ValueError(f"the layout is for a batch of shape {tuple(layout.positions.shape)}, the input ids have "
                             f"{tuple(input_ids.shape)}")
        check_takes_layout(self.pe)
        self.pe.check_layout(layout)
        x = self._blocks(self.drop(self.pe.embed(self.wte(input_ids), 0, **with_layout(layout))), 0, None,
                         layout=layout)
        return self.ln_f(x)

    def _blocks(self, x: Tensor, offset: int, cache: KVCache | None, key_padding: Tensor | None = None,
                layout: Layout | None = None) -> Tensor:
        training = torch.is_grad_enabled()
        compiled = self.compiled_blocks is not None and training
        for i, block in enumerate(self.compiled_blocks if compiled else self.blocks):
            state = cache.layers[i] if cache is not None else None
            pe, block_mask = self.pe, None
            if compiled:  # what differs between layers reaches the one block graph as inputs, made outside it
                pe = self.pe.layer_view(i)
                block_mask = compiled_block_mask(self.config.attention_backend, x.shape[1], self.causal,
                                                 self.pe.window(i), layout, key_padding, x.device)
            if self.activation_checkpointing and training:
                x = checkpoint(block, x, pe, offset, state, key_padding, layout, block_mask, use_reentrant=False)
            else:
                x = block(x, pe, offset, state, key_padding, layout, block_mask)
        return x

    def _padded_hidden_states(self, input_ids: Tensor, real: Tensor) -> Tensor:
        """Each row's real tokens moved to its front, so positions count from its first real token (as in a run
        of that row alone, for absolute and relative encodings alike). Causal attention then never sees the
        padding, which lies in every real token's future; bidirectional attention gets a key padding mask.

        Rows run in groups of similar length (:func:`length_groups`), each padded only to its own longest row, so a
        batch of mixed lengths does not pay for its longest row in every row."""
        t = input_ids.shape[1]
        lengths = real.sum(dim=1)
        starts = real.int().argmax(dim=1)
        ends = t - real.flip(1).int().argmax(dim=1)
        if bool(((ends - starts != lengths) & (lengths > 0)).any()):
            raise ValueError("padding_mask rows must be one run of ones (left or right padding)")
        self.pe.check_length(int(lengths.max()))
        positions = torch.arange(t, device=input_ids.device)
        order, pieces = [], []
        for rows in length_groups(lengths.tolist(), self.padding_waste):
            order += rows
            rows = torch.tensor(rows, device=input_ids.device)
            group_lengths, group_starts = lengths[rows], starts[rows]
            longest = int(group_lengths.max())
            to_front = (positions[:longest] + group_starts[:, None]) % t
            padded = bool((group_lengths < longest).any())
            key_padding = positions[:longest] < group_lengths[:, None] if padded and not self.causal else None
            x = self.drop(self.pe.embed(self.wte(input_ids[rows].gather(1, to_front)), 0))
            x = F.pad(self.ln_f(self._blocks(x, 0, None, key_padding)), (0, 0, 0, t - longest))
            back = (positions - group_starts[:, None]) % t
            pieces.append(x.gather(1, back[..., None].expand_as(x)))
        empty = [row for row, n in enumerate(lengths.tolist()) if n == 0]
        if empty:  # all padding: nothing to run, zeros out
            pieces.append((pieces[0] if pieces else self.wte.weight).new_zeros(len(empty), t, self.config.n_embd))
            order += empty
        x = torch.cat(pieces)[torch.tensor(order, device=input_ids.device).argsort()]
        return x.masked_fill(~real[..., None], 0.0)

    def logits(self, hidden: Tensor) -> Tensor:
        """The tied LM head, cut back to the real vocab (padding rows never win or leak mass)."""
        return F.linear(hidden, self.wte.weight[: self.config.vocab_size])

    def forward(self, input_ids: Tensor, cache: KVCache | None = None, layout: Layout | None = None) -> Tensor:
        return self.logits(self.hidden_states(input_ids, cache, layout=layout))

    def token_nll(self, input_ids: Tensor, targets: Tensor, chunk: int = LOSS_CHUNK,
                  layout: Layout | None = None) -> Tensor:
        """Per-token negative log-likelihood (B, T), 0 where ``targets == -100``.

        The head and softmax run ``chunk`` positions at a time; callers pick mean, sum or a
        scoring window (sliding-window evaluation) from the per-token values.
        """
        return self.hidden_nll(self.hidden_states(input_ids, layout=layout), targets, chunk)

    def hidden_nll(self, hidden: Tensor, targets: Tensor, chunk: int = LOSS_CHUNK) -> Tensor:
        """:meth:`token_nll` of final hidden states (B, T, C): for callers that score some positions only."""
        pieces = []
        for start in range(0, hidden.shape[1], chunk):
            logits = self.logits(hidden[:, start : start + chunk]).float()
            tgt = targets[:, start : start + chunk]
            nll = F.cross_entropy(logits.flatten(0, 1), tgt.flatten(), ignore_index=-100, reduction="none")
            pieces.append(nll.view_as(tgt))
        return torch.cat(pieces, dim=1)

    def training_flops_per_token(self, length: int) -> float:
        """Model FLOPs of a training step (forward + backward) per token at ``length``: 6 per parameter plus the
        attention matmuls, 12 x layers x width x length (PaLM's estimate; what MFU divides by the peak)."""
        c = self.config
        return 6 * sum(p.numel() for p in self.parameters()) + 12 * c.n_layer * c.n_embd * length

    def argmax_tokens(self, input_ids: Tensor, chunk: int = LOSS_CHUNK, layout: Layout | None = None) -> Tensor:
        """The most likely next token at every position (B, T); the head runs ``chunk`` positions at a time. One
        method, not hidden_states then logits, so that a sharded (FSDP2) backbone can gather its weights for it.
        ``layout``: the tokens' positions and documents (None: 0..T-1, one document)."""
        hidden = self.hidden_states(input_ids, layout=layout)
        return torch.cat([self.logits(hidden[:, s:s + chunk]).argmax(-1) for s in range(0, hidden.shape[1], chunk)],
                         dim=1)

    def loss(self, input_ids: Tensor, targets: Tensor, layout: Layout | None = None) -> Tensor:
        """Mean token NLL over targets != -100."""
        nll = self.token_nll(input_ids, targets, layout=layout)
        return nll.sum() / (targets != -100).sum().clamp(min=1)

    @torch.no_grad()
    def generate(self, prompt_ids: Tensor, max_new_tokens: int, temperature: float = 1.0, top_k: int | None = None,
                 generator: torch.Generator | None = None) -> Tensor:
        """Sample continuations with a KV cache: each new token costs O(t) (CABLE keeps S per past token)."""
        if not self.causal:
            raise ValueError("generate needs a causal backbone; this one is bidirectional (masked LM)")
        cache = KVCache(len(self.blocks))
        out = prompt_ids
        # The head on the last position only: a long prompt's (T x vocab) logits would not fit (16k x 50k fp32 = 3 GB).
        logits = self.logits(self.hidden_states(prompt_ids, cache)[:, -1])
        for _ in range(max_new_tokens):
            if temperature == 0:
                nxt = logits.argmax(dim=-1, keepdim=True)
            else:
                scaled = logits / temperature
                if top_k is not None:
                    kth = torch.topk(scaled, min(top_k, scaled.shape[-1])).values[:, -1:]
                    scaled = scaled.masked_fill(scaled < kth, float("-inf"))
                nxt = torch.multinomial(scaled.softmax(dim=-1), 1, generator=generator)
            out = torch.cat([out, nxt], dim=1)
            if _ < max_new_tokens - 1:
                logits = self(nxt, cache)[:, -1]
        return out


def build_backbone(config: BackboneConfig) -> Backbone:
    """A causal decoder (``config.causal``) or a bidirectional encoder; ``forward(ids)`` gives logits."""
    return Backbone(config)
