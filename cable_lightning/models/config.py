"""Backbone configuration: a dataclass jsonargparse fills from YAML, with GPT-2 / BERT presets."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Literal, Optional

from ..errors import ConfigError

PRESETS: dict[str, dict] = {
    # The CABLE paper's GPT-2 sizes; gpt2-small uses 12 heads (the paper's "10" does not divide 768).
    "gpt2-tiny": dict(n_layer=6, n_head=8, n_embd=512, vocab_size=50257, causal=True),
    "gpt2-small": dict(n_layer=12, n_head=12, n_embd=768, vocab_size=50257, causal=True),
    "gpt2-medium": dict(n_layer=24, n_head=16, n_embd=1024, vocab_size=50257, causal=True),
    "bert-base": dict(n_layer=12, n_head=12, n_embd=768, vocab_size=30522, causal=False),
}
_DEFAULTS = dict(mlp_ratio=4.0, dropout=0.0)
DAPE_VERSIONS = ("none", "v2")
# Settings that may differ from a checkpoint's: they change how the weights are run, not what they are.
RUNTIME_FIELDS = ("dropout", "attention_backend", "rope_scaling", "rope_scaling_factor")


@dataclass
class BackboneConfig:
    """Shape and positional encoding of a backbone. Fields left ``None`` come from ``preset``."""

    preset: str = "gpt2-tiny"
    pos_encoding: str = "cable"
    n_layer: Optional[int] = None
    n_head: Optional[int] = None
    n_embd: Optional[int] = None
    vocab_size: Optional[int] = None
    mlp_ratio: Optional[float] = None
    dropout: Optional[float] = None
    causal: Optional[bool] = None
    # Training length; the learnable table's default size, FIRE's initial threshold, YaRN's original length.
    block_size: int = 1024
    max_positions: Optional[int] = None
    pad_vocab_multiple: int = 64
    attention_backend: Literal["auto", "sdpa", "fold", "flex", "chunked", "materialized"] = "auto"
    cable_bias_activation: Literal["relu", "softplus"] = "relu"
    rope_base: float = 10000.0
    rope_scaling: Literal["none", "linear", "ntk", "yarn"] = "none"
    rope_scaling_factor: float = 1.0
    # DAPEv2 (Zheng et al., 2024): a convolution over [logits, bias] that corrects any score-bias PE.
    dape: Literal["none", "v2"] = "none"
    dape_width: int = 32
    dape_kernel: int = 3
    # CoPE (Golovneva et al., 2024): contextual positions are clamped to [0, cope_positions - 1].
    cope_positions: int = 64

    def __post_init__(self):
        if self.preset not in PRESETS:
            raise ConfigError(f"unknown backbone preset {self.preset!r}; valid presets: {', '.join(PRESETS)}")
        for name, value in {**_DEFAULTS, **PRESETS[self.preset]}.items():
            if getattr(self, name) is None:
                setattr(self, name, value)
        if self.n_embd % self.n_head:
            raise ConfigError(f"n_embd={self.n_embd} is not divisible by n_head={self.n_head}")
        if (self.n_embd // self.n_head) % 2:
            raise ConfigError(f"head size {self.n_embd // self.n_head} must be even (RoPE rotates pairs)")
        if self.dape not in DAPE_VERSIONS:
            raise ConfigError(f"unknown dape {self.dape!r}; valid: {', '.join(DAPE_VERSIONS)}")
        if self.dape_width < 1 or self.dape_kernel < 1 or self.dape_kernel % 2 == 0:
            raise ConfigError(f"dape_width must be >= 1 and dape_kernel odd and >= 1 (it is centred on each key), "
                              f"got dape_width={self.dape_width}, dape_kernel={self.dape_kernel}")
        if self.cope_positions < 2:
            raise ConfigError("cope_positions must be >= 2 (interpolation needs two positions), "
                              f"got {self.cope_positions}")

    @property
    def padded_vocab_size(self) -> int:
        """Vocab rounded up to a multiple of ``pad_vocab_multiple`` (50257 -> 50304) for fast matmuls."""
        m = self.pad_vocab_multiple
        return ((self.vocab_size + m - 1) // m) * m

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    @property
    def encoding_name(self) -> str:
        """The PE as runs, records and reports name it: ``cable``, or ``dape_v2+cable`` when DAPEv2 augments it."""
        return encoding_name(self.pos_encoding, self.dape)

    def to_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)}


DAPE_PREFIX = "dape_"


def encoding_name(pos_encoding: str, dape: str = "none") -> str:
    """``cable`` or ``dape_v2+cable``: one name for a PE and its augmentation (run folders, records, reports)."""
    return pos_encoding if dape == "none" else f"{DAPE_PREFIX}{dape}+{pos_encoding}"


def parse_encoding_name(name: str) -> dict:
    """The inverse of :func:`encoding_name`: ``dape_v2+cable`` -> ``{"pos_encoding": "cable", "dape": "v2"}``."""
    augmentation, plus, pos_encoding = name.rpartition("+")
    if not plus:
        return {"pos_encoding": name, "dape": "none"}
    if not augmentation.startswith(DAPE_PREFIX):
        raise ConfigError(f"unknown augmentation {augmentation!r} in {name!r}; valid: {DAPE_PREFIX}v2+<pe>")
    return {"pos_encoding": pos_encoding, "dape": augmentation[len(DAPE_PREFIX):]}
