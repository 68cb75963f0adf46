"""Owned replacement: every folder the tools write (``export``, ``prepare``, ``retrieval finetune``) carries
a marker naming what wrote it (a single file, ``gpu-check``'s results, starts with its writer's heading), and
``--overwrite`` replaces only what the same writer marked, never one that holds an input of the same command. The
new folder is built in a private temporary folder beside the target and swapped in by rename. A run holds a lock on
each folder it stages or retires (``flock`` on the folder itself, so the lock ends with the process however it
ends): a marked folder of that kind that nobody holds is a killed run's leftover, and the writer's next run removes
it."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import tempfile
from typing import Iterable, Optional

from .errors import TargetExistsError

MARKER = ".cable_lightning.json"
LEGACY_MARKERS = {"prepare": "manifest.json"}  # folders prepared before the marker existed
FILE_MARKS = {"gpu-check": "## gpu-check: "}  # the first line of each file a tool writes whole


def write_marker(folder: str, writer: str) -> None:
    with open(os.path.join(folder, MARKER), "w", encoding="utf-8") as f:
        json.dump({"written_by": writer}, f)


def written_by(folder: str) -> Optional[str]:
    """The writer named by ``folder``'s marker (a file's: its first line), or None (no marker, or an unreadable
    one)."""
    if os.path.isfile(folder):
        try:
            with open(folder, encoding="utf-8", errors="replace") as f:
                first = f.readline(256)
        except OSError:
            return None
        return next((writer for writer, mark in FILE_MARKS.items() if first.startswith(mark)), None)
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
    owner = written_by(out) if not os.path.islink(out) else None
    if owner != writer:
        mark = f"its first line is not {FILE_MARKS[writer]!r}" if writer in FILE_MARKS else f"no {MARKER} marker"
        raise TargetExistsError(f"{out} already exists and was not written by {writer} ("
                                f"{'written by ' + owner if owner else mark}); choose another "
                                f"{option} (--overwrite replaces only what {writer} wrote)")
    if not overwrite:
        raise TargetExistsError(f"{out} already exists (written by {writer}); pass --overwrite to replace it or choose "
                                f"another {option}")


_held: dict[str, int] = {}  # folder -> the descriptor that holds its lock while this process works in it


def _hold(folder: str, writer: str) -> None:
    write_marker(folder, writer)
    fd = os.open(folder, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:  # a filesystem without flock (some NFS): no run can take the lock, so none removes the folder
        pass
    _held[folder] = fd


def discard(folder: str) -> None:
    """Removes a folder this process staged or retired, its marker last (a kill in the middle leaves a leftover that
    is still marked, so the next run removes it), and lets its lock go."""
    if os.path.isdir(folder):
        for entry in os.scandir(folder):
            if entry.name != MARKER:
                with contextlib.suppress(OSError):
                    shutil.rmtree(entry.path) if entry.is_dir(follow_symlinks=False) else os.remove(entry.path)
        shutil.rmtree(folder, ignore_errors=True)
    fd = _held.pop(folder, None)
    if fd is not None:
        os.close(fd)


def remove_leftovers(out: str, writer: str) -> list[str]:
    """Removes the folders killed runs of ``writer`` left beside ``out`` (``.<name>.partial-*`` being built,
    ``.<name>.old-*`` being removed): only those ``writer``'s marker names and no live process holds."""
    parent, base = os.path.split(os.path.abspath(out))
    removed = []
    for name in sorted(os.listdir(parent)) if os.path.isdir(parent) else ():
        folder = os.path.join(parent, name)
        if (not name.startswith((f".{base}.partial-", f".{base}.old-")) or folder in _held
                or os.path.islink(folder) or not os.path.isdir(folder)
                or not os.path.isfile(os.path.join(folder, MARKER)) or written_by(folder) != writer):
            continue
        fd = os.open(folder, os.O_RDONLY)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:  # a live run's (or a filesystem without flock: kept)
            continue
        else:
            shutil.rmtree(folder, ignore_errors=True)
            removed.append(folder)
        finally:
            os.close(fd)
    return removed


def staging_folder(out: str, writer: str) -> str:
    """A new private folder beside ``out`` (same filesystem, so the final rename is atomic), marked and held by this
    process; first the leftovers of ``writer``'s killed runs beside ``out`` go."""
    parent = os.path.dirname(os.path.abspath(out))
    os.makedirs(parent, exist_ok=True)
    remove_leftovers(out, writer)
    staged = tempfile.mkdtemp(prefix=f".{os.path.basename(os.path.abspath(out))}.partial-", dir=parent)
    _hold(staged, writer)
    return staged


def swap_in(staged: str, out: str, writer: str) -> None:
    """Move ``staged`` (from :func:`staging_folder`) to ``out`` by rename; an old ``out`` (checked replaceable) is
    renamed into a held folder first and removed after, so a kill leaves the old folder (as ``.<name>.old-*``, removed
    by the next run, in the instant between the renames) or the new one, never a mixture."""
    write_marker(staged, writer)
    out = os.path.abspath(out)
    old = None
    if os.path.lexists(out):
        old = tempfile.mkdtemp(prefix=f".{os.path.basename(out)}.old-", dir=os.path.dirname(out))
        _hold(old, writer)
        os.rename(out, os.path.join(old, "folder"))
    os.rename(staged, out)
    discard(staged)  # gone: lets its lock go
    if old is not None:
        discard(old)
