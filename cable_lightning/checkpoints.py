"""Checkpoint files: written so that a kill or a full disk never destroys a good one, read with a clear word when
one is corrupt, and ``--ckpt_path last``/``auto`` resolved to the newest one that can be read.

Lightning's own writer stages the file in the system temp directory and moves it into place, which is a copy
(not atomic) when that directory is on another filesystem; :class:`AtomicCheckpointIO` writes next to the target,
fsyncs and renames instead.
"""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import glob
import os
import shutil
import tempfile
import zipfile
from typing import Any, Optional

import torch
from lightning.pytorch.plugins.io import TorchCheckpointIO

from .errors import ConfigError, CorruptCheckpointError, MissingFileError, RunFailedError, space_left

PARTIAL_SUFFIX = ".partial"
RESUME_CHOICES = ("last", "auto")  # last: must exist; auto: resume when there is a checkpoint, else start afresh


def check_checkpoint_file(path: str, checksums: bool = False) -> None:
    """Structural check (the zip directory written last by ``torch.save`` is intact): catches truncated and foreign
    files without reading the tensors. With ``checksums``, every member is read and checked against the CRC-32 the
    zip format stores for it (``torch.load`` does not): flipped bytes inside a tensor are caught too."""
    bad = None
    try:
        with zipfile.ZipFile(path) as archive:
            if not any(name.endswith("/data.pkl") or name == "data.pkl" for name in archive.namelist()):
                raise zipfile.BadZipFile("no data.pkl inside")
            if checksums:
                bad = archive.testzip()
    except (OSError, zipfile.BadZipFile, ValueError, EOFError) as exc:
        raise CorruptCheckpointError(f"checkpoint {shown_name(path)} is corrupt or truncated ({exc}); use another "
                                     "checkpoint (the step*.ckpt files beside it)") from None
    if bad is not None:
        raise CorruptCheckpointError(f"checkpoint {shown_name(path)} is corrupt: its member {bad} fails the CRC-32 "
                                     "check; use another checkpoint (the step*.ckpt files beside it)")


_downloads: dict[str, str] = {}  # URL -> local copy


def shown_name(path: str) -> str:
    """How errors and records name a checkpoint: its URL when it was downloaded (the copy is removed at exit)."""
    return next((url for url, local in _downloads.items() if local == path), path)


def is_url(path) -> bool:
    return "://" in str(path)


def fetch_checkpoint(url: str) -> str:
    """A checkpoint URL (http(s), file, s3 and whatever else fsspec reads) downloaded once per process into a
    temporary folder (removed at exit), so that it is read like a local file: checked and loaded weights-only."""
    if url in _downloads:
        return _downloads[url]
    import fsspec

    folder = tempfile.mkdtemp(prefix="cable_lightning-ckpt-")
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    local = os.path.join(folder, os.path.basename(url.split("?")[0].rstrip("/")) or "checkpoint.ckpt")
    try:
        with fsspec.open(url, "rb") as source, open(local, "wb") as target:
            shutil.copyfileobj(source, target, 1 << 20)
    except Exception as exc:  # fsspec and its backends raise their own types (unknown protocol, HTTP status...)
        shutil.rmtree(folder, ignore_errors=True)
        first = (str(exc).strip().splitlines() or [""])[0]
        raise ConfigError(f"checkpoint {url} cannot be downloaded ({type(exc).__name__}: {first}); give a reachable "
                          "URL or a local checkpoint file") from None
    _downloads[url] = local
    return local


def check_exists(path: str) -> None:
    """A local checkpoint path names a file (a URL is checked when it is fetched)."""
    if not is_url(path) and not os.path.isfile(path):
        raise MissingFileError(f"checkpoint {path} does not exist; give an existing checkpoint file")


def read_checkpoint(path: str, map_location: Any = "cpu", weights_only: bool = True, mmap: bool = False) -> dict:
    """``torch.load`` that names the file when it is missing, truncated, damaged or refused; the file is checked
    against its CRC-32s first unless ``mmap`` (reading the metadata only, as scanning for ``last`` does). Always
    weights-only (a crafted
    pickle is refused, not run; ``weights_only`` is kept for callers' clarity and must be True). A URL is
    downloaded first (:func:`fetch_checkpoint`)."""
    if weights_only is not True:
        raise ValueError("checkpoints are loaded weights-only in this package")
    if is_url(path):
        path = fetch_checkpoint(path)
    check_exists(path)
    check_checkpoint_file(path, checksums=not mmap)
    try:
        return torch.load(path, map_location=map_location, weights_only=True, mmap=mmap)
    except Exception as exc:  # torch raises RuntimeError, UnpicklingError, EOFError... for a damaged file
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        raise CorruptCheckpointError(f"checkpoint {shown_name(path)} cannot be loaded ({type(exc).__name__}: "
                                     f"{first}); use another checkpoint") from None


