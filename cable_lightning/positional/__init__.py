"""Pluggable positional encodings, selected by name (see :func:`available`)."""

from . import absolute, alibi, cable, fire, kerple, rope, t5  # noqa: F401  (registers every PE)
from .base import PositionalEncoding, ScoreBias, UnsupportedLengthError
from .registry import available, build_positional

__all__ = ["PositionalEncoding", "ScoreBias", "UnsupportedLengthError", "available", "build_positional"]
