"""Peers for the bench: transformers' own models at a backbone's shape, built from a config alone (random weights,
nothing downloaded), each set beside the project's encoding it matches (``bench --peers``, docs/speed.md).

- ``gpt2``: ``GPT2LMHeadModel`` (learned positions, SDPA attention) against ``learnable``: the same layers, width,
  heads, MLP, vocabulary, tied embeddings and position table, so the same parameter count.
- ``neox``: ``GPTNeoXForCausalLM`` (RoPE on every dimension of each head, SDPA) against ``rope``, set to the backbone's
  layout: sequential residual (not NeoX's parallel one), tanh GELU, tied embeddings; the same parameter count.
- ``llama``: ``LlamaForCausalLM`` (RoPE, SDPA) against ``rope``: Llama's own block, which differs from the backbone's
  and cannot match its parameter count: RMSNorm, a SwiGLU MLP of 8/3 x width (three matrices), no biases.

Every peer runs without dropout and without a KV cache (a training step, as the project's).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from torch import nn

from .models import BackboneConfig


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


@dataclass(frozen=True)
class Peer:
    against: str  # the project's encoding it is compared with
    build: Callable[[BackboneConfig], nn.Module]  # a backbone config of that encoding -> the peer, in training mode
    same_parameters: bool  # the peer has the backbone's parameter count


PEERS = {"gpt2": Peer("learnable", _gpt2, True), "neox": Peer("rope", _neox, True),
         "llama": Peer("rope", _llama, False)}
DEFAULT_PEERS = ("gpt2", "neox")


def build_peer(name: str, config: BackboneConfig) -> nn.Module:
    """The peer ``name`` (a key of :data:`PEERS`) at ``config``'s shape, random weights, in training mode."""
    return PEERS[name].build(config).train()
