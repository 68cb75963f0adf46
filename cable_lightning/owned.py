"""Owned replacement: every folder the tools write (``export``, ``prepare``, ``tools/retrieval.py finetune``) carries
a marker naming what wrote it, and ``--overwrite`` replaces only a folder with the same writer's marker, never one
that holds an input of the same command. The new folder is built in a private temporary folder beside the target
and swapped in by rename."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from typing import Iterable, Optional

from .errors import TargetExistsError

MARKER = ".cable_lightning.json"
LEGACY_MARKERS = {"prepare": "manifest.json"}  # folders prepared before the marker existed


def write_marker(folder: str, writer: str) -> None:
    with open(os.path.join(folder, MARKER), "w", encoding="utf-8") as f:
        json.dump({"written_by": writer}, f)


def written_by(folder: str) -> Optional[str]:
    """The writer named by ``folder``'s marker, or None (not a folder, no marker, or an unreadable one)."""
    try:
        with open(os.path.join(folder, MARKER), encoding="utf-8") as f:
            return str(json.load(f).get("written_by"))
    except (OSError, ValueError, AttributeError):
        pass
    return next((writer for writer, name in LEGACY_MARKERS.items()
                 if os.path.isfile(os.path.join(folder, name))), None)


def _inside(path: str, folder: str) -> bool:
    path, folder = os.path.realpath(path), os.path.realpath(folder)
    return path == folder or path.startswith(folder.rstrip(os.sep) + os.sep)


def check_replaceable(out: str, writer: str, overwrite: bool, inputs: Iterable[Optional[str]] = (),
                      option: str = "--out") -> None:
    """Before any work: ``out`` may be written. It must not hold (or be) one of the command's ``inputs``; an existing
    ``out`` that is not empty needs ``overwrite`` and ``writer``'s marker. The advice given is safe to follow."""
    for given in inputs:
        if given and "://" not in str(given) and _inside(given, out):
            raise TargetExistsError(f"{option} {out} holds this command's input {given}; replacing it would delete "
                                    f"the input: choose another {option}")
    if not os.path.lexists(out) or (os.path.isdir(out) and not os.path.islink(out) and not os.listdir(out)):
        return
    owner = written_by(out) if os.path.isdir(out) and not os.path.islink(out) else None
    if owner != writer:
        raise TargetExistsError(f"{out} already exists and was not written by {writer} ("
                                f"{'written by ' + owner if owner else 'no ' + MARKER + ' marker'}); choose another "
                                f"{option} (--overwrite replaces only a folder {writer} wrote)")
    if not overwrite:
        raise TargetExistsError(f"{out} already exists (written by {writer}); pass --overwrite to replace it or choose "
                                f"another {option}")


def staging_folder(out: str) -> str:
    """A new private folder beside ``out`` (same filesystem, so the final rename is atomic)."""
    parent = os.path.dirname(os.path.abspath(out))
    os.makedirs(parent, exist_ok=True)
    return tempfile.mkdtemp(prefix=f".{os.path.basename(os.path.abspath(out))}.partial-", dir=parent)


def swap_in(staged: str, out: str, writer: str) -> None:
    """Mark ``staged`` as ``writer``'s and move it to ``out`` by rename; an old ``out`` (checked replaceable) is
    renamed aside first and removed after, so a kill leaves the old folder (as ``.<name>.old-*`` in the instant
    between the renames) or the new one, never a mixture."""
    write_marker(staged, writer)
    out = os.path.abspath(out)
    old = None
    if os.path.lexists(out):
        old = tempfile.mkdtemp(prefix=f".{os.path.basename(out)}.old-", dir=os.path.dirname(out))
        os.rename(out, os.path.join(old, "folder"))
    os.rename(staged, out)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
