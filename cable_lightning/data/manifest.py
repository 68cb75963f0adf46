"""The manifest that prepare writes beside the token chunks, and the checks that a prepared folder is whole.

Layout of a prepared folder::

    <out>/manifest.json     source, tokenizer identity, ids, token counts per split, versions
    <out>/tokenizer.json    only for bpe:N (the trained tokenizer)
    <out>/train/            litdata token chunks (index.json + chunk-*.bin), read with TokensLoader
    <out>/val/              the same for validation (and <out>/test/ when the source has a test split)
"""

from __future__ import annotations

import json
import os
from typing import Any

MANIFEST = "manifest.json"
FORMAT_VERSION = 1


def fix_command(path: str, manifest: dict[str, Any] | None = None, overwrite: bool = False) -> str:
    """The prepare command that would (re)build ``path``, from the recorded request when there is one."""
    request = (manifest or {}).get("request") or {}
    cmd = (
        f"python -m cable_lightning.data.prepare --source {request.get('source', '<source>')} "
        f"--tokenizer {request.get('tokenizer', '<tokenizer>')} --out {path}"
    )
    return cmd + (" --overwrite" if overwrite else "")


def _load_json(path: str, fix: str, validate: Any) -> dict[str, Any]:
    """Parse a JSON file and run ``validate`` on it; any failure is one ValueError naming the file and the fix."""
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
        validate(data)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"{path} is corrupt ({type(exc).__name__}: {exc}); run {fix}") from None
    return data


def _validate_manifest(manifest: dict[str, Any]) -> None:
    dict(manifest["splits"]), manifest["tokenizer"]["identity"]["hash"]
    int(manifest["vocab_size"]), int(manifest["eot_id"]), int(manifest["mask_id"])


def _validate_index(index: dict[str, Any]) -> None:
    if not index["chunks"]:
        raise ValueError("it lists no chunks")


def read_manifest(path: str, check_shards: bool = True) -> dict[str, Any]:
    """Load ``<path>/manifest.json``; with ``check_shards`` also prove every listed chunk exists at full size.

    Every failure is one line naming the bad path and the command that rebuilds it.
    """
    path = str(path)
    mpath = os.path.join(path, MANIFEST)
    if not os.path.isdir(path):
        raise FileNotFoundError(f"no prepared data at {path}; run {fix_command(path)}")
    if not os.path.isfile(mpath):
        raise FileNotFoundError(f"{path} has no {MANIFEST} (not prepared, or prepared by something else); run {fix_command(path, overwrite=True)}")
    manifest = _load_json(mpath, fix_command(path, overwrite=True), _validate_manifest)
    if manifest.get("format") != FORMAT_VERSION:
        raise ValueError(f"{mpath} has format {manifest.get('format')!r}, this code reads {FORMAT_VERSION}; run {fix_command(path, manifest, True)}")
    if check_shards:
        for split in manifest["splits"]:
            check_split(path, split, manifest)
    return manifest


def check_split(path: str, split: str, manifest: dict[str, Any] | None = None) -> dict[str, Any]:
    """Validate ``<path>/<split>/index.json`` and the chunk files it lists; returns the index."""
    index_path = os.path.join(path, split, "index.json")
    fix = fix_command(path, manifest, overwrite=True)
    if not os.path.isfile(index_path):
        raise FileNotFoundError(f"missing {index_path} (split {split!r} of {path}); run {fix}")
    index = _load_json(index_path, fix, _validate_index)
    for chunk in index["chunks"]:
        chunk_path = os.path.join(path, split, chunk["filename"])
        if not os.path.isfile(chunk_path):
            raise FileNotFoundError(f"missing chunk {chunk_path}; run {fix}")
        if os.path.getsize(chunk_path) != chunk["chunk_bytes"]:
            raise ValueError(
                f"chunk {chunk_path} has {os.path.getsize(chunk_path)} bytes, its index says {chunk['chunk_bytes']} "
                f"(truncated or overwritten); run {fix}"
            )
    return index


def split_tokens(index: dict[str, Any]) -> int:
    """Tokens stored in a split (the sum of its chunks' token counts)."""
    return sum(int(c["dim"]) for c in index["chunks"])
