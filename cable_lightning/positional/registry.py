"""Name -> positional-encoding class, so a config selects a PE by name."""

from __future__ import annotations

from ..errors import ConfigError

_REGISTRY: dict[str, type] = {}


def register(name: str):
    def add(cls):
        _REGISTRY[name] = cls
        return cls

    return add


def available() -> list[str]:
    """The names every config field ``pos_encoding`` accepts."""
    return sorted(_REGISTRY)


def score_bias_encodings() -> list[str]:
    """The PEs whose bias is a pointwise :class:`ScoreBias` (what DAPEv2 can augment)."""
    return [name for name in available() if _REGISTRY[name].has_score_bias]


def build_positional(config):
    name = config.pos_encoding
    if name not in _REGISTRY:
        raise ConfigError(f"unknown positional encoding {name!r}; valid names: {', '.join(available())}")
    return _REGISTRY[name](config)
