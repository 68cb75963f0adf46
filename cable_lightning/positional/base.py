"""The positional-encoding contract (docs/design.md#the-encoding-contract tells it whole).

An encoding is two classes in one file: its settings, a dataclass subclass of :class:`Encoding` whose ``name`` is how
configs, command lines and run folders name the encoding (``rope``), which jsonargparse reads and which says everything
the rest of the package asks about the encoding; and its module, a :class:`PositionalEncoding` with four hooks the
backbone calls without knowing which encoding it holds: ``embed`` (once, on the token embeddings), ``rotate`` (every
layer, on q and k), ``window`` (every layer, its sliding window or None) and ``score_bias`` (every layer, a
:class:`ScoreBias` that describes an additive bias instead of materialising a (T x T) tensor, or :class:`LogitScores`).
Every score object maps a block's scaled logits to scores (:meth:`~ScoreBias.scores`) and masked scores to weights
(:meth:`~ScoreBias.weights`): the reference attention path and the diagnostics read weights through them alone.
``embed``, ``rotate`` and ``score_bias`` also take a :class:`~.layout.Layout` (None: positions 0..T-1, one document).
"""

from __future__ import annotations

import copy
import dataclasses
import re
import typing
from typing import Callable, ClassVar, Literal, Optional

import torch
from torch import Tensor, nn

from ..errors import ConfigError
from .layout import Layout, with_layout

# The command-line flag that picks the backbone's encoding (its settings are ENCODING_FLAG.NAME VALUE).
ENCODING_FLAG = "--model.init_args.backbone.pos_encoding"

# What an encoding adds to the q.k logits, which decides the attention backends that can run it:
# nothing; a pointwise ScoreBias; a ScoreBias that also factorises when causal (the fold); LogitScores.
ScoreKind = Literal["none", "bias", "foldable_bias", "logits"]
SCORE_KINDS = typing.get_args(ScoreKind)


@dataclasses.dataclass(frozen=True)
class Chunks:
    """A layer's attention cut into consecutive blocks of ``size`` positions (Llama 4's chunked layers): a query sees
    the keys of its own block only, those up to itself when causal; the first query of a block sees itself alone. A
    layer's window (:meth:`PositionalEncoding.window`) is this, a sliding window's width (an int), or None."""

    size: int


def window_span(window: "int | Chunks | None") -> int | None:
    """The most positions on one side of a query that a window lets it see, its own included."""
    return window.size if isinstance(window, Chunks) else window


