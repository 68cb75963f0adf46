"""Text sources: a spec -> documents (``str``) in work items that prepare's workers read independently, in order.

``python-docs`` (offline: the standard library's docstrings, one document per module, and the pydoc topics; ~1.8 MB
of English that depends on the Python version), ``python-code[:dist,...]`` (offline: the installed Python source, one
document per file, whole distributions held out: :mod:`.python_code`), ``fineweb-edu[:CONFIG]``
(HuggingFaceFW/fineweb-edu streamed, config sample-10BT by default), ``wikitext-103`` (its own train/validation/test
splits, one document per article), or a path, folder or glob of ``.txt`` (one document per file), ``.jsonl`` (a
``text`` field) and ``.parquet`` (a ``text`` column) files in sorted path order. All but python-code are read through
``datasets`` streaming builders; the python-docs corpus is first written once as jsonl parts under
``$CABLE_LIGHTNING_CACHE`` (default ``~/.cache/cable_lightning``).
"""

from __future__ import annotations

import contextlib
import glob
import hashlib
import importlib
import inspect
import io
import itertools
import json
import os
import pkgutil
import shutil
import sys
import tempfile
import warnings
from collections.abc import Iterator
from typing import Any, Optional

VALID_SOURCES = ("python-docs, python-code[:dist,...], fineweb-edu[:config], wikitext-103, or a path/dir/glob of "
                 ".txt/.jsonl/.parquet files")
LOCAL_BUILDERS = {".txt": ("text", {"sample_by": "document"}), ".jsonl": ("json", {}), ".parquet": ("parquet", {})}

# Importing these has side effects (a browser, printed text, a GUI, terminal control) or pulls in huge,
# low-value trees (the test suite, 100+ codec modules); distutils is shadowed by setuptools' copy.
_SKIP_MODULES = frozenset({"antigravity", "this", "idlelib", "tkinter", "turtle", "turtledemo", "test", "lib2to3",
                           "encodings", "distutils", "msilib", "readline", "rlcompleter", "pydoc_data"})


def _own_doc(obj: Any) -> str | None:
    """The object's own docstring, cleaned; None when absent or merely inherited."""
    doc = obj.__dict__.get("__doc__") if isinstance(obj, type) else getattr(obj, "__doc__", None)
    return inspect.cleandoc(doc) if isinstance(doc, str) and doc.strip() else None


def _module_document(name: str, module: Any) -> str:
    """Module docstring, then the docstrings of the classes, methods and functions the module defines."""
    parts = []
    if doc := _own_doc(module):
        parts.append(f"Module {name}\n\n{doc}")
    for attr, obj in sorted(vars(module).items()):
        if attr.startswith("_") or getattr(obj, "__module__", None) != name:
            continue
        if inspect.isclass(obj):
            if doc := _own_doc(obj):
                parts.append(f"class {attr}\n\n{doc}")
            for meth, member in sorted(vars(obj).items()):
                if meth.startswith("_") and meth != "__init__":
                    continue
                member = getattr(member, "__func__", member)  # classmethod / staticmethod
                member = getattr(member, "fget", member)  # property
                if (inspect.isroutine(member) or inspect.isdatadescriptor(member)) and (doc := _own_doc(member)):
                    parts.append(f"{attr}.{meth}\n\n{doc}")
        elif inspect.isroutine(obj) and (doc := _own_doc(obj)):
            parts.append(f"{attr}\n\n{doc}")
    return "\n\n".join(parts)


def _collect_python_docs() -> list[str]:
    """The work behind :func:`python_docs`, run inside the child interpreter."""
    from pydoc_data.topics import topics

    docs = []
    queue = sorted(n for n in sys.stdlib_module_names if not n.startswith("_") and n not in _SKIP_MODULES)
    with (warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()),
          contextlib.redirect_stderr(io.StringIO())):
        warnings.simplefilter("ignore")
        while queue:
            name = queue.pop(0)
            try:
                module = importlib.import_module(name)
            except BaseException:  # ImportError, platform-only modules, SystemExit from odd imports
                continue
            if text := _module_document(name, module):
                docs.append(text)
            if hasattr(module, "__path__"):  # a package: its public submodules come next, in name order
                subs = sorted(
                    m.name
                    for m in pkgutil.iter_modules(module.__path__, name + ".")
                    if not m.name.rsplit(".", 1)[1].startswith("_") and ".test" not in m.name
                )
                queue[0:0] = subs
    docs.extend(f"Topic {key}\n\n{topics[key].strip()}" for key in sorted(topics))
    return docs


