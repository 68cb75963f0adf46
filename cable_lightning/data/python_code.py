"""``python-code[:NAME,...]``: the Python source on this machine as a corpus, offline.

One document per ``.py`` file of the running interpreter's standard library (``sysconfig``'s ``stdlib`` folder, its
``site-packages``/``dist-packages`` left out; counted as one distribution named ``python-X.Y``) and of every
distribution installed in its site-packages folders (``site.getsitepackages()``, and the user site when enabled:
never ``PYTHONPATH`` or the current folder, so the corpus does not depend on where prepare runs), as each lists its
files (``RECORD``). ``NAME,...`` keeps only those distributions (names as ``pip list`` gives them, or ``python-X.Y``).

Order: the standard library, then distributions by normalized name, each's files by path. Dropped, each said in one
line: exact duplicates (vendored copies; the first in that order is kept), files that are not text (not UTF-8, or
holding NUL bytes), empty ones, and ``.py`` files in a site-packages folder that no distribution lists (nothing
records their name, version or which split they belong to). An editable install's files are left out too: the
installer generates them (setuptools' ``__editable__..._finder.py``) and they hold the checkout's absolute path, so
the corpus, and its hash, would depend on where the project lives. So are the files a distribution installs outside
its site-packages folder (RECORD paths that climb out with ``../``: scripts in the environment's ``bin/``): pip
rewrites a script's first line to this interpreter's absolute path (jmespath's ``bin/jp.py``), so the corpus would
depend on where the virtualenv lives. Whole installed distributions are held out for
validation: those whose name's SHA-256 falls in the first :data:`VAL_SHARE` of its range, so a package gets the same
split on every machine, whatever else is installed there. The standard library always trains: held out by its
version's name, Python 3.12's whole library (about 30 MB) would be validation on a Python 3.12 machine and not on 3.11.
The manifest records every distribution (version, split, files, bytes) and ``corpus_hash``, over the documents'
contents and splits in order: two machines prepared the same data when their hashes agree.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import re
import site
import sys
import sysconfig
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, NamedTuple

from ..errors import ConfigError

SPEC = "python-code"
VAL_SHARE = 0.05  # share of the hash range (not of the text) whose distributions are validation
ITEM_BYTES = 1 << 22  # a work item: consecutive files of one split, about this many bytes
FILE_LIST = "files.tsv"  # beside the manifest: every kept file (see FileRow)


def normalized(name: str) -> str:
    """A distribution's name as PEP 503 compares them (``Typing_Extensions`` -> ``typing-extensions``)."""
    return re.sub(r"[-_.]+", "-", name).lower()


def held_out(name: str) -> bool:
    """Whether the distribution ``name`` (normalized, or the stdlib's ``python-X.Y``) is validation: decided by the
    name alone."""
    return int.from_bytes(hashlib.sha256(name.encode()).digest()[:8], "big") < VAL_SHARE * 2**64


def python_environment() -> tuple[str, list[str]]:
    """The running interpreter's standard library folder and its site-packages folders (user site first, as
    imports see them)."""
    user = [site.getusersitepackages()] if site.ENABLE_USER_SITE else []
    folders = [p for p in dict.fromkeys(user + site.getsitepackages()) if os.path.isdir(p)]
    return sysconfig.get_paths()["stdlib"], folders


@dataclass(frozen=True)
class Distribution:
    name: str
    version: str
    split: str
    paths: tuple[str, ...]  # its .py files, in order
    root: str  # the folder its paths are named from in the file list (stdlib or site-packages)


def _stdlib(folder: str) -> Distribution:
    def refuse(exc: OSError) -> None:  # os.walk skips an unreadable folder silently otherwise
        raise ConfigError(f"{SPEC}: the standard library folder {exc.filename} cannot be read ({exc.strerror})")

    found = []
    for root, dirs, names in os.walk(folder, onerror=refuse):
        dirs[:] = [d for d in dirs if d not in ("site-packages", "dist-packages", "__pycache__")]
        found += [os.path.join(root, n) for n in names if n.endswith(".py")]
    name = f"python-{sys.version_info.major}.{sys.version_info.minor}"
    key = {p: os.path.relpath(p, folder).replace(os.sep, "/") for p in found}
    return Distribution(name, platform.python_version(), "train", tuple(sorted(found, key=key.__getitem__)), folder)