def window_keys(window: "int | Chunks", first_row: int, last_row: int, n_keys: int, causal: bool) -> tuple[int, int]:
    """[first, stop): the keys that query positions first_row..last_row can see through ``window``, of n_keys."""
    if isinstance(window, Chunks):
        first = first_row // window.size * window.size
        stop = last_row + 1 if causal else (last_row // window.size + 1) * window.size
    else:
        first, stop = first_row - window + 1, last_row + 1 if causal else last_row + window
    return max(0, first), min(n_keys, stop)


def visible_keys(start: int, stop: int, first_key: int, n_keys: int, q_offset: int, causal: bool,
                 window: int | Chunks | None, device) -> Tensor:
    """(rows, keys) True where query row i (at position q_offset + i) sees key j in [first_key, n_keys): j <= i when
    causal; with a sliding ``window`` only the last ``window`` positions (i - j < window; |i - j| < window when
    bidirectional); with :class:`Chunks`, only keys of its own chunk."""
    q_pos = torch.arange(start, stop, device=device)[:, None] + q_offset
    k_pos = torch.arange(first_key, n_keys, device=device)[None, :]
    distance = q_pos - k_pos
    allowed = distance >= 0 if causal else torch.ones_like(distance, dtype=torch.bool)
    if isinstance(window, Chunks):
        allowed = allowed & (q_pos // window.size == k_pos // window.size)
    elif window is not None:
        allowed = allowed & (distance.abs() < window)
    return allowed


class UnsupportedLengthError(ValueError):
    """A positional encoding cannot serve this sequence length (a learnable table that is too short)."""


def normalised(scores: Tensor, softmax: bool) -> Tensor:
    """Attention weights from masked scores (-inf where a key is hidden): softmax over the keys, or (``softmax``
    False) exp of scores that are log weights already."""
    return scores.softmax(dim=-1) if softmax else scores.exp()


class ScoreBias:
    """An additive attention bias given pointwise as ``bias(b, h, q_idx, kv_idx)``.

    One formula serves every attention backend: FlexAttention calls it with scalar indices as a
    ``score_mod``; the chunked and reference paths call it with broadcast index grids through
    :meth:`rows`. Query index ``i`` sits at absolute position ``q_offset + i``; key ``j`` at ``j``.

    A causal bias that is a dot product of per-query and per-key vectors, up to a constant per query
    row, may also say so (``foldable`` and :meth:`factors`): the ``fold`` attention backend then
    runs it through the same fused kernels as no bias at all.
    """

    foldable = False
    softmax = True  # the weights are a softmax over logits + bias (the score contract; see LogitScores.softmax)

    def __init__(self, q_offset: int, causal: bool, layout: Layout | None = None):
        self.q_offset = q_offset
        self.causal = causal
        self.layout = layout

    def __call__(self, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        raise NotImplementedError

    def scores(self, logits: Tensor, q: Tensor, start: int, stop: int, key_padding: Tensor | None = None) -> Tensor:
        """The score contract (as :meth:`LogitScores.scores`): the scaled logits of query rows [start, stop) against
        keys [0, n_keys) (B, H, rows, n_keys) plus the bias, before the mask (a bias reads no padding: the mask
        hides padded keys)."""
        batch, heads, _, n_keys = logits.shape
        return logits + self.rows(start, stop, n_keys, batch, heads, logits.device).to(logits.dtype)

    def weights(self, masked_scores: Tensor) -> Tensor:
        """The score contract's second half: the weights attention applies, from :meth:`scores` masked with -inf."""
        return normalised(masked_scores, self.softmax)

    def query_position(self, b: Tensor, q_idx: Tensor) -> Tensor:
        """The position index of query row ``q_idx`` of batch row ``b``: ``q_offset + q_idx``, or the layout's."""
        return q_idx + self.q_offset if self.layout is None else self.layout.positions[b, q_idx + self.q_offset]

    def key_position(self, b: Tensor, kv_idx: Tensor) -> Tensor:
        return kv_idx if self.layout is None else self.layout.positions[b, kv_idx]

    def rows(self, start: int, end: int, n_keys: int, batch: int, heads: int, device, first_key: int = 0) -> Tensor:
        """The bias for query rows [start, end) against keys [first_key, n_keys): shape (batch|1, heads, rows, keys)
        (a sliding window needs only the keys it sees)."""
        b = torch.arange(batch, device=device).view(-1, 1, 1, 1)
        h = torch.arange(heads, device=device).view(1, -1, 1, 1)
        q_idx = torch.arange(start, end, device=device).view(1, 1, -1, 1)
        kv_idx = torch.arange(first_key, n_keys, device=device).view(1, 1, 1, -1)
        return self(b, h, q_idx, kv_idx)

    def factors(self, n_keys: int) -> tuple[Tensor, Tensor]:
        """``(a, c)``, broadcastable to (B, H, Tq, E) per query and (B, H, n_keys, E) per key, such that
        ``bias[i, j] = a_i . (c_j - c_{q_offset + i})`` wherever the causal mask allows ``j``: the bias
        is zero on the diagonal and its row constant is ``-a_i . c`` at the query's own position."""
        raise NotImplementedError(f"{type(self).__name__} does not factorise")

    def score_mod(self) -> Callable:
        def add_bias(score, b, h, q_idx, kv_idx):
            return score + self(b, h, q_idx, kv_idx).to(score.dtype)

        return add_bias


class PositionalBias(ScoreBias):
    """A bias that is a function of the head and the query's and key's position indices alone, not of the tokens
    (KERPLE, T5, FIRE, ALiBi): :meth:`at` is its formula, read at the positions :meth:`query_position` and
    :meth:`key_position` give (a layout's, where there is one). Such a bias can be tabulated over (head, query
    position, key position) (:meth:`position_table`), which is how FlexAttention trains it."""

    def at(self, h: Tensor, i: Tensor, j: Tensor) -> Tensor:
        """The bias of head ``h`` for query position ``i`` against key position ``j`` (broadcast tensors)."""
        raise NotImplementedError

    def __call__(self, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        return self.at(h, self.query_position(b, q_idx), self.key_position(b, kv_idx))

    def position_table(self, heads: int, extent: int, device) -> Tensor:
        """(heads, extent, extent): :meth:`at` over every head and every pair of positions below ``extent``. Built from
        the formula alone (no copy of this object, which Dynamo 2.11 does not trace: a graph break in every compiled
        block on the GPU)."""
        positions = torch.arange(extent, device=device)
        return self.at(torch.arange(heads, device=device).view(-1, 1, 1), positions.view(1, -1, 1),
                       positions.view(1, 1, -1))

    def table_score_mod(self, table: Tensor) -> Callable:
        """A score_mod that reads the bias from :meth:`position_table`'s ``table`` at the query's and key's position
        indices. It reads the table and the positions only: FlexAttention's backward adds the gradient of every
        tensor a score_mod reads, one atomic add per score, so a captured per-head parameter would take B x T^2 adds
        into H addresses, and the table takes B into each entry."""
        def add_table(score, b, h, q_idx, kv_idx):
            return score + table[h, self.query_position(b, q_idx), self.key_position(b, kv_idx)].to(score.dtype)

        return add_table


class LogitScores:
    """Attention scores that need the q.k logits themselves, not only positions and tokens: CoPE's gates
    and DAPEv2's convolution over [logits, bias]. No pointwise form exists, so attention computes them
    one block of query rows at a time (the chunked path; no fused kernel can run them).

    :meth:`scores` gets the scaled logits of query rows [start, stop) against keys [0, n_keys)
    (B, H, rows, n_keys), those rows' queries (B, H, rows, D) and, for a padded batch, ``key_padding`` (B, n_keys),
    True at real keys (an argument, as attention gets it), and returns the scores before the causal mask, as a new
    tensor that autograd does not keep for a backward (attention masks it in place). Every row must depend only on its
    own logits (and, causally, on keys up to its position), so that blocks of rows, cached decoding and the full
    forward agree.
    """

    # (row, key) maps of one head's size that scores() holds at once per head; sizes the row blocks.
    maps_per_head = 1
    # True: scores are logits, normalised by softmax. False: scores are log attention weights, used as they are
    # (stick-breaking's weights sum to at most 1 by construction).
    softmax = True

    def __init__(self, q_offset: int, causal: bool, layout: Layout | None = None):
        self.q_offset = q_offset
        self.causal = causal
        self.layout = layout  # its documents: a key of another document is never seen (unseen, hide_)

    def logits(self, q: Tensor, k: Tensor, start: int, stop: int, reference: bool = False) -> Tensor:
        """The scaled logits :meth:`scores` maps, of query rows [start, stop) (``q``) against keys ``k``, in fp32 or
        wider: q.k / sqrt(d). An encoding whose logits are not q.k (PaTH's keys carried to each query) computes its
        own; ``reference`` (the materialized backend, :func:`~..models.attention.attention_map`) asks for the obvious
        form every other path is tested against."""
        wide = torch.promote_types(q.dtype, torch.float32)
        return (q.to(wide) * q.shape[-1] ** -0.5) @ k.to(wide).transpose(-1, -2)  # scaled q: no pass over the map

    def scores(self, logits: Tensor, q: Tensor, start: int, stop: int, key_padding: Tensor | None = None) -> Tensor:
        raise NotImplementedError

    def kernel(self, q: Tensor, k: Tensor, v: Tensor, q_offset: int, key_padding: Tensor | None, window: int | None,
               documents: Layout | None) -> Tensor | None:
        """The attention output from a fused kernel of the encoding's own, where one is installed and takes these
        inputs (the ``auto`` backend asks first); None: the chunked path runs the scores."""
        return None

    def weights(self, masked_scores: Tensor) -> Tensor:
        """The weights attention applies, from :meth:`scores` masked with -inf (softmax, or exp of log weights)."""
        return normalised(masked_scores, self.softmax)

    def future(self, start: int, stop: int, n_keys: int, device, first_key: int = 0) -> Tensor:
        """(rows, n_keys - first_key) True where a key in [first_key, n_keys) lies after its query row (never attended
        to when causal)."""
        return ~visible_keys(start, stop, first_key, n_keys, self.q_offset, True, None, device)

    def unseen(self, start: int, stop: int, n_keys: int, device, key_padding: Tensor | None = None) -> Tensor | None:
        """(B|1, 1, rows, n_keys) True where a query row never attends a key: its future (causal) or padding;
        None where it attends every key."""
        hidden = self.future(start, stop, n_keys, device) if self.causal else None
        if key_padding is not None:
            padded = ~key_padding[:, None, None, :n_keys]
            hidden = padded if hidden is None else hidden | padded
        if self.layout is not None and self.layout.documents is not None:
            rows = slice(self.q_offset + start, self.q_offset + stop)
            other = ~self.layout.same_document(rows, slice(0, n_keys))
            hidden = other if hidden is None else hidden | other
        return hidden

    def hide_(self, x: Tensor, start: int, stop: int, value: float, key_padding: Tensor | None = None) -> Tensor:
        """``x`` (B, C, rows, n_keys), in place, with ``value`` wherever :meth:`unseen`. Causal and unpadded, only
        the columns from the block's second row's position on are touched: every key before it is in every row's
        past, and a pass over all of a block's keys costs as much as a pass of the scores themselves (DAPEv2 fills
        three maps per block). ``x`` must be a tensor autograd does not keep for a backward."""
        n_keys = x.shape[-1]
        if self.causal and key_padding is None and (self.layout is None or self.layout.documents is None):
            first = self.q_offset + start + 1
            if first < n_keys:
                x[..., first:].masked_fill_(self.future(start, stop, n_keys, x.device, first), value)
            return x
        unseen = self.unseen(start, stop, n_keys, x.device, key_padding)
        return x if unseen is None else x.masked_fill_(unseen, value)


class Encoding:
    """One encoding's settings. Concrete subclasses are dataclasses named (PEP 8) after their ``name``, the name
    configs, command lines, records and reports use; defining one registers it under that name
    (:func:`registry.available`), so an encoding is its own file and nothing else.

    Class attributes a subclass sets (not dataclass fields):
    ``name``: the encoding's name (``rope``), its own: a subclass of another encoding names itself again;
    ``module``: its :class:`PositionalEncoding`; ``scores``: what it adds to the logits (:data:`ScoreKind`);
    ``runtime``: the settings that change how the weights are run, not what they are (they may differ from a
    checkpoint's, and they label evaluation records, not runs); ``softmax``: False where its attention weights are no
    softmax (stick-breaking), which a sink cannot join.
    """

    name: ClassVar[str]
    module: ClassVar[type]
    scores: ClassVar[str] = "none"
    softmax: ClassVar[bool] = True
    runtime: ClassVar[tuple[str, ...]] = ()
    registered: ClassVar[dict[str, type]] = {}

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        name = cls.__dict__.get("name")
        if not isinstance(name, str) or not re.fullmatch(r"[a-z][a-z0-9_]*", name):
            raise TypeError(f"encoding class {cls.__name__} must set its own name, lowercase letters, digits and "
                            f"underscores (name = \"rope\"); got {name!r}")
        known = Encoding.registered.get(name)
        if known is not None and known.__qualname__ != cls.__qualname__:
            raise TypeError(f"encoding name {name!r} of {cls.__name__} is taken by {known.__name__}")
        Encoding.registered[name] = cls

    def __post_init__(self):
        """Every Literal-typed setting is checked against its type, which is where its allowed values are written."""
        hints = typing.get_type_hints(type(self))
        for field in dataclasses.fields(self):
            allowed = typing.get_args(hints[field.name]) if typing.get_origin(hints[field.name]) is Literal else ()
            if allowed and getattr(self, field.name) not in allowed:
                raise ConfigError(f"{self.name}.{field.name}={getattr(self, field.name)!r} is not valid; "
                                  f"valid: {', '.join(map(str, allowed))}")

    def label(self, runtime: bool = True) -> str:
        """How runs (``runtime=False``), records, report columns, sweep and bench rows name the encoding."""
        return self.name

    def settings(self) -> dict:
        """The dataclass fields as plain values (a wrapped encoding as its own :meth:`to_dict`)."""
        return {f.name: (value.to_dict() if isinstance(value := getattr(self, f.name), Encoding) else value)
                for f in dataclasses.fields(self)}

    def to_dict(self) -> dict:
        """The form jsonargparse, checkpoints and exported config.json files hold; read back by
        :func:`registry.encoding_from` (through :func:`registry.encoding_class`). The class path is whole because
        jsonargparse resolves short names only at the top level, not for an encoding that another wraps."""
        return {"class_path": f"{type(self).__module__}.{type(self).__qualname__}", "init_args": self.settings()}

    def weight_settings(self, prefix: str = "pos_encoding") -> dict:
        """What defines the weights, flattened: ``{"pos_encoding": "rope", "pos_encoding.base": 10000.0}``."""
        out = {prefix: self.name}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, Encoding):
                out.update(value.weight_settings(f"{prefix}.{f.name}"))
            elif f.name not in self.runtime:
                out[f"{prefix}.{f.name}"] = value
        return out

    @classmethod
    def from_label_text(cls, text: str) -> "Encoding":
        """The encoding from the text after ``<name>-`` in a label that carries settings (``layers-rope@512x3-nope``);
        only encodings whose label carries settings accept one."""
        raise ConfigError(f"label {cls.name + '-' + text!r}: {cls.name}'s label carries no settings; give its "
                          "name alone")

    def longest_length(self, block_size: int) -> Optional[int]:
        """The most positions the encoding can serve (None: any), given the training length."""
        return None

    def check(self, config) -> None:
        """Checks against the backbone's shape (``config``: a BackboneConfig), before anything is built."""

    def build(self, config) -> "PositionalEncoding":
        return self.module(self, config)


class PositionalEncoding(nn.Module):
    """Base class of an encoding's module: every hook is the identity; an encoding overrides the hooks it needs."""

    def __init__(self, settings: Encoding, config):
        super().__init__()
        self.settings = settings
        self.n_head = config.n_head
        self.head_dim = config.n_embd // config.n_head
        self.causal = config.causal
        self.longest = settings.longest_length(config.original_length)

    # The attributes that hold one entry per layer along their first dimension (a parameter stacked over the layers, a
    # ModuleList, a list), which the hooks index by the layer's number: what :meth:`layer_view` cuts to one layer.
    per_layer: ClassVar[tuple[str, ...]] = ()
    # True on a :meth:`layer_view`, whose hooks take layer 0 for the one layer it holds.
    is_layer_view = False

    def layer_view(self, layer: int) -> "PositionalEncoding":
        """This encoding as layer ``layer`` alone sees it, as its layer 0: a shallow copy whose :attr:`per_layer`
        attributes hold that layer's entry only (slices of the same parameters: gradients reach them). A compiled
        block runs its hooks on a view, so a layer's weights are inputs of the one graph every layer shares; indexed
        by the layer's number, they made each layer a graph of its own (Dynamo makes the number a constant)."""
        view = copy.copy(self)
        view._parameters, view._buffers, view._modules = (dict(self._parameters), dict(self._buffers),
                                                          dict(self._modules))
        for name in self.per_layer:
            entry = getattr(self, name)[layer : layer + 1]
            view._parameters.pop(name, None)
            if isinstance(entry, nn.Module):
                view._modules[name] = entry
            else:
                object.__setattr__(view, name, entry)  # a slice of a parameter is no parameter of its own
        view.is_layer_view = True
        return view

    def hook_layer(self, layer: int) -> int:
        """The layer number the hooks take for layer ``layer``: itself, or 0 on a :meth:`layer_view`."""
        return 0 if self.is_layer_view else layer

    def check_length(self, total_length: int) -> None:
        """Raise :class:`UnsupportedLengthError` if this encoding cannot serve ``total_length`` positions."""
        if self.longest is not None and total_length > self.longest:
            raise UnsupportedLengthError(
                f"sequence length {total_length} exceeds the {self.settings.name} encoding's {self.longest} "
                f"positions; it cannot extrapolate: use lengths <= {self.longest} or a relative encoding")

    # Whether the encoding reads position indices (RoPE, ALiBi, absolute tables, ...) or only the order of the tokens
    # and their documents (NoPE, CABLE, FoX, CoPE, stick-breaking): randomized positions and PoSE's skips change
    # nothing for the latter, so asking for them there is an error (lit.layouts).
    reads_positions = True
    # Whether only differences of positions matter (a constant shift of every position changes nothing): False for
    # absolute tables and FIRE (its normaliser reads the query's own position).
    relative = True

    def check_layout(self, layout: Layout) -> None:
        """Raise :class:`UnsupportedLengthError` if the layout's positions are more than the encoding serves."""
        self.check_length(layout.extent)

    def embed(self, x: Tensor, offset: int, layout: Layout | None = None) -> Tensor:
        return x

    def rotate(self, q: Tensor, k: Tensor, offset: int, layer: int = 0,
               key_padding: Tensor | None = None, layout: Layout | None = None) -> tuple[Tensor, Tensor]:
        """q, k (B, H, T, D) of layer ``layer`` at positions offset..offset+T-1 (or the ``layout``'s);
        ``key_padding`` (B, T), True at real keys, in a padded bidirectional batch (real tokens first)."""
        return q, k

    def window(self, layer: int) -> int | Chunks | None:
        """The window of layer ``layer``: how many of the latest positions a query sees (an int), the chunks its
        attention is cut into (:class:`Chunks`), or None (all)."""
        return None

    def score_bias(self, h: Tensor, layer: int, offset: int, state: dict | None,
                   layout: Layout | None = None) -> ScoreBias | LogitScores | None:
        """``h``: the layer's normalised input (B, T, C) at positions offset..offset+T-1 (or the ``layout``'s);
        ``state``: this layer's decoding cache (a dict the PE may extend) or None."""
        return None

    def token_increments(self, h: Tensor, layer: int, layout: Layout | None = None) -> dict[str, Tensor]:
        """The per-token quantities a context-aware bias is built from, for the increment diagnostics
        (``eval.diagnostics``): name -> (B, H, T) at layer ``layer`` from its normalised input ``h``, ``increment``
        the one summed along the tokens. Empty for an encoding with none: only the encoding knows its own."""
        return {}


class OverBase(PositionalEncoding):
    """The module of an encoding that works over another (``settings.base``: DAPEv2, SSMax): positions, layouts,
    embeddings, rotations and windows are the base's, unless the wrapper adds to them."""

    def __init__(self, settings, config):
        super().__init__(settings, config)
        self.base = settings.base.build(config)

    def layer_view(self, layer):
        view = super().layer_view(layer)
        view._modules["base"] = self.base.layer_view(layer)
        return view

    @property
    def reads_positions(self):
        return self.base.reads_positions

    @property
    def relative(self):
        return self.base.relative

    def check_layout(self, layout):
        self.base.check_layout(layout)

    def embed(self, x, offset, layout=None):
        return self.base.embed(x, offset, **with_layout(layout))

    def rotate(self, q, k, offset, layer=0, key_padding=None, layout=None):
        return self.base.rotate(q, k, offset, layer, key_padding, **with_layout(layout))

    def window(self, layer):
        return self.base.window(layer)

    def token_increments(self, h, layer, layout=None):
        return self.base.token_increments(h, layer, **with_layout(layout))