def python_docs() -> list[str]:
    """Every stdlib module's docstrings as one document each (sorted, packages walked), then the pydoc topics.

    Collected in a fresh ``python -I -S`` child: only the standard library is importable there, so no installed
    package can have patched it (torch replaces ``inspect.getfile``, for one) and the imports' side effects stay
    out of this process.
    """
    import subprocess

    proc = subprocess.run([sys.executable, "-I", "-S", os.path.abspath(__file__), "--python-docs-json"],
                          capture_output=True, text=True, encoding="utf-8", timeout=600)
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        raise RuntimeError(f"collecting the python-docs corpus failed in a child interpreter ({last}); "
                           "use a local --source instead")
    return json.loads(proc.stdout)


def python_docs_files(parts: int = 16) -> list[str]:
    """The python-docs corpus as ``parts`` jsonl files of consecutive documents (parts let prepare's workers share
    the work), written once per Python version, atomically."""
    folder = os.path.join(os.environ.get("CABLE_LIGHTNING_CACHE", os.path.expanduser("~/.cache/cable_lightning")),
                          f"python-docs-{sys.version.split()[0]}")
    if not os.path.isdir(folder):
        docs = python_docs()
        step = -(-len(docs) // parts)
        os.makedirs(os.path.dirname(folder), exist_ok=True)
        staging = tempfile.mkdtemp(dir=os.path.dirname(folder))
        for part, start in enumerate(range(0, len(docs), step)):
            with open(os.path.join(staging, f"part-{part:02d}.jsonl"), "w", encoding="utf-8") as f:
                f.writelines(json.dumps({"text": doc}) + "\n" for doc in docs[start : start + step])
        try:
            os.rename(staging, folder)
        except OSError:  # another process finished first: its copy is the same
            shutil.rmtree(staging)
    return sorted(glob.glob(os.path.join(folder, "part-*.jsonl")))


# ---------------------------------------------------------------------------------------------- through `datasets`

def check_hub(repo: str) -> Optional[str]:
    """Fail fast, in one line, when the hub is unreachable (``datasets`` alone retries for ~25 s first); the
    dataset's current commit (what the corpus hash of a hub source names)."""
    fix = "use --source python-docs or local files, or run on a machine with internet"
    if any(os.environ.get(v, "").strip().lower() in {"1", "true", "yes", "on"}
           for v in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")):
        raise RuntimeError(f"cannot reach the Hugging Face hub to stream {repo} (HF_HUB_OFFLINE is set); {fix}")
    from huggingface_hub import HfApi

    try:
        return HfApi().dataset_info(repo, timeout=10).sha
    except Exception as exc:
        raise RuntimeError(f"cannot reach the Hugging Face hub to stream {repo} "
                           f"(offline? {type(exc).__name__}); {fix}") from None


class DatasetSource:
    """Documents streamed by a ``datasets`` builder; a work item is one shard of one stream, ``(stream, index)``.

    Hub sources have one stream per split of theirs; local files one stream per file type, whose shards are
    its files (so an error can name the file). Streams are opened lazily in whichever process reads them.
    """

    def __init__(self, name: str, streams: dict[str, tuple[str, dict[str, Any]]], splits: dict[str, str] | None = None,
                 repo: str | None = None, files: list[str] | None = None):
        self.name, self.streams, self.splits, self.repo, self.files = name, streams, splits, repo, files
        self.streamed = repo is not None  # a hub stream's size is unknown until it is all read
        self.revision: Optional[str] = None  # a hub dataset's commit, once checked
        self._open: dict[str, Any] = {}

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_open": {}}

    def _stream(self, key: str) -> Any:
        if key not in self._open:
            import datasets

            builder, kwargs = self.streams[key]
            try:
                self._open[key] = datasets.load_dataset(builder, streaming=True, **kwargs)
            except Exception as exc:
                raise RuntimeError(f"cannot stream {self.name} ({key}): {type(exc).__name__}: "
                                   f"{(str(exc).splitlines() or ['no message (an empty file?)'])[0]}") from None
        return self._open[key]

    def check(self) -> None:
        if self.repo:
            self.revision = check_hub(self.repo)

    def work_items(self, split: str | None = None) -> list[Any]:
        if self.files is not None:  # one item per file, in sorted path order across the file types
            suffixes = [os.path.splitext(f)[1] for f in self.files]
            return [(suffix, suffixes[:i].count(suffix)) for i, suffix in enumerate(suffixes)]
        self.check()
        key = self.splits[split] if self.splits and split else "train"
        return [(key, i) for i in range(self._stream(key).n_shards)]

    def read(self, item: Any) -> Iterator[str]:
        """The item's documents; any error names the file (or shard) and fits on one line, as prepare relays
        errors from its workers (the builders' own, e.g. a multi-line CastError for other fields, name neither)."""
        key, index = item
        stream = self._stream(key)
        where = self.streams[key][1]["data_files"][index] if self.files is not None else f"{self.name} shard {index}"
        records = iter(stream.shard(num_shards=stream.n_shards, index=index))
        for row in itertools.count(1):
            try:
                record = next(records, None)
            except Exception as exc:  # noqa: BLE001 - bad bytes, JSON, schema: re-raised with the file's name
                cause = " ".join(str(exc).split())[:300]
                raise ValueError(f"{where} cannot be read as {key} text ({type(exc).__name__}: {cause})") from None
            if record is None:
                return
            if not isinstance(record.get("text"), str):
                raise ValueError(f"{where}:{row} has no 'text' string (fields: {', '.join(record)})")
            yield record["text"]

    def documents(self, split: str | None = None) -> Iterator[str]:
        """All documents in order (of one of the source's own splits, when it has them)."""
        for item in self.work_items(split):
            yield from self.read(item)

    def describe(self) -> dict[str, Any]:
        """The source as the manifest records it, with ``corpus_hash``: what tells whether two prepared folders hold
        the same text, wherever they were prepared (records of runs on several machines carry it). Over local files,
        their contents in order (not their paths: the python-docs corpus's cache folder is a machine's own); for a hub
        dataset, its repository, config and the commit it was read at (None when the commit is not known)."""
        if self.files is None:
            config = self.streams[next(iter(self.streams))][1].get("name")
            corpus = (hashlib.sha256(f"{self.repo} {config} {self.revision}".encode()).hexdigest()
                      if self.revision else None)
            return {"spec": self.name, "repo": self.repo, "config": config, "revision": self.revision,
                    "corpus_hash": corpus}
        python = {"python": sys.version.split()[0]} if self.name == "python-docs" else {}
        return {"spec": self.name, "files": len(self.files), "bytes": sum(os.path.getsize(f) for f in self.files),
                **python, "corpus_hash": files_hash(self.files)}


def files_hash(files: list[str]) -> str:
    """sha256 over the files' contents in order (each file's own sha256 and size), whatever their paths."""
    corpus = hashlib.sha256()
    for path in files:
        digest, size = hashlib.sha256(), 0
        with open(path, "rb") as f:
            while block := f.read(1 << 20):
                digest.update(block)
                size += len(block)
        corpus.update(f"{digest.hexdigest()} {size}\n".encode())
    return corpus.hexdigest()


def _folder_files(folder: str) -> list[str]:
    """Every (non-hidden) file under ``folder``, following links; a folder reached a second time (a symlink loop,
    or two links to one folder) is refused, so no file is read twice."""
    seen: dict[str, str] = {}
    found = []
    for root, dirs, names in os.walk(folder, followlinks=True):
        real = os.path.realpath(root)
        if real in seen:
            raise ValueError(f"{root} is {seen[real]} again (a symlink loop, or a second link to one folder); "
                             "remove the link so that each file is read once")
        seen[real] = root
        dirs[:] = [d for d in dirs if not d.startswith(".")]
        found += [os.path.join(root, n) for n in names if not n.startswith(".")]
    return sorted(p for p in found if os.path.isfile(p))


def _skipped(spec: str, paths: list[str], why: str) -> None:
    if paths:
        shown = ", ".join(paths[:3]) + (f" and {len(paths) - 3} more" if len(paths) > 3 else "")
        print(f"source {spec}: skipping {len(paths)} files ({why}): {shown}", file=sys.stderr, flush=True)


def local_files(spec: str, name: str | None = None) -> DatasetSource:
    """``.txt`` (whole file = one document), ``.jsonl`` (a ``text`` field per line), ``.parquet`` (``text``). Each
    real file is read once (a second path to it is skipped, said in one line, as are a folder's other files)."""
    if os.path.isdir(spec):
        found = _folder_files(spec)
    else:
        found = [spec] if os.path.isfile(spec) else sorted(p for p in glob.glob(spec, recursive=True)
                                                           if os.path.isfile(p))
    real: dict[str, str] = {}
    for path in found:
        real.setdefault(os.path.realpath(path), path)
    _skipped(spec, [p for p in found if real[os.path.realpath(p)] != p], "the same file as another path")
    found = [p for p in found if real[os.path.realpath(p)] == p]
    files = [f for f in found if f.endswith(tuple(LOCAL_BUILDERS))]
    if os.path.isdir(spec):
        _skipped(spec, [f for f in found if f not in files], f"not {', '.join(LOCAL_BUILDERS)}")
    if not os.path.isdir(spec) and len(files) < len(found):
        bad = next(f for f in found if f not in files)
        raise ValueError(f"unsupported file type {bad!r}; local sources must be {', '.join(LOCAL_BUILDERS)} files")
    if not files:
        raise FileNotFoundError(f"no .txt/.jsonl/.parquet files match {spec!r}; valid sources: {VALID_SOURCES}")
    streams = {suffix: (builder, {"data_files": [f for f in files if f.endswith(suffix)], "split": "train", **options})
               for suffix, (builder, options) in LOCAL_BUILDERS.items() if any(f.endswith(suffix) for f in files)}
    return DatasetSource(name or spec, streams, files=files)


class WikiText103Source(DatasetSource):
    """WikiText-103 (raw). Rows are lines; a line `` = Title = `` starts a new article, which is one document.

    The hub copy stores the corpus's blank lines as empty rows; they come back as newlines (paragraph breaks).
    """

    def __init__(self):
        repo, splits = "Salesforce/wikitext", {"train": "train", "val": "validation", "test": "test"}
        streams = {theirs: (repo, {"name": "wikitext-103-raw-v1", "split": theirs}) for theirs in splits.values()}
        super().__init__("wikitext-103", streams, splits, repo=repo)

    def read(self, item: Any) -> Iterator[str]:
        article: list[str] = []
        for line in itertools.chain(super().read(item), [" = end = "]):  # the sentinel flushes the last article
            title = line.strip().startswith("= ") and line.strip().endswith(" =") and not line.strip().startswith("= =")
            if title and any(s.strip() for s in article):
                yield "".join(article)
                article = []
            article.append(line or "\n")


def get_source(spec: str) -> DatasetSource:
    """Turn a source spec into a :class:`Source` (see the module docstring for the specs)."""
    spec = str(spec)
    if spec == "python-docs":
        return local_files(os.path.dirname(python_docs_files()[0]), name=spec)
    if spec == "python-code" or spec.startswith("python-code:"):
        from .python_code import python_code

        return python_code(spec)
    if spec == "fineweb-edu" or spec.startswith("fineweb-edu:"):
        config, repo = spec.partition(":")[2] or "sample-10BT", "HuggingFaceFW/fineweb-edu"
        name = "fineweb-edu" if config == "sample-10BT" else f"fineweb-edu:{config}"
        return DatasetSource(name, {"train": (repo, {"name": config, "split": "train"})}, repo=repo)
    if spec == "wikitext-103":
        return WikiText103Source()
    if any(ch in spec for ch in "*?[") or os.path.exists(spec) or spec.endswith(tuple(LOCAL_BUILDERS)):
        return local_files(spec)
    raise ValueError(f"unknown source {spec!r}; valid: {VALID_SOURCES}")


if __name__ == "__main__" and sys.argv[1:] == ["--python-docs-json"]:
    # Run by python_docs() as `python -I -S sources.py --python-docs-json`: stdlib only, JSON on stdout.
    sys.stdout.write(json.dumps(_collect_python_docs()))
