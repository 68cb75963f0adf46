"""Text sources: each turns a spec string into documents (``str``), split into work items that prepare's worker
processes read independently and in order.

==========================  ===================================================================================
``python-docs``             offline: docstrings of the standard library (one document per module) and the
                            pydoc topics; ~1.8 MB of English every Python install has, for quickstarts and tests
``fineweb-edu[:CONFIG]``    HuggingFaceFW/fineweb-edu streamed from the hub (default config sample-10BT)
``wikitext-103``            Salesforce/wikitext wikitext-103-raw-v1; its own train/validation/test splits,
                            one document per article
a path, directory or glob   local ``.txt`` (one document per file), ``.jsonl`` (a ``text`` field per line) and
                            ``.parquet`` (a ``text`` column) files, read in sorted path order
==========================  ===================================================================================

A source object is small and picklable; ``read(item)`` runs in whichever process needs the documents.
"""

from __future__ import annotations

import contextlib
import glob
import importlib
import inspect
import io
import json
import os
import pkgutil
import sys
import warnings
from collections.abc import Iterator
from typing import Any

VALID_SOURCES = "python-docs, fineweb-edu[:config], wikitext-103, or a path/dir/glob of .txt/.jsonl/.parquet files"
LOCAL_SUFFIXES = (".txt", ".jsonl", ".parquet")


class Source:
    """Base class. ``splits`` names the source's own splits (ours -> theirs) when it has them, else None."""

    name: str = ""
    splits: dict[str, str] | None = None
    streamed: bool = False  # True when the size is unknown until everything is downloaded (hub streams)

    def check(self) -> None:
        """Raise a one-line error now if the documents cannot be reached (called before any heavy work)."""

    def work_items(self, split: str | None = None) -> list[Any]:
        raise NotImplementedError

    def read(self, item: Any) -> Iterator[str]:
        raise NotImplementedError

    def documents(self, split: str | None = None) -> Iterator[str]:
        """All documents in order (of one of the source's own splits, when it has them)."""
        for item in self.work_items(split):
            yield from self.read(item)

    def describe(self) -> dict[str, Any]:
        return {"spec": self.name}


# ---------------------------------------------------------------------------------------------- python-docs

# Importing these has side effects (a browser, printed text, a GUI, terminal control) or pulls in huge,
# low-value trees (the test suite, 100+ codec modules); distutils is shadowed by setuptools' copy.
_SKIP_MODULES = frozenset(
    {
        "antigravity", "this", "idlelib", "tkinter", "turtle", "turtledemo", "test", "lib2to3", "encodings",
        "distutils", "msilib", "readline", "rlcompleter", "pydoc_data",
    }
)


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


def python_docs() -> list[str]:
    """Every stdlib module's docstrings as one document each (sorted, packages walked), then the pydoc topics.

    Collected in a fresh ``python -I -S`` child: only the standard library is importable there, so no installed
    package can have patched it (torch replaces ``inspect.getfile``, for one), the corpus is the same in every
    process of a given Python build, and the imports' side effects stay out of this process.
    """
    import subprocess

    proc = subprocess.run(
        [sys.executable, "-I", "-S", os.path.abspath(__file__), "--python-docs-json"],
        capture_output=True, text=True, encoding="utf-8", timeout=600,
    )
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        raise RuntimeError(f"collecting the python-docs corpus failed in a child interpreter ({last}); use a local --source instead")
    return json.loads(proc.stdout)


def _collect_python_docs() -> list[str]:
    """The work behind :func:`python_docs`, run inside the child interpreter."""
    from pydoc_data.topics import topics

    docs = []
    queue = sorted(n for n in sys.stdlib_module_names if not n.startswith("_") and n not in _SKIP_MODULES)
    with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
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


