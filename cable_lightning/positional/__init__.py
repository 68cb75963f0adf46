"""Pluggable positional encodings, selected by name (see :func:`available`).

Every module of this package is imported here, so an encoding's file registers it: adding an encoding is one file
(and its row in the README's table, which a test checks)."""

import importlib
import pkgutil

from .base import ENCODING_FLAG, Encoding, LogitScores, PositionalEncoding, ScoreBias, UnsupportedLengthError
from .registry import (
    available,
    build_positional,
    encoding_class,
    encoding_from,
    from_label,
    score_bias_encodings,
    wrappers,
)

for _module in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_module.name}")

__all__ = ["ENCODING_FLAG", "Encoding", "LogitScores", "PositionalEncoding", "ScoreBias", "UnsupportedLengthError",
           "available", "build_positional", "encoding_class", "encoding_from", "from_label", "score_bias_encodings",
           "wrappers"]
