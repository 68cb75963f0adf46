"""Backbone configuration: a dataclass jsonargparse fills from YAML, with GPT-2 / BERT presets.

The positional encoding is one field holding the encoding's own settings (``positional``'s :class:`Encoding`):
nothing encoding-specific lives here.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Optional

from ..errors import ConfigError
from ..positional import Encoding, encoding_from
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
# Attention switches, each independent of the encoding (:class:`backbone.SelfAttention` says what each does); a run
# with one is named by its encoding's label and the switch: ``rope+attn_gate``.
SWITCHES = ("attn_gate", "attn_sink", "qk_norm")


def split_switches(label: str) -> tuple[str, list[str]]:
    """A run label's encoding label and its switches, in :data:`SWITCHES` order: ``rope+qk_norm+attn_gate`` ->
    (``rope``, [``attn_gate``, ``qk_norm``])."""
    parts = label.split("+")
    switches = []
    while len(parts) > 1 and parts[-1] in SWITCHES:
        switches.append(parts.pop())
    if len(set(switches)) < len(switches):
        raise ConfigError(f"{label!r} names a switch twice; each of {', '.join(SWITCHES)} is on or off")
    return "+".join(parts), sorted(switches, key=SWITCHES.index)


def with_switches(label: str, switches: list[str]) -> str:
    """The inverse of :func:`split_switches`: an encoding's label and the switches on (``rope+attn_gate``)."""
    return "+".join([label, *switches])


# Backbone settings that may differ from a checkpoint's: they change how the weights are run, not what they are
# (an encoding names its own, :attr:`Encoding.runtime`).
RUNTIME_FIELDS = ("dropout", "attention_backend")


@dataclass
class BackboneConfig:
    """Shape and positional encoding of a backbone. Fields left ``None`` come from ``preset``.

    ``pos_encoding``: an encoding's settings (``Rope()``, ``Rope(scaling="linear")``), its label (``"dape_v2+cable"``),
    or the ``{"class_path": ..., "init_args": ...}`` form configs and checkpoints hold. ``attn_gate``, ``attn_sink``,
    ``qk_norm``: the attention switches (:data:`SWITCHES`), beside any encoding."""

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
    attn_gate: bool = False
    attn_sink: bool = False
    qk_norm: bool = False

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
        if self.attn_sink and not self.pos_encoding.softmax:
            raise ConfigError(f"attn_sink needs softmax attention; {self.pos_encoding.label()}'s weights are no "
                              "softmax (a sink has no normaliser to join): leave attn_sink false")
        self.pos_encoding.check(self)

    @classmethod
    def from_dict(cls, saved: dict) -> "BackboneConfig":
        """A config from the dict :meth:`to_dict` writes (a parsed config, an exported folder's); a checkpoint's,
        which an earlier version may have written, is read through ``lit.checkpoint_format.saved_backbone``."""
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

    def switches(self) -> list[str]:
        """The attention switches this backbone has on (:data:`SWITCHES`)."""
        return [name for name in SWITCHES if getattr(self, name)]

    def label(self, runtime: bool = True) -> str:
        """How runs, records and reports name the backbone's attention: its encoding's label and its switches
        (``rope+attn_gate``)."""
        return with_switches(self.pos_encoding.label(runtime), self.switches())

    def shape(self) -> str:
        """The backbone's kind and size as records name it (``decoder L12-D768-H12``): two runs that differ in it are
        two runs in a report, whatever else they share."""
        return f"{'decoder' if self.causal else 'encoder'} L{self.n_layer}-D{self.n_embd}-H{self.n_head}"

    def weight_settings(self) -> dict:
        """Every setting that defines the weights (shape and the encoding's own), flattened; the vocabulary and the
        training length come from the data and are checked there."""
        skip = set(RUNTIME_FIELDS) | {"preset", "vocab_size", "block_size", "trained_length", "pos_encoding"}
        skip |= {name for name in SWITCHES if not getattr(self, name)}  # a run without switches is named as before
        shape = {f.name: getattr(self, f.name) for f in fields(self) if f.name not in skip}
        return {**shape, **self.pos_encoding.weight_settings()}

    def to_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)} | {"pos_encoding": self.pos_encoding.to_dict()}
