"""GPT-2-shaped transformer (pre-LayerNorm, GELU MLP, tied embeddings) with a pluggable PE.

Causal for language modelling, bidirectional for masked LM. Long sequences are safe: attention
never builds a (T x T) bias outside the reference backend, and :meth:`Backbone.token_nll` runs the LM
head and the loss over chunks of positions, so (T x vocab) logits are never whole.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from ..positional import build_positional
from .attention import attention
from .config import BackboneConfig

# Positions per LM-head chunk in token_nll (512 x 50304 fp32 logits = 100 MB).
LOSS_CHUNK = 512


class SelfAttention(nn.Module):
    def __init__(self, config: BackboneConfig, layer: int):
        super().__init__()
        self.layer, self.n_head, self.causal = layer, config.n_head, config.causal
        self.backend = config.attention_backend
        self.qkv = nn.Linear(config.n_embd, 3 * config.n_embd)
        self.out = nn.Linear(config.n_embd, config.n_embd)

    def queries_keys_values(self, h: Tensor, pe, offset: int, key_padding: Tensor | None = None,
                            ) -> tuple[Tensor, Tensor, Tensor]:
        """(B, H, T, D) each, after the PE's rotation."""
        b, t, c = h.shape
        q, k, v = (x.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for x in self.qkv(h).split(c, dim=-1))
        q, k = pe.rotate(q, k, offset, self.layer, key_padding)
        return q, k, v

    def forward(self, h: Tensor, pe, offset: int, state: dict | None, key_padding: Tensor | None = None) -> Tensor:
        b, t, c = h.shape
        q, k, v = self.queries_keys_values(h, pe, offset, key_padding)
        if state is not None:
            if "k" in state:
                k, v = torch.cat([state["k"], k], dim=2), torch.cat([state["v"], v], dim=2)
            state["k"], state["v"] = k, v
        scores = pe.score_bias(h, self.layer, offset, state)
        y = attention(q, k, v, scores, self.causal, q_offset=offset, backend=self.backend, key_padding=key_padding,
                      window=pe.window(self.layer))
        return self.out(y.transpose(1, 2).reshape(b, t, c))


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

    def forward(self, x, pe, offset, state, key_padding=None):
        x = x + self.dropout(self.attn(self.ln_attn(x), pe, offset, state, key_padding))
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
                      ) -> Tensor:
        """Final-LayerNorm hidden states (B, T, C); with ``cache``, continue from its positions.

        ``padding_mask`` (B, T), 1 at real tokens, one run of them per row (left or right padding): the batch
        runs in one call and each row's real tokens get what running them alone would give (padding: zeros).
        """
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

    def _blocks(self, x: Tensor, offset: int, cache: KVCache | None, key_padding: Tensor | None = None) -> Tensor:
        for i, block in enumerate(self.blocks):
            state = cache.layers[i] if cache is not None else None
            if self.activation_checkpointing and torch.is_grad_enabled():
                x = checkpoint(block, x, self.pe, offset, state, key_padding, use_reentrant=False)
            else:
                x = block(x, self.pe, offset, state, key_padding)
        return x

    def _padded_hidden_states(self, input_ids: Tensor, real: Tensor) -> Tensor:
        """Each row's real tokens moved to its front, so positions count from its first real token (as in a run
        of that row alone, for absolute and relative encodings alike). Causal attention then never sees the
        padding, which lies in every real token's future; bidirectional attention gets a key padding mask."""
        t = input_ids.shape[1]
        lengths = real.sum(dim=1)
        starts = real.int().argmax(dim=1)
        ends = t - real.flip(1).int().argmax(dim=1)
        if bool(((ends - starts != lengths) & (lengths > 0)).any()):
            raise ValueError("padding_mask rows must be one run of ones (left or right padding)")
        self.pe.check_length(int(lengths.max()))
        positions = torch.arange(t, device=input_ids.device)
        to_front = (positions + starts[:, None]) % t
        key_padding = None if self.causal else positions < lengths[:, None]
        x = self.drop(self.pe.embed(self.wte(input_ids.gather(1, to_front)), 0))
        x = self.ln_f(self._blocks(x, 0, None, key_padding))
        back = (positions - starts[:, None]) % t
        x = x.gather(1, back[..., None].expand_as(x))
        return x.masked_fill(~real[..., None], 0.0)

    def logits(self, hidden: Tensor) -> Tensor:
        """The tied LM head, cut back to the real vocab (padding rows never win or leak mass)."""
        return F.linear(hidden, self.wte.weight[: self.config.vocab_size])

    def forward(self, input_ids: Tensor, cache: KVCache | None = None) -> Tensor:
        return self.logits(self.hidden_states(input_ids, cache))

    def token_nll(self, input_ids: Tensor, targets: Tensor, chunk: int = LOSS_CHUNK) -> Tensor:
        """Per-token negative log-likelihood (B, T), 0 where ``targets == -100``.

        The head and softmax run ``chunk`` positions at a time; callers pick mean, sum or a
        scoring window (sliding-window evaluation) from the per-token values.
        """
        hidden = self.hidden_states(input_ids)
        pieces = []
        for start in range(0, hidden.shape[1], chunk):
            logits = self.logits(hidden[:, start : start + chunk]).float()
            tgt = targets[:, start : start + chunk]
            nll = F.cross_entropy(logits.flatten(0, 1), tgt.flatten(), ignore_index=-100, reduction="none")
            pieces.append(nll.view_as(tgt))
        return torch.cat(pieces, dim=1)

    def loss(self, input_ids: Tensor, targets: Tensor) -> Tensor:
        """Mean token NLL over targets != -100."""
        nll = self.token_nll(input_ids, targets)
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
