"""Evaluation lengths as configs write them: a list of lengths, where a range stands for every length it spans, so
that a grid of hundreds of lengths is one line (``task_eval.lengths: 1..500``). Read here alone, for every length
setting (``data.eval_lengths``, ``task_eval.lengths``)."""

from __future__ import annotations

import re
from typing import Union

from ..errors import ConfigError

# What a length setting accepts: a length, a range, or a list of lengths and ranges (jsonargparse's type).
Lengths = Union[list[Union[int, str]], str, int]

RANGE = re.compile(r"(\d+)\s*\.\.\s*(\d+)(?:\s+step\s+(\d+))?")
FORMS = "a length >= 1, a range START..STOP (both included; START..STOP step N: every Nth), or a list of them"


def length_list(value: Lengths, setting: str) -> list[int]:
    """Every length ``value`` gives, in its order: ``128``, ``"1..500"``, ``"60..500 step 20"``, or a list of those
    (``[10, 20, 30, 40, "41..500"]``). A bad entry is a one-line error naming ``setting`` and the entry."""
    entries = value if isinstance(value, (list, tuple)) else [value]
    lengths: list[int] = []
    for entry in entries:
        found = RANGE.fullmatch(entry.strip()) if isinstance(entry, str) else None
        if isinstance(entry, str) and entry.strip().isdigit():
            entry = int(entry)
        if isinstance(entry, int) and not isinstance(entry, bool) and entry >= 1:
            lengths.append(entry)
        elif found and 1 <= int(found[1]) <= int(found[2]) and int(found[3] or 1) >= 1:
            lengths += range(int(found[1]), int(found[2]) + 1, int(found[3] or 1))
        else:
            raise ConfigError(f"{setting}: {entry!r} is not {FORMS} (e.g. 1..500 or [10, 20, 41..500])")
    if not lengths:
        raise ConfigError(f"{setting} is empty; give {FORMS}")
    return lengths