def _fsync_dir(folder: str) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class AtomicCheckpointIO(TorchCheckpointIO):
    """Writes ``<path>.partial`` beside the target, fsyncs it, checks it reads back as a checkpoint, then renames
    it over the target: the target is always the old complete file or the new one. A failed write is an error
    (the previous checkpoints are untouched) and leaves no partial file; the partial file a killed run left for a
    target is replaced by the next save of that target (no other file is removed)."""

    def save_checkpoint(self, checkpoint: dict[str, Any], path, storage_options: Optional[Any] = None) -> None:
        path = os.fspath(path)
        if "://" in path:  # object stores put whole objects; Lightning's writer handles them
            return super().save_checkpoint(checkpoint, path, storage_options)
        folder = os.path.dirname(os.path.abspath(path))
        partial = path + PARTIAL_SUFFIX
        try:
            os.makedirs(folder, exist_ok=True)
            with open(partial, "wb") as f:  # replaces this target's own partial left by a killed run, nothing else
                torch.save(checkpoint, f)
                f.flush()
                os.fsync(f.fileno())
            check_checkpoint_file(partial)
            os.replace(partial, path)
            _fsync_dir(folder)
        except BaseException as exc:
            written = os.path.getsize(partial) if os.path.isfile(partial) else None
            with contextlib.suppress(OSError):
                os.remove(partial)
            # torch.save wraps ENOSPC and EFBIG in RuntimeError
            if isinstance(exc, (OSError, RuntimeError, CorruptCheckpointError)):
                raise RunFailedError(f"could not write checkpoint {path} ({type(exc).__name__}: {str(exc).strip()}; "
                                     f"{space_left(path, written)}); the checkpoints written before it are "
                                     "intact") from exc
            raise

    def load_checkpoint(self, path, map_location: Any = lambda storage, loc: storage,
                        weights_only: Optional[bool] = None) -> dict[str, Any]:
        # weights-only whatever Lightning asks for (it asks for weights_only=False for URLs)
        return read_checkpoint(os.fspath(path), map_location)


def checkpoint_step(path: str) -> int:
    """The global step stored in a checkpoint (memory-mapped: the tensors are not read)."""
    return int(read_checkpoint(path, mmap=True).get("global_step", -1))


def run_configs(ckpt_path: str) -> list[str]:
    """The ``config.yaml`` files LightningCLI saved for the run that wrote ``ckpt_path`` (in the ``version_*`` folders
    beside its checkpoints folder), oldest first."""
    run = os.path.dirname(os.path.dirname(os.path.abspath(ckpt_path)))
    return sorted(glob.glob(os.path.join(run, "version_*", "config.yaml")), key=os.path.getmtime)


def resolve_ckpt_path(value: Optional[str], folder: str, subcommand: str = "fit") -> Optional[str]:
    """The checkpoint file ``--ckpt_path`` means. ``last``: the checkpoint in ``folder`` with the highest step that
    loads (``last.ckpt`` first among equals; a corrupt one is skipped, said in one line), an error when there is
    none; ``auto``: the same, but a folder with no checkpoint at all starts a new run (None). A file must exist.
    By step, not modification time: a restored or copied folder keeps its order."""
    if value is None or value in ("best", "hpc", "registry"):
        return value
    if is_url(value):  # downloaded, then checked and loaded like a local file
        return fetch_checkpoint(value)
    if value not in RESUME_CHOICES:
        if not os.path.isfile(value):
            raise ConfigError(f"--ckpt_path {value}: no such file; give a checkpoint file, "
                              f"or one of {', '.join(RESUME_CHOICES)}")
        return value
    found = glob.glob(os.path.join(glob.escape(folder), "*.ckpt"))
    readable = []
    for path in found:
        try:
            readable.append((checkpoint_step(path), os.path.basename(path) == "last.ckpt", path))
        except ConfigError as err:  # corrupt, or a dangling link
            print(f"--ckpt_path {value}: skipping {err}", flush=True)
    for step, is_last, path in sorted(readable, reverse=True):
        try:
            check_checkpoint_file(path, checksums=True)  # only the one chosen is read in full
        except ConfigError as err:
            print(f"--ckpt_path {value}: skipping {err}", flush=True)
            continue
        if not is_last:
            print(f"--ckpt_path {value}: using {path} (step {step}), the newest checkpoint that loads", flush=True)
        return path
    if value == "auto" and not found and subcommand == "fit":
        print(f"--ckpt_path auto: no checkpoint in {folder}; starting a new run", flush=True)
        return None
    what = f"none of the {len(found)} checkpoints in {folder} can be read" if found else f"no checkpoint in {folder}"
    if subcommand != "fit":
        hint = "pass a checkpoint file or point --checkpoint.dirpath (or --experiment) at the run to evaluate"
    elif found:
        hint = "remove them or choose another --experiment or --checkpoint.dirpath"
    else:
        hint = "drop --ckpt_path to start a new run (--ckpt_path auto resumes when there is a checkpoint)"
    raise ConfigError(f"--ckpt_path {value}: {what}; {hint}")


def claim_checkpoint_folder(folder: str, resuming: bool, lock: bool):
    """Before fit writes anything: the folder can be created, it holds no earlier run's checkpoints unless this run
    resumes (a new run would overwrite them), and (``lock``, rank 0) no other run writes into it at the same time.
    Returns the open lock file, which holds the lock until the process ends."""
    try:
        os.makedirs(folder, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"cannot create the checkpoint folder {folder} ({type(exc).__name__}: {exc.strerror}); "
                          "choose another --runs_dir or --checkpoint.dirpath") from None
    earlier = sorted(glob.glob(os.path.join(glob.escape(folder), "*.ckpt")))
    if earlier and not resuming:
        raise ConfigError(f"{folder} already holds {len(earlier)} checkpoints of an earlier run "
                          f"({', '.join(map(os.path.basename, earlier[:3]))}"
                          f"{', ...' if len(earlier) > 3 else ''}); resume it with --ckpt_path last, "
                          "or start elsewhere "
                          "with another --experiment or --checkpoint.dirpath")
    if not lock:
        return None
    handle = open(folder.rstrip(os.sep) + ".lock", "a")  # beside the folder, as prepare locks <out>.lock
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.close()
        raise ConfigError(f"another run is writing checkpoints into {folder}; wait for it to end, or choose another "
                          "--experiment or --checkpoint.dirpath") from None
    return handle
