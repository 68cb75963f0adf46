"""Encodings by name. Every :class:`Encoding` subclass registers itself under its ``name`` when its file is
imported (``positional/__init__.py`` imports every file of the package), so no list of encodings is written
anywhere else: configs, tests, tools and the README's table all read :func:`available`.

An encoding is named in configs and checkpoints three ways, all read by :func:`encoding_class`: its name (``rope``),
its class path (``cable_lightning.positional.rope.Rope``), and the class path that records and checkpoints written
when the classes were named as the encodings hold (``cable_lightning.positional.rope.rope``), which still loads."""

from __future__ import annotations

import dataclasses
import re
import typing

from ..errors import ConfigError
from .base import Encoding


def available() -> list[str]:
    """The names ``backbone.pos_encoding`` accepts."""
    return sorted(Encoding.registered)


def class_path(cls: type) -> str:
    """The dotted path of an encoding's class, as :meth:`Encoding.to_dict` writes it."""
    return f"{cls.__module__}.{cls.__qualname__}"


def named_class(text: str) -> type | None:
    """The encoding class that ``text`` names (a name, a class path, or a class path ending in the name: see the
    module's docstring), or None. A class path is matched by its last two parts, the file and the class or name, so
    the copy of this package inside an exported folder reads the same paths."""
    if text in Encoding.registered:
        return Encoding.registered[text]
    module, _, last = str(text).rpartition(".")
    for cls in Encoding.registered.values():
        if last in (cls.__qualname__, cls.name) and module.rpartition(".")[2] == cls.__module__.rpartition(".")[2]:
            return cls
    return None


def encoding_class(name: str) -> type:
    """The encoding class of a name or class path (:func:`named_class`); an unknown one is a one-line error."""
    cls = named_class(name)
    if cls is None:
        raise ConfigError(f"unknown positional encoding {name!r}; valid names: {', '.join(available())}")
    return cls


def score_bias_encodings() -> list[str]:
    """The encodings whose bias is a pointwise :class:`ScoreBias` (what DAPEv2 can augment)."""
    return [name for name in available() if Encoding.registered[name].scores in ("bias", "foldable_bias")]


def wrapped_setting(cls: type) -> str | None:
    """The setting through which an encoding wraps another (one typed :class:`Encoding`: DAPEv2's ``base``), or None."""
    hints = typing.get_type_hints(cls)
    return next((f.name for f in dataclasses.fields(cls) if hints[f.name] is Encoding), None)


def wrappers() -> list[str]:
    """The encodings that wrap another: ``dape_v2``."""
    return [name for name in available() if wrapped_setting(Encoding.registered[name])]


def from_label(label: str) -> Encoding:
    """An encoding with default settings from its label: ``cable``, ``dape_v2+cable`` for a wrapper around another,
    ``layers-rope@512x3-nope`` for one whose label carries its settings (the inverse of :meth:`Encoding.label` for
    default settings; sweeps and benchmarks name encodings this way)."""
    head = re.match(r"[a-z0-9_]*", label).group(0)
    separator, rest = label[len(head) : len(head) + 1], label[len(head) + 1 :]
    cls = encoding_class(head if separator in ("", "+", "-") else label)
    if not separator:
        return cls()
    if separator == "-":
        return cls.from_label_text(rest)
    if head not in wrappers():
        raise ConfigError(f"{label!r}: {head!r} does not wrap another encoding; a label W+E needs W in: "
                          f"{', '.join(wrappers())}")
    return cls(**{wrapped_setting(cls): from_label(rest)})


def encoding_from(value) -> Encoding:
    """An :class:`Encoding` from any form a config holds: an instance, a label (``rope``, ``dape_v2+cable``), or the
    ``{"class_path": ..., "init_args": {...}}`` of :meth:`Encoding.to_dict` and jsonargparse (a class path is looked
    up in the registry, :func:`named_class`; nothing is imported from it)."""
    if isinstance(value, Encoding):
        return value
    if isinstance(value, str):
        return from_label(value)
    if isinstance(value, dict) and "class_path" in value:
        cls = encoding_class(str(value["class_path"]))
        settings = dict(value.get("init_args") or {})
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(settings) - known)
        if unknown:
            raise ConfigError(f"{cls.name} has no setting {unknown[0]!r}; its settings: "
                              f"{', '.join(sorted(known)) or 'none'}")
        return cls(**settings)  # a wrapper reads the encoding it wraps through encoding_from itself
    raise ConfigError(f"pos_encoding {value!r} is not an encoding; give a name ({', '.join(available())}) or "
                      "{class_path: <name>, init_args: {...}}")


def build_positional(config):
    """The module of ``config.pos_encoding`` for a backbone of ``config``'s shape (a :class:`BackboneConfig`)."""
    return config.pos_encoding.build(config)
