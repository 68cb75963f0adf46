"""A prepared folder, the checks that it is whole, and ``DataInfo``: what the model needs to know of the data.

``<out>/manifest.json`` (request, source, tokenizer identity, ids, token counts, versions), ``<out>/tokenizer.json``
(bpe:N only), ``<out>/train/`` (litdata token chunks) and ``<out>/val.npy`` (the held-out head as one flat array;
``test.npy`` too for wikitext-103). Every failure is one line naming the bad file and the command that rebuilds it.
"""

from __future__ import annotations

import contextlib
import json
import os
from dataclasses import asdict, dataclass, field
from typing import Any, Optional

import numpy as np

from ..errors import ConfigError, MissingFileError

MANIFEST, FORMAT_VERSION = "manifest.json", 2


def fix_command(path: str, request: dict[str, Any] | None = None) -> str:
    request = request or {}
    return (f"python -m cable_lightning prepare --source {request.get('source', '<source>')} "
            f"--tokenizer {request.get('tokenizer', '<tokenizer>')} --out {path} --overwrite")


def read_manifest(path: str, check_files: bool = True, check_train: bool = True) -> dict[str, Any]:
    """Load ``<path>/manifest.json``; with ``check_files`` also prove every split's files are there and whole (the
    training chunks only with ``check_train``: a remote prefix's are checked against the bucket's listing)."""
    manifest_path = os.path.join(path, MANIFEST)
    if not os.path.isfile(manifest_path):
        what = "no prepared data at" if not os.path.isdir(path) else f"no {MANIFEST} (not prepared, or unfinished) in"
        raise MissingFileError(f"{what} {path}; run {fix_command(path)}")
    try:
        with open(manifest_path, "rb") as f:
            raw = f.read()
    except OSError as exc:
        raise ConfigError(f"{manifest_path} cannot be read ({exc}); run {fix_command(path)}") from None
    manifest = parse_manifest(raw, path)
    for split in manifest["splits"] if check_files else ():
        if split != "train":
            load_split(path, split, manifest)
        elif check_train:
            index, sizes = None, {}
            with contextlib.suppress(OSError):
                with open(os.path.join(path, "train", "index.json"), "rb") as f:
                    index = f.read()
            with contextlib.suppress(OSError):
                sizes = {f"train/{name}": os.path.getsize(os.path.join(path, "train", name))
                         for name in os.listdir(os.path.join(path, "train"))}
            check_chunks(path, manifest, index, sizes)
    return manifest


def parse_manifest(raw: bytes, path: str) -> dict[str, Any]:
    """A manifest's text, checked: the fields every reader needs and this code's format."""
    manifest_path = f"{path}/{MANIFEST}"
    try:
        manifest = json.loads(raw)
        dict(manifest["splits"]["train"]), manifest["tokenizer"]["identity"]["hash"], int(manifest["vocab_size"])
    except (ValueError, KeyError, TypeError) as exc:
        raise ConfigError(f"{manifest_path} is corrupt ({type(exc).__name__}: {exc}); "
                          f"run {fix_command(path)}") from None
    if manifest.get("format") != FORMAT_VERSION:
        raise ConfigError(f"{manifest_path} has format {manifest.get('format')!r}, this code reads {FORMAT_VERSION}; "
                          f"run {fix_command(path, manifest.get('request'))}")
    return manifest


def check_chunks(path: str, manifest: dict[str, Any], index: bytes | None, sizes: dict[str, int]) -> None:
    """The chunk index (raw ``train/index.json``, None when missing) names only chunks found at its sizes; ``sizes``
    maps ``train/<file>`` to the size found (a local folder's files or a bucket's objects)."""
    fix = fix_command(path, manifest.get("request"))
    try:
        chunks = json.loads(index)["chunks"] if index is not None else None
        if chunks is None:
            raise FileNotFoundError("missing")
    except (ValueError, KeyError, TypeError, FileNotFoundError) as exc:
        raise ConfigError(f"{path}/train/index.json is missing or corrupt ({type(exc).__name__}); run {fix}") from None
    for chunk in chunks:
        size = sizes.get(f"train/{chunk['filename']}")
        if size != chunk["chunk_bytes"]:
            state = "missing" if size is None else f"{size} bytes, its index says {chunk['chunk_bytes']}"
            raise ConfigError(f"chunk {path}/train/{chunk['filename']} is {state} (truncated or deleted); run {fix}")


def load_split(path: str, split: str, manifest: dict[str, Any]) -> np.ndarray:
    """A held-out split as a read-only memory map of its tokens, checked against the manifest's count."""
    if split not in manifest["splits"]:
        raise ConfigError(f"{path} has no {split!r} split (it has {', '.join(manifest['splits'])})")
    file, expected = os.path.join(path, manifest["splits"][split]["file"]), manifest["splits"][split]["tokens"]
    try:
        tokens = np.load(file, mmap_mode="r")
        if tokens.shape != (expected,):
            raise ConfigError(f"{tokens.shape} tokens, the manifest says {expected}")
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{file} is missing or corrupt ({exc}); "
                          f"run {fix_command(path, manifest.get('request'))}") from None
    return tokens


@dataclass(frozen=True)
class DataInfo:
    """What the model takes from the data: read once from the manifest, linked into the model by the CLI, and
    stored in checkpoints as plain values (``as_dict``) so that they load with ``torch.load(weights_only=True)``."""

    vocab_size: int
    eot_id: int
    mask_id: Optional[int]
    special_ids: tuple[int, ...]
    tokenizer: dict[str, str]  # identity: kind, name, vocabulary hash
    block_size: int
    eval_specs: tuple[tuple[int, int], ...]  # (length, stride) per evaluation loader
    # What training sees of a block (documents, positions, length schedule): data.layout's settings, as plain values
    # (data/layouts.py); empty: packed blocks at contiguous positions
    layout: dict[str, Any] = field(default_factory=dict)
    # The tasks a run of tasks alone (task_fraction 1) trains on, {name: every setting}: the only tasks its weights
    # can be scored on (validate refuses others); None when the corpus is trained on too (a text model's passkey)
    tasks_alone: Optional[dict[str, dict[str, Any]]] = None

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> DataInfo:
        specs = tuple(tuple(spec) for spec in values["eval_specs"])
        return cls(**{**values, "special_ids": tuple(values["special_ids"]), "eval_specs": specs})

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "special_ids": list(self.special_ids), "eval_specs": [list(s) for s in self.eval_specs]}

    def check_tokenizer(self, trained_with: dict[str, str]) -> None:
        """Raise when a checkpoint's tokenizer identity is not this data's."""
        if (trained_with.get("hash"), trained_with.get("kind")) != (self.tokenizer["hash"], self.tokenizer["kind"]):
            raise ConfigError(
                f"checkpoint was trained with tokenizer {trained_with.get('name')!r} "
                f"(hash {str(trained_with.get('hash'))[:12]}) "
                f"but the data uses {self.tokenizer['name']!r} (hash {self.tokenizer['hash'][:12]}); prepare the data "
                f"with --tokenizer {trained_with.get('name')} or point data.path at the matching data")
