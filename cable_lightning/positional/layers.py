"""Per-layer encodings and sliding windows: each layer its own encoding and, optionally, a window of the latest
positions it attends to, given as a repeating pattern (RNoPE-SWA, Yang et al., 2025; SWAN-GPT, Puvvada et al.,
2025: RoPE layers over a sliding window interleaved with NoPE layers over everything).

``pattern`` is entries joined by ``-``; an entry is an encoding's label (default settings; wrappers as
``dape_v2+cable``), ``@W`` for a sliding window of W positions or ``@cC`` for chunks of C positions (attention
inside consecutive blocks of C tokens, not a sliding window: Llama 4's chunked layers), ``xN`` for N layers in a
row: ``rope@512x3-nope`` is three RoPE layers over 512-token windows, then one NoPE layer over everything, and
``rope@c8192x3-nope`` is Llama 4's interleaving (iRoPE; its QK-norm is the backbone's ``qk_norm``). Layer i takes
entry i mod the pattern's length, so the pattern repeats over the model's layers (a last repeat may be partial).
Layers of one encoding share one module built for that many layers; the others' modules never see them. Runs,
records and reports name it ``layers-<pattern>``, and ``positional.from_label("layers-rope@512x3-nope")`` builds it.

``temperature_floor`` (with ``temperature_scale``) scales the queries of the pattern's NoPE layers by Llama 4's
inference temperature (:func:`query_temperature`); it changes how weights run, not what they are, and labels
records ``layers-<pattern>+temp<floor>``.

The window is enforced by attention on every backend (``models.attention``: only the key blocks a row can see on the
fused and chunked paths; decoding onto a KV cache attends the same positions as the full forward).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from typing import Optional

import torch
from torch import Tensor, nn

from ..errors import ConfigError
from .base import Chunks, Encoding, PositionalEncoding
from .layout import with_layout
from .registry import from_label
from .ssmax import Ssmax

# Score kinds from the fewest backends' demands to the most (each kind's backends are a subset of the previous').
DEMANDS = ("none", "foldable_bias", "bias", "logits")
ENTRY = re.compile(r"(?P<label>[a-z0-9_+]+?)(?:@(?P<chunked>c)?(?P<window>\d+))?(?:x(?P<count>\d+))?")


def window_text(window: int | Chunks | None) -> str:
    """How a pattern entry writes its window: ``@512`` sliding, ``@c8192`` chunked, nothing for none."""
    if window is None:
        return ""
    return f"@c{window.size}" if isinstance(window, Chunks) else f"@{window}"


def query_temperature(positions: Tensor, floor: int, scale: float) -> Tensor:
    """Llama 4's temperature on the queries of its NoPE layers (transformers' Llama4TextAttention,
    ``attn_temperature_tuning``; Nakanishi, 2025): 1 + scale * log(1 + floor((p + 1) / floor)) at position p, so 1
    for the first floor - 1 positions and slowly growing past them, to keep attention sharp over long inputs."""
    return 1.0 + scale * torch.log1p(torch.floor((positions.float() + 1.0) / floor))


class PerLayer(PositionalEncoding):
    """One module per distinct encoding of the pattern, each built for the layers that use it."""

    def __init__(self, settings: "Layers", config):
        super().__init__(settings, config)
        per_layer = settings.per_layer(config.n_layer)
        labels = list(dict.fromkeys(encoding.label() for encoding, _ in per_layer))
        self.windows = [window for _, window in per_layer]
        self.part_of = [labels.index(encoding.label()) for encoding, _ in per_layer]
        self.local = [self.part_of[:layer].count(self.part_of[layer]) for layer in range(config.n_layer)]
        self.nope = [encoding.name == "nope" for encoding, _ in per_layer]  # the layers the temperature scales
        self.parts = nn.ModuleList()
        for part, label in enumerate(labels):
            encoding = next(encoding for encoding, _ in per_layer if encoding.label() == label)
            self.parts.append(encoding.build(replace(config, pos_encoding=encoding, n_layer=self.part_of.count(part))))

    per_layer = ("windows", "part_of", "local", "nope")

    def layer_view(self, layer):
        view = super().layer_view(layer)
        part = self.part_of[layer]  # its part, as that part's own layer alone sees it
        view.parts = nn.ModuleList(self.parts[p].layer_view(self.local[layer]) if p == part else self.parts[p]
                                   for p in range(len(self.parts)))
        view.local = [0]
        return view

    @property
    def reads_positions(self):
        return any(part.reads_positions for part in self.parts)

    @property
    def relative(self):
        return all(part.relative for part in self.parts)

    def check_layout(self, layout):
        for part in self.parts:
            part.check_layout(layout)

    def embed(self, x, offset, layout=None):
        for part in self.parts:  # an absolute encoding in the pattern acts on the input, once
            x = part.embed(x, offset, **with_layout(layout))
        return x

    def rotate(self, q, k, offset, layer=0, key_padding=None, layout=None):
        part = self.parts[self.part_of[layer]]
        q, k = part.rotate(q, k, offset, self.local[layer], key_padding, **with_layout(layout))
        if self.settings.temperature_floor is not None and self.nope[layer]:
            t = q.shape[-2]
            positions = layout.positions[:, None, :] if layout is not None else \
                torch.arange(offset, offset + t, device=q.device)
            scale = query_temperature(positions, self.settings.temperature_floor, self.settings.temperature_scale)
            q = q * scale[..., None].to(q.dtype)
        return q, k

    def window(self, layer):
        return self.windows[layer]

    def score_bias(self, h, layer, offset, state, layout=None):
        return self.parts[self.part_of[layer]].score_bias(h, self.local[layer], offset, state, **with_layout(layout))

    def token_increments(self, h, layer, layout=None):
        return self.parts[self.part_of[layer]].token_increments(h, self.local[layer], **with_layout(layout))


@dataclass
class Layers(Encoding):
    """A repeating pattern of per-layer encodings and sliding windows: ``rope@512x3-nope`` is three RoPE layers over
    512-token windows, then one NoPE layer over everything."""

    pattern: str = "rope@512x3-nope"
    temperature_floor: Optional[int] = None
    temperature_scale: float = 0.1

    name = "layers"
    module = PerLayer
    runtime = ("temperature_floor", "temperature_scale")

    def __post_init__(self):
        super().__post_init__()
        self.entries = []  # (encoding, window, count)
        for text in str(self.pattern).split("-"):
            found = ENTRY.fullmatch(text)
            if not found:
                raise ConfigError(f"layers.pattern={self.pattern!r}: entry {text!r} is not "
                                  "LABEL[@WINDOW|@cCHUNK][xCOUNT] (e.g. rope@512x3-nope, rope@c8192x3-nope)")
            encoding = from_label(found["label"])
            window, count = (int(found[g]) if found[g] else None for g in ("window", "count"))
            if window == 0 or count == 0:
                raise ConfigError(f"layers.pattern={self.pattern!r}: entry {text!r} needs a window and a count >= 1")
            if found["chunked"]:
                window = Chunks(window)
            if isinstance(encoding, Ssmax) and window is not None:
                raise ConfigError(f"layers.pattern={self.pattern!r}: ssmax counts the keys a query sees, which a "
                                  f"window in the pattern hides from it; wrap the pattern instead: ssmax+layers-...")
            self.entries.append((encoding, window, count or 1))
        self.pattern = "-".join(encoding.label() + window_text(window) + (f"x{count}" if count > 1 else "")
                                for encoding, window, count in self.entries)
        if self.temperature_floor is not None and self.temperature_floor < 1:
            raise ConfigError(f"layers.temperature_floor must be a number of positions >= 1 (or null: no "
                              f"temperature), got {self.temperature_floor}")

    @classmethod
    def from_label_text(cls, text: str) -> "Layers":
        return cls(pattern=text)

    def per_layer(self, n_layer: int) -> list[tuple[Encoding, int | None]]:
        """(encoding, window) of each of ``n_layer`` layers: the pattern repeated."""
        one_round = [(encoding, window) for encoding, window, count in self.entries for _ in range(count)]
        return [one_round[layer % len(one_round)] for layer in range(n_layer)]

    @property
    def scores(self) -> str:
        """The most demanding of its encodings' (the backends that can run it run every layer)."""
        return max((encoding.scores for encoding, _, _ in self.entries), key=DEMANDS.index)

    @property
    def softmax(self) -> bool:
        """Whether every layer's weights are a softmax."""
        return all(encoding.softmax for encoding, _, _ in self.entries)

    def label(self, runtime: bool = True) -> str:
        tempered = runtime and self.temperature_floor is not None
        return f"layers-{self.pattern}" + (f"+temp{self.temperature_floor}" if tempered else "")

    def longest_length(self, block_size):
        lengths = [n for encoding, _, _ in self.entries if (n := encoding.longest_length(block_size)) is not None]
        return min(lengths, default=None)

    def check(self, config):
        for encoding, _, _ in self.entries:
            encoding.check(config)
