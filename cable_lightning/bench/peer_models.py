"""Peers for the bench: transformers' own models at a backbone's shape, built from a config alone (random weights,
nothing downloaded), each set beside the project's encoding it matches (``bench --peers``, docs/speed.md).

- ``gpt2``: ``GPT2LMHeadModel`` (learned positions, SDPA attention) against ``learnable``: the same layers, width,
  heads, MLP, vocabulary, tied embeddings and position table, so the same parameter count.
- ``neox``: ``GPTNeoXForCausalLM`` (RoPE on every dimension of each head, SDPA) against ``rope``, set to the backbone's
  layout: sequential residual (not NeoX's parallel one), tanh GELU, tied embeddings; the same parameter count.
- ``llama``: ``LlamaForCausalLM`` (RoPE, SDPA) against ``rope``: Llama's own block, which differs from the backbone's
  and cannot match its parameter count: RMSNorm, a SwiGLU MLP of 8/3 x width (three matrices), no biases.
- ``cable_paper``: CABLE as its authors' released code computes it (axiomlab/Cable, ``src/Cable.py``) against
  ``cable_nw``, the form that code trains: per layer one linear map from the attention's input to a bias logit per
  head and token, b = cumsum(-activation(logit)), the whole (B, H, T, T) bias b_i - b_j plus a causal mask of -inf
  added to q.k^T by ``baddbmm``, softmax, times v. Written here from that formula, GPT-2 blocks around it, the same
  parameter count (the released map's per-head offset is left out, as ``cable_nw`` has none). Two differences from
  the released file, both so that the two compute one function: the increment's activation is the configured one
  (the release uses softplus, the project's default is ReLU; the same cost), and q.k^T is scaled by 1/sqrt(head
  size), where the release divides q and k by sqrt(C / n_embd) = 1.

Every peer runs without dropout and without a KV cache (a training step, as the project's).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..models import BackboneConfig


def _gpt2(config: BackboneConfig) -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    return GPT2LMHeadModel(GPT2Config(
        vocab_size=config.padded_vocab_size, n_positions=config.pos_encoding.longest_length(config.block_size),
        n_embd=config.n_embd, n_layer=config.n_layer, n_head=config.n_head,
        n_inner=int(config.mlp_ratio * config.n_embd), activation_function="gelu_pytorch_tanh",
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, tie_word_embeddings=True, use_cache=False,
        bos_token_id=None, eos_token_id=None, attn_implementation="sdpa"))


def _rope_parameters(config: BackboneConfig) -> dict:
    return {"rope_type": "default", "rope_theta": config.pos_encoding.base, "partial_rotary_factor": 1.0}


def _neox(config: BackboneConfig) -> nn.Module:
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    return GPTNeoXForCausalLM(GPTNeoXConfig(
        vocab_size=config.padded_vocab_size, hidden_size=config.n_embd, num_hidden_layers=config.n_layer,
        num_attention_heads=config.n_head, intermediate_size=int(config.mlp_ratio * config.n_embd),
        hidden_act="gelu_pytorch_tanh", max_position_embeddings=config.block_size, use_parallel_residual=False,
        rope_parameters=_rope_parameters(config), tie_word_embeddings=True, use_cache=False,
        bos_token_id=None, eos_token_id=None, attn_implementation="sdpa"))


def _llama(config: BackboneConfig) -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(LlamaConfig(
        vocab_size=config.padded_vocab_size, hidden_size=config.n_embd, num_hidden_layers=config.n_layer,
        num_attention_heads=config.n_head, intermediate_size=round(2 / 3 * config.mlp_ratio * config.n_embd),
        max_position_embeddings=config.block_size, rope_parameters=_rope_parameters(config),
        tie_word_embeddings=True, use_cache=False, bos_token_id=None, eos_token_id=None, attn_implementation="sdpa"))


class _PaperCableAttention(nn.Module):
    def __init__(self, n_embd: int, n_head: int, activation: Callable):
        super().__init__()
        self.qkv, self.out = nn.Linear(n_embd, 3 * n_embd), nn.Linear(n_embd, n_embd)
        self.bias_logit = nn.Linear(n_embd, n_head, bias=False)
        self.n_head, self.activation = n_head, activation

    def forward(self, x: Tensor) -> Tensor:
        b, t, c = x.shape
        q, k, v = (part.view(b, t, self.n_head, c // self.n_head).transpose(1, 2)
                   for part in self.qkv(x).split(c, dim=2))
        sums = torch.cumsum(-self.activation(self.bias_logit(x)), dim=1).permute(0, 2, 1)  # (B, H, T)
        causal = torch.triu(torch.full((t, t), float("-inf"), dtype=x.dtype, device=x.device), diagonal=1)
        bias = (sums.unsqueeze(3) - sums.unsqueeze(2) + causal).reshape(b * self.n_head, t, t)
        scores = torch.baddbmm(bias, q.reshape(b * self.n_head, t, -1) / math.sqrt(c // self.n_head),
                               k.reshape(b * self.n_head, t, -1).transpose(1, 2))
        y = F.softmax(scores.view(b, self.n_head, t, t), dim=-1) @ v
        return self.out(y.transpose(1, 2).reshape(b, t, c))


class _PaperCableBlock(nn.Module):
    def __init__(self, config: BackboneConfig, activation: Callable):
        super().__init__()
        width = config.n_embd
        self.ln_attn, self.ln_mlp = nn.LayerNorm(width), nn.LayerNorm(width)
        self.attn = _PaperCableAttention(width, config.n_head, activation)
        self.mlp = nn.Sequential(nn.Linear(width, int(config.mlp_ratio * width)), nn.GELU(approximate="tanh"),
                                 nn.Linear(int(config.mlp_ratio * width), width))

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.ln_attn(x))
        return x + self.mlp(self.ln_mlp(x))


class PaperCable(nn.Module):
    """The ``cable_paper`` peer: a causal LM whose only position signal is the released code's CABLE attention."""

    def __init__(self, config: BackboneConfig):
        super().__init__()
        activation = config.pos_encoding.token_bias()
        self.wte = nn.Embedding(config.padded_vocab_size, config.n_embd)
        self.blocks = nn.ModuleList(_PaperCableBlock(config, activation) for _ in range(config.n_layer))
        self.ln_f, self.vocab_size, self.config = nn.LayerNorm(config.n_embd), config.vocab_size, config

    def forward(self, input_ids: Tensor) -> SimpleNamespace:
        x = self.wte(input_ids)
        for block in self.blocks:
            x = block(x)
        return SimpleNamespace(logits=F.linear(self.ln_f(x), self.wte.weight[: self.vocab_size]))


def _cable_paper(config: BackboneConfig) -> nn.Module:
    if config.pos_encoding.name != "cable_nw":
        raise ValueError(f"the cable_paper peer computes cable_nw, not {config.pos_encoding.name}")
    return PaperCable(config)


@dataclass(frozen=True)
class Peer:
    against: str  # the project's encoding it is compared with
    build: Callable[[BackboneConfig], nn.Module]  # a backbone config of that encoding -> the peer, in training mode
    same_parameters: bool  # the peer has the backbone's parameter count
    evaluates_longer: bool = False  # it reads any length: its evaluation is timed at the bench's evaluation lengths


PEERS = {"gpt2": Peer("learnable", _gpt2, True), "neox": Peer("rope", _neox, True),
         "llama": Peer("rope", _llama, False),
         "cable_paper": Peer("cable_nw", _cable_paper, True, evaluates_longer=True)}
DEFAULT_PEERS = ("gpt2", "neox")


def build_peer(name: str, config: BackboneConfig) -> nn.Module:
    """The peer ``name`` (a key of :data:`PEERS`) at ``config``'s shape, random weights, in training mode."""
    return PEERS[name].build(config).train()