def _editable(dist) -> bool:
    """Whether pip installed ``dist`` in editable mode (PEP 610's ``direct_url.json``): its RECORD lists only files the
    installer generated, which point at the checkout."""
    try:
        return bool(json.loads(dist.read_text("direct_url.json") or "{}").get("dir_info", {}).get("editable"))
    except (ValueError, AttributeError):
        return False


def _installed(folders: list[str]) -> tuple[list[Distribution], set[str], dict[str, tuple[str, ...]],
                                            dict[str, tuple[str, ...]]]:
    """Every distribution in ``folders`` (the first of a name), sorted by name, the folders they live in, and the
    files of editable installs and those installed outside site-packages, which are left out."""
    import importlib.metadata

    found: dict[str, Distribution] = {}
    roots, generated, scripts = set(), {}, {}
    for dist in importlib.metadata.distributions(path=folders):
        where, meta = getattr(dist, "_path", dist.locate_file("")), dist.metadata
        if meta is None or not meta.get("Name"):
            raise ConfigError(f"{SPEC}: the distribution at {where} has no readable name (its METADATA is missing or "
                              "unreadable); repair or uninstall it")
        name = normalized(meta["Name"])
        if name in found:
            continue  # a second copy further down the path: imports never see it
        if dist.files is None:
            raise ConfigError(f"{SPEC}: distribution {name} {dist.version} lists no files (its RECORD at {where} is "
                              f"missing or unreadable); reinstall it (pip install --force-reinstall {name})")
        files = sorted({str(f): f for f in dist.files if f.suffix == ".py"}.items())
        located = [(f.parts[0] == "..", os.path.normpath(str(dist.locate_file(f)))) for _, f in files]
        paths = tuple(path for outside, path in located if not outside)
        scripts[name] = tuple(path for outside, path in located if outside)
        if _editable(dist):
            generated[name], paths = paths, ()
        found[name] = Distribution(name, dist.version, "val" if held_out(name) else "train", paths,
                                   os.path.normpath(str(dist.locate_file(""))))
        roots.add(os.path.normpath(str(dist.locate_file(""))))
    return [found[name] for name in sorted(found)], roots, generated, scripts


def _unowned(roots: set[str], owned: set[str]) -> list[str]:
    """``.py`` files in the site-packages folders that no distribution lists."""
    return sorted(os.path.join(root, n) for folder in roots for root, _, names in os.walk(folder)
                  for n in names if n.endswith(".py") and os.path.join(root, n) not in owned)


def _skipped(paths: list[str], why: str) -> None:
    if paths:
        shown = ", ".join(paths[:3]) + (f" and {len(paths) - 3} more" if len(paths) > 3 else "")
        print(f"source {SPEC}: skipping {len(paths)} files ({why}): {shown}", file=sys.stderr, flush=True)


