"""The records a run writes beside its TensorBoard events, one JSON object a line: each kind is a dataclass with
its file name, written by :func:`append_records` and read back by :func:`read_records` (the report's input).

Every record carries its run's context (the encoding's label, the training length, the stage that wrote it) and
the step and checkpoint it measured, so a file can be read on its own.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass
from typing import ClassVar, Optional


@dataclass
class Record:
    """What every record says about where it comes from."""

    FILE: ClassVar[str]

    pe: str  # the encoding's label: cable, dape_v2+cable, rope+linear4
    train_length: int
    step: int
    stage: str = "fit"  # or validate, test
    checkpoint: Optional[str] = None  # the checkpoint a validate/test measured (None: the weights of the running fit)


@dataclass
class LengthRecord(Record):
    """Perplexity at one evaluation length and window mode."""

    FILE: ClassVar[str] = "length_eval.jsonl"

    length: int = 0
    mode: str = "nonoverlap"  # or sliding
    stride: int = 0
    ppl: Optional[float] = None  # None: the encoding cannot serve this length
    loss: Optional[float] = None
    tokens: int = 0
    seconds: float = 0.0
    tokens_per_sec: Optional[float] = None


@dataclass
class PositionRecord(Record):
    """Mean loss over one bucket of token positions of the non-overlapping windows of one length."""

    FILE: ClassVar[str] = "position_loss.jsonl"

    length: int = 0
    mode: str = "nonoverlap"
    stride: int = 0
    first_position: int = 0
    last_position: int = 0
    loss: Optional[float] = None
    tokens: int = 0


@dataclass
class PasskeyRecord(Record):
    """Passkey-retrieval accuracy at one prompt length and depth."""

    FILE: ClassVar[str] = "passkey.jsonl"

    seed: int = 0
    length: int = 0
    depth: float = 0.0
    trials: int = 0
    correct: Optional[int] = None
    accuracy: Optional[float] = None  # None: the encoding cannot serve this length


def append_records(folder: str, records: list[Record]) -> None:
    """Append records, each kind to its own file in ``folder``."""
    os.makedirs(folder, exist_ok=True)
    for kind in {type(r) for r in records}:
        with open(os.path.join(folder, kind.FILE), "a", encoding="utf-8") as f:
            for record in records:
                if type(record) is kind:
                    f.write(json.dumps(dataclasses.asdict(record)) + "\n")


def read_records(path: str, kind: type[Record]) -> list[Record]:
    """The records of one file; keys an earlier version wrote and this one does not know are ignored."""
    known = {f.name for f in dataclasses.fields(kind)}
    with open(path, encoding="utf-8") as f:
        return [kind(**{k: v for k, v in json.loads(line).items() if k in known}) for line in f if line.strip()]