class PythonDocsSource(Source):
    """The offline corpus; work items are consecutive groups of documents, built once in the main process."""

    name = "python-docs"

    def __init__(self, groups: int = 16):
        self.groups = groups
        self._docs: list[str] | None = None

    def _all(self) -> list[str]:
        if self._docs is None:
            self._docs = python_docs()
        return self._docs

    def work_items(self, split: str | None = None) -> list[Any]:
        docs = self._all()
        step = -(-len(docs) // self.groups)
        return [tuple(docs[i : i + step]) for i in range(0, len(docs), step)]

    def read(self, item: Any) -> Iterator[str]:
        yield from item

    def describe(self) -> dict[str, Any]:
        return {"spec": self.name, "python": sys.version.split()[0], "documents": len(self._all())}

    def __getstate__(self) -> dict:  # workers get documents through their items, not a second copy
        return {"groups": self.groups, "_docs": None}


# ---------------------------------------------------------------------------------------------- local files


class LocalFilesSource(Source):
    """``.txt`` (whole file = one document), ``.jsonl`` (``text`` per line), ``.parquet`` (``text`` column)."""

    def __init__(self, spec: str):
        self.name = spec
        self.files = _expand_local(spec)

    def work_items(self, split: str | None = None) -> list[Any]:
        return list(self.files)

    def read(self, item: Any) -> Iterator[str]:
        path = item
        if path.endswith(".txt"):
            with open(path, encoding="utf-8") as f:
                yield f.read()
        elif path.endswith(".jsonl"):
            with open(path, encoding="utf-8") as f:
                for lineno, line in enumerate(f, 1):
                    if not line.strip():
                        continue
                    try:
                        text = json.loads(line)["text"]
                    except (json.JSONDecodeError, KeyError, TypeError):
                        raise ValueError(f"{path}:{lineno} is not a JSON object with a 'text' field") from None
                    if not isinstance(text, str):
                        raise ValueError(f"{path}:{lineno}: 'text' must be a string, found {type(text).__name__}")
                    yield text
        else:
            try:
                import pyarrow.parquet as pq
            except ImportError:
                raise ImportError(f"reading {path} needs pyarrow: pip install pyarrow (it comes with the [hub] extra)") from None

            pf = pq.ParquetFile(path)
            if "text" not in pf.schema_arrow.names:
                raise ValueError(f"{path} has no 'text' column (columns: {', '.join(pf.schema_arrow.names)})")
            for batch in pf.iter_batches(columns=["text"], batch_size=4096):
                yield from (t for t in batch.column(0).to_pylist() if t is not None)

    def describe(self) -> dict[str, Any]:
        return {"spec": self.name, "files": len(self.files), "bytes": sum(os.path.getsize(f) for f in self.files)}


def _expand_local(spec: str) -> list[str]:
    if os.path.isdir(spec):
        pattern = os.path.join(spec, "**", "*")
    else:
        pattern = spec
    files = sorted(p for p in glob.glob(pattern, recursive=True) if os.path.isfile(p))
    if os.path.isfile(spec):
        files = [spec]
    bad = [f for f in files if not f.endswith(LOCAL_SUFFIXES)]
    if bad and not os.path.isdir(spec):
        raise ValueError(f"unsupported file type {bad[0]!r}; local sources must be {', '.join(LOCAL_SUFFIXES)} files")
    files = [f for f in files if f.endswith(LOCAL_SUFFIXES)]
    if not files:
        raise FileNotFoundError(f"no .txt/.jsonl/.parquet files match {spec!r}; valid sources: {VALID_SOURCES}")
    return files


# ---------------------------------------------------------------------------------------------- the hub


def _truthy(value: str | None) -> bool:
    return (value or "").strip().lower() in {"1", "true", "yes", "on"}


def check_hub(repo: str) -> None:
    """Fail fast, in one line, when the hub is unreachable (``datasets`` alone retries for ~25 s first)."""
    fix = "use --source python-docs or local files, or run on a machine with internet"
    if _truthy(os.environ.get("HF_HUB_OFFLINE")) or _truthy(os.environ.get("HF_DATASETS_OFFLINE")):
        raise RuntimeError(f"cannot reach the Hugging Face hub to stream {repo} (HF_HUB_OFFLINE is set); {fix}")
    from huggingface_hub import HfApi

    try:
        HfApi().dataset_info(repo, timeout=10)
    except Exception as exc:
        raise RuntimeError(
            f"cannot reach the Hugging Face hub to stream {repo} (offline? {type(exc).__name__}); {fix}"
        ) from None


class HubSource(Source):
    """A dataset streamed with ``datasets``; work items are the stream's shards (its parquet files)."""

    streamed = True
    repo = ""
    config = ""

    def _stream(self, split: str) -> Any:
        import datasets

        try:
            return datasets.load_dataset(self.repo, name=self.config, split=split, streaming=True)
        except Exception as exc:
            raise RuntimeError(
                f"cannot stream {self.repo} ({self.config}, {split}) from the Hugging Face hub: "
                f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
            ) from None

    def check(self) -> None:
        check_hub(self.repo)

    def work_items(self, split: str | None = None) -> list[Any]:
        self.check()
        hub_split = self.splits[split] if self.splits and split else "train"
        n = self._stream(hub_split).n_shards
        return [(hub_split, i, n) for i in range(n)]

    def _rows(self, item: Any) -> Iterator[str]:
        split, index, n = item
        for row in self._stream(split).shard(num_shards=n, index=index):
            yield row["text"]

    def read(self, item: Any) -> Iterator[str]:
        yield from self._rows(item)

    def describe(self) -> dict[str, Any]:
        return {"spec": self.name, "repo": self.repo, "config": self.config}


class FineWebEduSource(HubSource):
    """FineWeb-Edu; the paper trained on sample-10BT and held out 0.1B tokens for validation."""

    repo = "HuggingFaceFW/fineweb-edu"

    def __init__(self, config: str = "sample-10BT"):
        self.config = config
        self.name = "fineweb-edu" if config == "sample-10BT" else f"fineweb-edu:{config}"


class WikiText103Source(HubSource):
    """WikiText-103 (raw). Rows are lines; a line `` = Title = `` starts a new article, which is one document.

    The hub copy stores the corpus's blank lines as empty rows; they come back as newlines (paragraph breaks).
    """

    repo = "Salesforce/wikitext"
    config = "wikitext-103-raw-v1"
    name = "wikitext-103"
    splits = {"train": "train", "val": "validation", "test": "test"}

    def read(self, item: Any) -> Iterator[str]:
        article: list[str] = []
        for line in self._rows(item):
            line = line or "\n"
            if _is_article_title(line) and any(s.strip() for s in article):
                yield "".join(article)
                article = []
            article.append(line)
        if any(s.strip() for s in article):
            yield "".join(article)


def _is_article_title(line: str) -> bool:
    s = line.strip()
    return s.startswith("= ") and s.endswith(" =") and not s.startswith("= =")


# ---------------------------------------------------------------------------------------------- lookup


def get_source(spec: str) -> Source:
    """Turn a source spec into a :class:`Source` (see the module docstring for the specs)."""
    spec = str(spec)
    if spec == "python-docs":
        return PythonDocsSource()
    if spec == "fineweb-edu" or spec.startswith("fineweb-edu:"):
        return FineWebEduSource(spec.partition(":")[2] or "sample-10BT")
    if spec == "wikitext-103":
        return WikiText103Source()
    if any(ch in spec for ch in "*?[") or os.path.exists(spec) or spec.endswith(LOCAL_SUFFIXES):
        return LocalFilesSource(spec)
    raise ValueError(f"unknown source {spec!r}; valid: {VALID_SOURCES}")


if __name__ == "__main__" and sys.argv[1:] == ["--python-docs-json"]:
    # Run by python_docs() as `python -I -S sources.py --python-docs-json`: stdlib only, JSON on stdout.
    sys.stdout.write(json.dumps(_collect_python_docs()))