class PythonCodeSource:
    """The corpus as a source with its own splits (``train``, ``val``): a work item is a run of consecutive files of
    one split, ``((path, sha256), ...)``, read and checked against the scan's hash in whichever process reads it."""

    splits = {"train": "train", "val": "val"}
    streamed, files = False, None

    def __init__(self, select: list[str] | None = None):
        stdlib, folders = python_environment()
        installed, roots, generated, scripts = _installed(folders)
        self.distributions = everything = [_stdlib(stdlib), *installed]
        self.unowned: list[str] | None = None
        if select is not None:
            known = {normalized(d.name): d.name for d in everything}  # python-3.11 is python-3-11 normalized
            wanted = {normalized(n) for n in select}
            if "" in wanted:
                raise ConfigError(f"{SPEC}:{','.join(select)} has an empty name; give {SPEC}:NAME[,NAME...] with "
                                  f"names from `pip list` (or {everything[0].name})")
            if missing := sorted(wanted - set(known)):
                raise ConfigError(f"{SPEC}: no distribution named {', '.join(missing)} here (the standard library is "
                                  f"{everything[0].name}; `pip list` names the {len(installed)} others)")
            self.distributions = [d for d in everything if normalized(d.name) in wanted]
        else:
            self.unowned = _unowned(roots, {p for d in installed for p in d.paths} | {p for g in generated.values()
                                                                                       for p in g})
        self.generated = [p for d in self.distributions for p in generated.get(d.name, ())]
        self.scripts = [p for d in self.distributions for p in scripts.get(d.name, ())]
        self.name = SPEC + (f":{','.join(d.name for d in self.distributions)}" if select is not None else "")
        where = f"the standard library ({stdlib}) or the site-packages folders ({', '.join(folders) or 'none'})"
        if not any(d.paths for d in self.distributions):
            raise ConfigError(f"{self.name} found no .py files in {where}"
                              if select is None else f"{self.name}: the selected distributions hold no .py files")
        for split, other in (("val", "train"), ("train", "val")):
            if not any(d.paths for d in self.distributions if d.split == split):
                held = sum(d.split == "val" for d in self.distributions)
                others = [d.name for d in everything if d.split == split and d.paths]
                raise ConfigError(f"{self.name} has no {split} files: every distribution with .py files is "
                                  f"{other} ({held} of {len(self.distributions)} held out, by the hash of its name); "
                                  f"select (or install) more distributions" +
                                  (f", e.g. one of {', '.join(others[:3])}" if others else ""))
        self._scan: dict[str, Any] | None = None

    def scan(self) -> dict[str, Any]:
        """Read every file once (in this process, in order): what is kept, per split, and what was dropped."""
        if self._scan is not None:
            return self._scan
        kept: dict[str, list[tuple[str, str, int]]] = {"train": [], "val": []}
        seen, dropped = set(), {"duplicates": [], "not_text": [], "empty": []}
        per_dist, listed = [], []
        for dist in self.distributions:
            files = size = 0
            for path in dist.paths:
                try:
                    with open(path, "rb") as f:
                        data = f.read()
                except OSError as exc:
                    raise ConfigError(f"{SPEC}: {path} of {dist.name} {dist.version} cannot be read "
                                      f"({type(exc).__name__}: {exc.strerror or exc}); fix it or leave the "
                                      f"distribution out ({SPEC}:NAME,... selects distributions)") from None
                digest = hashlib.sha256(data).hexdigest()
                if not data.strip():
                    dropped["empty"].append(path)
                elif digest in seen:
                    dropped["duplicates"].append(path)
                elif b"\0" in data or not _utf8(data):
                    dropped["not_text"].append(path)
                else:
                    seen.add(digest)
                    kept[dist.split].append((path, digest, len(data)))
                    rel = os.path.relpath(path, dist.root).replace(os.sep, "/")
                    listed.append(FileRow(dist.split, dist.name, dist.version, rel, len(data), digest))
                    files, size = files + 1, size + len(data)
            per_dist.append({"name": dist.name, "version": dist.version, "split": dist.split, "files": files,
                             "bytes": size, "py_files": len(dist.paths)})
        for split, docs in kept.items():
            if not docs:
                raise ConfigError(f"{self.name} has no {split} text: every .py file of its {split} distributions is "
                                  "empty, not UTF-8 text or a copy of an earlier file; select more distributions")
        _skipped(dropped["duplicates"], "exact copies of an earlier file")
        _skipped(dropped["not_text"], "not UTF-8 text, or NUL bytes")
        _skipped(dropped["empty"], "empty")
        _skipped(self.unowned or [], "listed by no distribution's RECORD")
        _skipped(self.generated, "generated by an editable install, they hold the checkout's path")
        _skipped(self.scripts, "installed outside site-packages, pip writes this interpreter's path into them")
        self._scan = {"kept": kept, "dropped": {k: len(v) for k, v in dropped.items()}, "distributions": per_dist,
                      "corpus_hash": list_hash(listed), "files": listed}
        return self._scan

    def check(self) -> None:
        pass

    def file_list(self) -> list[FileRow]:
        return self.scan()["files"]

    def expect(self, path: str) -> None:
        """Refuse, naming the files that differ, when this machine's corpus is not the one the file list ``path``
        holds (a published run's ``files.tsv``): before any tokenizing."""
        here, there = self.file_list(), read_file_list(path)
        if (mine := list_hash(here)) != (theirs := list_hash(there)):
            raise ConfigError(f"{self.name} here (corpus hash {mine[:12]}) is not the corpus {path} lists (hash "
                              f"{theirs[:12]}): {differences(here, there)}; install those versions (bash "
                              "tools/install.sh) or drop --expect to prepare this machine's corpus")

    def work_items(self, split: str | None = None) -> list[tuple[tuple[str, str], ...]]:
        items, run, size = [], [], 0
        for path, digest, length in self.scan()["kept"][split or "train"]:
            run.append((path, digest))
            size += length
            if size >= ITEM_BYTES:
                items.append(tuple(run))
                run, size = [], 0
        return items + ([tuple(run)] if run else [])

    def read(self, item: tuple[tuple[str, str], ...]) -> Iterator[str]:
        for path, digest in item:
            with open(path, "rb") as f:
                data = f.read()
            if hashlib.sha256(data).hexdigest() != digest:
                raise ValueError(f"{path} changed while it was being prepared; run the same command again")
            yield data.decode("utf-8")

    def documents(self, split: str | None = None) -> Iterator[str]:
        for item in self.work_items(split):
            yield from self.read(item)

    def describe(self) -> dict[str, Any]:
        scan = self.scan()
        return {"spec": self.name, "python": platform.python_version(), "val_share": VAL_SHARE,
                "held_out_by": "sha256 of the normalized distribution name", "corpus_hash": scan["corpus_hash"],
                "py_files": sum(d["py_files"] for d in scan["distributions"]),
                "documents": {split: len(docs) for split, docs in scan["kept"].items()},
                "bytes": {split: sum(n for *_, n in docs) for split, docs in scan["kept"].items()},
                "dropped": {**scan["dropped"], "editable": len(self.generated), "scripts": len(self.scripts),
                            **({"unowned": len(self.unowned)} if self.unowned is not None else {})},
                "distributions": scan["distributions"]}


