"""Backbone configuration: a dataclass jsonargparse fills from YAML, with GPT-2 / BERT presets.

The positional encoding is one field holding the encoding's own settings (``positional``'s :class:`Encoding`):
nothing encoding-specific lives here.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, fields
from typing import Optional

from ..errors import ConfigError
from ..positional import ENCODING_FLAG, Encoding, encoding_from
from ..positional.cable import Cable
from .attention import Backend, check_backend

PRESETS: dict[str, dict] = {
    # The CABLE paper's GPT-2 sizes; gpt2-small uses 12 heads (the paper's "10" does not divide 768).
    "gpt2-tiny": dict(n_layer=6, n_head=8, n_embd=512, vocab_size=50257, causal=True),
    "gpt2-small": dict(n_layer=12, n_head=12, n_embd=768, vocab_size=50257, causal=True),
    "gpt2-medium": dict(n_layer=24, n_head=16, n_embd=1024, vocab_size=50257, causal=True),
    "bert-base": dict(n_layer=12, n_head=12, n_embd=768, vocab_size=30522, causal=False),
}
_DEFAULTS = dict(mlp_ratio=4.0, dropout=0.0)
# Backbone settings that may differ from a checkpoint's: they change how the weights are run, not what they are
# (an encoding names its own, :attr:`Encoding.runtime`).
RUNTIME_FIELDS = ("dropout", "attention_backend")


@dataclass
class BackboneConfig:
    """Shape and positional encoding of a backbone. Fields left ``None`` come from ``preset``.

    ``pos_encoding``: an encoding's settings (``Rope()``, ``Rope(scaling="linear")``), its label (``"dape_v2+cable"``),
    or the ``{"class_path": ..., "init_args": ...}`` form configs and checkpoints hold."""

    preset: str = "gpt2-tiny"
    pos_encoding: Encoding = field(default_factory=Cable)
    n_layer: Optional[int] = None
    n_head: Optional[int] = None
    n_embd: Optional[int] = None
    vocab_size: Optional[int] = None
    mlp_ratio: Optional[float] = None
    dropout: Optional[float] = None
    causal: Optional[bool] = None
    # Training length: the learnable table's default size, FIRE's initial threshold, YaRN's original length.
    block_size: int = 1024
    # A context extension (docs/training_distances.md): the length the weights were first trained at, when this run
    # trains them longer (block_size); encodings then read it where they read the training length (YaRN's original
    # length, a learnable table's size), and records name the run "trained at trained_length, extended to block_size".
    trained_length: Optional[int] = None
    pad_vocab_multiple: int = 64
    attention_backend: Backend = "auto"

    def __post_init__(self):
        if self.preset not in PRESETS:
            raise ConfigError(f"unknown backbone preset {self.preset!r}; valid presets: {', '.join(PRESETS)}")
        self.pos_encoding = encoding_from(self.pos_encoding)
        for name, value in {**_DEFAULTS, **PRESETS[self.preset]}.items():
            if getattr(self, name) is None:
                setattr(self, name, value)
        if self.trained_length is not None and (isinstance(self.trained_length, bool) or self.trained_length < 1):
            raise ConfigError(f"trained_length must be a length >= 1 (or null: the block size), got "
                              f"{self.trained_length!r}")
        if self.n_embd % self.n_head:
            raise ConfigError(f"n_embd={self.n_embd} is not divisible by n_head={self.n_head}")
        check_backend(self.attention_backend, self.pos_encoding, self.causal, self.head_dim)
        self.pos_encoding.check(self)

    @classmethod
    def from_dict(cls, saved: dict) -> "BackboneConfig":
        """A config from a checkpoint's or an exported folder's dict, written by this version or an earlier one."""
        saved = upgrade_backbone_dict(saved)
        return cls(**{k: v for k, v in saved.items() if k in cls.__dataclass_fields__})

    @property
    def padded_vocab_size(self) -> int:
        """Vocab rounded up to a multiple of ``pad_vocab_multiple`` (50257 -> 50304) for fast matmuls."""
        m = self.pad_vocab_multiple
        return ((self.vocab_size + m - 1) // m) * m

    @property
    def original_length(self) -> int:
        """The length the weights were first trained at: ``trained_length`` in a context extension, else the block
        size."""
        return self.trained_length or self.block_size

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    def shape(self) -> str:
        """The backbone's kind and size as records name it (``decoder L12-D768-H12``): two runs that differ in it are
        two runs in a report, whatever else they share."""
        return f"{'decoder' if self.causal else 'encoder'} L{self.n_layer}-D{self.n_embd}-H{self.n_head}"

    def weight_settings(self) -> dict:
        """Every setting that defines the weights (shape and the encoding's own), flattened; the vocabulary and the
        training length come from the data and are checked there."""
        skip = set(RUNTIME_FIELDS) | {"preset", "vocab_size", "block_size", "trained_length", "pos_encoding"}
        shape = {f.name: getattr(self, f.name) for f in fields(self) if f.name not in skip}
        return {**shape, **self.pos_encoding.weight_settings()}

    def to_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)} | {"pos_encoding": self.pos_encoding.to_dict()}


# Checkpoints and exports written before encodings owned their settings held them as prefixed backbone fields.
_LEGACY_SETTINGS = {"rope": {"rope_base": "base", "rope_scaling": "scaling", "rope_scaling_factor": "scaling_factor"},
                    "cable": {"cable_bias_activation": "bias_activation"},
                    "cable_nw": {"cable_bias_activation": "bias_activation"},
                    "k_cable": {"cable_bias_activation": "bias_activation"},
                    "learnable": {"max_positions": "max_positions"},
                    "cope": {"cope_positions": "positions"}}
_LEGACY_DAPE = {"dape": "base", "dape_width": "width", "dape_kernel": "kernel"}  # dape: v2 -> dape_v2 wrapping
_LEGACY_FIELDS = {old for renames in _LEGACY_SETTINGS.values() for old in renames} | set(_LEGACY_DAPE)


def moved_setting(name: str) -> Optional[str]:
    """Where an earlier version's backbone setting ``name`` lives now, as the flags that set it (None: ``name`` was
    never a backbone setting). Checkpoints map these by themselves; a command line or YAML gets this pointer."""
    flag = ENCODING_FLAG
    if name in _LEGACY_DAPE:
        wraps = " (the encoding it wraps)" if name == "dape" else ""
        return f"it moved into the dape_v2 encoding: {flag} dape_v2 {flag}.{_LEGACY_DAPE[name]} VALUE{wraps}"
    owners = [encoding for encoding, renames in _LEGACY_SETTINGS.items() if name in renames]
    if not owners:
        return None
    return (f"it moved into the {'/'.join(owners)} encoding: {flag} {owners[0]} "
            f"{flag}.{_LEGACY_SETTINGS[owners[0]][name]} VALUE")


def upgrade_backbone_dict(saved: dict) -> dict:
    """An earlier version's backbone dict (``pos_encoding: rope`` with ``rope_scaling`` etc. beside it, ``dape: v2``)
    in this version's form; a current one is returned as it is."""
    if not isinstance(saved.get("pos_encoding"), str) and not _LEGACY_FIELDS & set(saved):
        return saved
    name = saved.get("pos_encoding", "cable")
    renames = _LEGACY_SETTINGS.get(name, {})
    encoding = {"class_path": name,
                "init_args": {new: saved[old] for old, new in renames.items() if saved.get(old) is not None}}
    if saved.get("dape", "none") != "none":
        encoding = {"class_path": f"dape_{saved['dape']}",
                    "init_args": {"base": encoding, "width": saved.get("dape_width", 32),
                                  "kernel": saved.get("dape_kernel", 3)}}
    upgraded = {k: v for k, v in saved.items() if k not in _LEGACY_FIELDS}
    return upgraded | {"pos_encoding": encoding}


_LEGACY_DAPE_KEY = re.compile(r"(^|\.)blocks\.(\d+)\.attn\.dape\.")


def upgrade_state_dict(state: dict, saved_backbone: dict) -> dict:
    """An earlier version's weights in this version's names: DAPEv2's convolutions moved from each attention layer
    (``blocks.<i>.attn.dape.``) into the encoding (``pe.layers.<i>.``), and the encoding it wraps to ``pe.base.``."""
    if saved_backbone.get("dape", "none") == "none":
        return state
    upgraded = {}
    for key, value in state.items():
        key = re.sub(r"(^|\.)pe\.", r"\1pe.base.", key)
        upgraded[_LEGACY_DAPE_KEY.sub(r"\1pe.layers.\2.", key)] = value
    return upgraded
