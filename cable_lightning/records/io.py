"""Record files, one JSON object a line, beside a run's TensorBoard events: each kind is written to its own file by
:func:`append_records` and read back by :func:`read_records` (the report's input). Every JSON-lines file the package
and its tools read (records, BEIR-style ``corpus.jsonl``/``queries.jsonl``) goes through :func:`read_jsonl`: a bad
row is an error naming the file and line, and a truncated last line (a writer killed mid-row) is skipped with a word;
the report leaves out the evaluation such a line ends (:func:`complete_records`).
"""

from __future__ import annotations

import dataclasses
import glob
import hashlib
import json
import os
import re
import sys
from typing import Any, Callable, Iterable

from ..errors import ConfigError, MissingFileError, RunFailedError, space_left
from .schema import LengthRecord, Record


def content_hash(paths: Iterable[str]) -> str:
    """sha256 over the files' contents, in order (each preceded by its size, so that where one ends counts): what
    names a retrieval set (its corpus, queries and qrels) and the checkpoint an export came from, whatever folder
    they are in."""
    digest = hashlib.sha256()
    for path in paths:
        try:
            with open(path, "rb") as f:
                digest.update(f"{os.fstat(f.fileno()).st_size}\n".encode())
                while chunk := f.read(1 << 20):
                    digest.update(chunk)
        except FileNotFoundError:
            raise MissingFileError(f"{path} does not exist") from None
        except OSError as exc:
            raise ConfigError(f"{path} cannot be read ({type(exc).__name__}: {exc})") from None
    return digest.hexdigest()


def append_records(folder: str, records: list[Record]) -> None:
    """Append records, each kind to its own file in ``folder``; a failed write (a full disk) is an error naming the
    file."""
    for kind in {type(r) for r in records}:
        path = os.path.join(folder, kind.FILE)
        try:
            os.makedirs(folder, exist_ok=True)
            with open(path, "a", encoding="utf-8") as f:
                for record in records:
                    if type(record) is kind:
                        f.write(json.dumps(dataclasses.asdict(record)) + "\n")
        except OSError as exc:
            raise RunFailedError(f"could not write the records {path} ({type(exc).__name__}: {exc}; "
                                 f"{space_left(path)}); the checkpoints written before it are intact") from exc


def write_records(path: str, records: list) -> None:
    """Write ``path`` anew, one record a line (an export's own records, written once into its staging folder)."""
    try:
        with open(path, "w", encoding="utf-8") as f:
            f.writelines(json.dumps(dataclasses.asdict(record)) + "\n" for record in records)
    except OSError as exc:
        raise RunFailedError(f"could not write the records {path} ({type(exc).__name__}: {exc}; "
                             f"{space_left(path)})") from exc


def skip_torn(path: str, number: int, text: str) -> None:
    print(f"{path}:{number}: skipping a truncated last line", file=sys.stderr, flush=True)


def read_jsonl(path: str, required: Iterable[str] = (), make: Callable[[dict], Any] = dict,
               torn: Callable[[str, int, str], None] = skip_torn) -> list:
    """The rows of ``path`` (blank lines skipped), each an object holding the ``required`` keys, made into
    ``make(row)``; a ValueError from ``make`` is an error naming the line. A truncated last line (no newline after
    it: the writer stopped mid-row) is left out and handed to ``torn`` (path, line number, its text)."""
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
                torn(path, number, line)
                continue
            raise ConfigError(f"{path}:{number}: not a JSON record ({exc.msg}); fix or remove that line") from None
        missing = [key for key in required if not isinstance(row, dict) or key not in row]
        if missing:
            raise ConfigError(f"{path}:{number}: the row lacks {', '.join(missing)} (another record format?); "
                              f"valid rows have {', '.join(required)}")
        try:
            rows.append(make(row))
        except ValueError as exc:
            raise ConfigError(f"{path}:{number}: {exc}; fix or remove that line") from None
    return rows


def read_records(path: str, kind: type, torn: Callable[[str, int, str], None] = skip_torn) -> list:
    """The records of one file (through :func:`read_jsonl`); keys an earlier version wrote and this one does not
    know are ignored, and a row without a field that has no default is an error naming its line."""
    fields = dataclasses.fields(kind)
    required = [f.name for f in fields if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
    known = {f.name for f in fields}

    def make(row: dict) -> Record:
        record = kind(**{k: v for k, v in row.items() if k in known})
        if problem := record.out_of_range():
            raise ValueError(problem)
        return record

    return read_jsonl(path, required, make, torn)


def find_records(paths: list[str], name: str = LengthRecord.FILE, required: bool = True) -> list[str]:
    """Every ``name`` under the folders in ``paths`` (and the files so named; length records: any file a path's
    pattern matches), each once, oldest first; none is an error naming the paths when ``required``."""
    files = []
    for path in paths:
        if os.path.isdir(path):
            files += glob.glob(os.path.join(path, "**", name), recursive=True)
        elif os.path.basename(path) == name or name == LengthRecord.FILE:
            files += glob.glob(path)
    if not files and required:
        raise MissingFileError(f"no {name} under {', '.join(paths)}; train or validate a run first")
    return sorted(set(files), key=os.path.getmtime)  # the order they were written: later evaluations win


def complete_records(path: str, kind: type[Record]) -> list[Record]:
    """The records of ``path`` without an evaluation a writer stopped in the middle of: a file whose last line is
    torn (a run killed as it wrote an evaluation's rows) leaves out the rows of the evaluation that line ends (the
    last rows of one run and step), said in one line with the run's evaluation now taken as its latest. Kept, that
    evaluation was the run's latest with only the lengths written before the kill (an empty table, without a word).
    A torn line whose step shows that it began another evaluation leaves the one before it whole."""
    torn: list[tuple[int, str]] = []
    rows = read_records(path, kind, lambda _, number, text: torn.append((number, text)))
    if not torn:
        return rows
    (number, text), last = torn[0], rows[-1] if rows else None
    began = re.search(r'"step": (\d+)[,}]', text)
    if last is None or began is not None and int(began.group(1)) != last.step:
        print(f"{path}:{number}: skipping a torn last line (a writer stopped mid-row; it began an evaluation of "
              "which nothing else was written)", file=sys.stderr, flush=True)
        return rows
    cut = len(rows)
    while cut and (rows[cut - 1].run_key(), rows[cut - 1].step) == (last.run_key(), last.step):
        cut -= 1
    kept = [row.step for row in rows[:cut] if row.run_key() == last.run_key()]
    print(f"{path}:{number}: a torn last line (a writer stopped mid-row): the evaluation it ends, {last.run_name()} at "
          f"step {last.step}, is incomplete ({len(rows) - cut} whole row{'s' * (len(rows) - cut != 1)}) and left out; "
          + (f"this file's latest complete evaluation of that run is step {max(kept)}" if kept
             else "this file holds no complete evaluation of that run; validate its checkpoint again"),
          file=sys.stderr, flush=True)
    return rows[:cut]