class FileRow(NamedTuple):
    """One kept file of the corpus, named as on every machine: by its distribution and its path in its folder."""
    split: str
    distribution: str
    version: str
    path: str
    bytes: int
    sha256: str


FILE_LIST_HEADER = "\t".join(FileRow._fields)


def write_file_list(rows: list[FileRow], path: str) -> None:
    """The corpus's files in corpus order, one tab-separated row each: what two machines compare when their corpus
    hashes differ."""
    with open(path, "w", encoding="utf-8") as f:
        f.write(FILE_LIST_HEADER + "\n" + "".join("\t".join(map(str, row)) + "\n" for row in rows))


def read_file_list(path: str) -> list[FileRow]:
    with open(path, encoding="utf-8") as f:
        header, *lines = f.read().splitlines()
    if header != FILE_LIST_HEADER:
        raise ConfigError(f"{path} is not a corpus file list (its first line is {header[:60]!r}, not "
                          f"{FILE_LIST_HEADER!r}); give the {FILE_LIST} of a prepared python-code folder")
    rows = [line.split("\t") for line in lines]
    return [FileRow(split, dist, version, rel, int(size), digest) for split, dist, version, rel, size, digest in rows]


def list_hash(rows: list[FileRow]) -> str:
    """The corpus hash of a file list: the same sum the scan takes over the same files."""
    return hashlib.sha256("".join(f"{row.split} {row.sha256}\n" for row in rows).encode()).hexdigest()


def differences(here: list[FileRow], there: list[FileRow], limit: int = 3) -> str:
    """The files that differ between two lists, in a few words: those changed (content or split), those only here
    and those only there."""
    mine = {(r.distribution, r.path): r for r in here}
    theirs = {(r.distribution, r.path): r for r in there}

    def named(rows: list[FileRow], detail=lambda row: "") -> str:
        shown = "; ".join(f"{r.distribution} {r.version} {r.path}{detail(r)}" for r in rows[:limit])
        return shown + (f"; and {len(rows) - limit} more" if len(rows) > limit else "")

    def there_too(row: FileRow) -> str:
        other = theirs[row.distribution, row.path]
        return f": {row.bytes} bytes here, {other.bytes} there" + (
            f" ({other.version})" if other.version != row.version else "")

    changed = [r for k, r in mine.items() if k in theirs and (r.split, r.sha256) != (theirs[k].split, theirs[k].sha256)]
    only_here = [r for k, r in mine.items() if k not in theirs]
    only_there = [r for k, r in theirs.items() if k not in mine]
    parts = [f"{len(rows)} {what} ({named(rows, how)})" for rows, what, how in (
        (changed, "changed", there_too), (only_here, "only here", lambda r: ""),
        (only_there, "only there", lambda r: "")) if rows]
    return ", ".join(parts) or "the same files in another order"


def _utf8(data: bytes) -> bool:
    try:
        data.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


def python_code(spec: str) -> PythonCodeSource:
    """``python-code`` or ``python-code:NAME,...`` as a source."""
    _, colon, names = spec.partition(":")
    return PythonCodeSource([n.strip() for n in names.split(",")] if colon else None)
