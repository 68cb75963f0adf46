"""One reader for the JSON-lines records the package and its tools read (``length_eval.jsonl``, ``passkey.jsonl``,
BEIR-style ``corpus.jsonl``/``queries.jsonl``): a bad row is an error naming the file and line, and a truncated last
line (a writer killed mid-row) is skipped with a word."""

from __future__ import annotations

import json
import sys
from typing import Iterable

from .errors import ConfigError, MissingFileError


def read_jsonl(path: str, required: Iterable[str] = ()) -> list[dict]:
    """The rows of ``path`` (blank lines skipped), each an object holding the ``required`` keys."""
    required = tuple(required)
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.read().split("\n")
    except FileNotFoundError:
        raise MissingFileError(f"{path} does not exist") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{path} cannot be read ({type(exc).__name__}: {exc})") from None
    rows = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            if number == len(lines):  # no newline after it: the writer stopped in the middle of this row
                print(f"{path}:{number}: skipping a truncated last line", file=sys.stderr, flush=True)
                continue
            raise ConfigError(f"{path}:{number}: not a JSON record ({exc.msg}); fix or remove that line") from None
        missing = [key for key in required if not isinstance(row, dict) or key not in row]
        if missing:
            raise ConfigError(f"{path}:{number}: the row lacks {', '.join(missing)} (another record format?); "
                              f"valid rows have {', '.join(required)}")
        rows.append(row)
    return rows
