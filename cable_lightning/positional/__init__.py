"""Pluggable positional encodings, selected by name (see :func:`available`)."""

from . import absolute, alibi, cable, cope, fire, kerple, rope, t5  # noqa: F401  (registers every PE)
from .base import LogitScores, PositionalEncoding, ScoreBias, UnsupportedLengthError
from .registry import available, build_positional, score_bias_encodings

__all__ = ["LogitScores", "PositionalEncoding", "ScoreBias", "UnsupportedLengthError", "available", "build_positional",
           "score_bias_encodings"]
