"""Data pipeline: sources, tokenizers, prepare (litdata chunks + manifest), TokenDataModule, MLM masking.

CPU only, no network (an autouse guard refuses internet sockets). Preparing uses forked litdata workers, except
one CLI test that uses the default spawn start, as a real run does.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import socket

import numpy as np
import pytest
import torch

from cable_lightning.data.datamodule import TokenDataModule
from cable_lightning.data.manifest import read_manifest
from cable_lightning.data.prepare import main as prepare_main
from cable_lightning.data.prepare import prepare
from cable_lightning.data.sources import get_source, python_docs
from cable_lightning.data.tokenizers import EOT_TOKEN, get_tokenizer, train_bpe
from cable_lightning.errors import ConfigError
from cable_lightning.lit.masking import mask_tokens


@pytest.fixture(autouse=True)
def no_network(monkeypatch):
    real_connect = socket.socket.connect

    def guarded(self, address):
        if self.family in (socket.AF_INET, socket.AF_INET6):
            raise AssertionError(f"test tried to open a network connection to {address}")
        return real_connect(self, address)

    monkeypatch.setattr(socket.socket, "connect", guarded)


def read_split_tokens(path: str, split: str) -> np.ndarray:
    """Every token of a split in stream order: the held-out arrays as saved; train through litdata, in windows
    whose length divides every chunk's token count, so none is lost at a chunk's end."""
    from litdata import StreamingDataset, TokensLoader

    manifest = read_manifest(path)
    if split != "train":
        return np.load(os.path.join(path, manifest["splits"][split]["file"]))
    chunks = json.loads(open(os.path.join(path, "train", "index.json")).read())["chunks"]
    window = math.gcd(*[chunk["dim"] for chunk in chunks])
    dataset = StreamingDataset(os.path.join(path, "train"), item_loader=TokensLoader(block_size=window), shuffle=False)
    tokens = np.concatenate([np.asarray(dataset[i]) for i in range(len(dataset))])
    assert len(tokens) == manifest["splits"]["train"]["tokens"]
    return tokens


def joined(docs: list[str]) -> str:
    return "".join(doc + EOT_TOKEN for doc in docs)


def one_line(exc: pytest.ExceptionInfo) -> str:
    message = str(exc.value)
    assert "\n" not in message, message
    return message


SMALL_DOCS = [
    "The quick brown fox jumps over the lazy dog. " * 40,
    "Unicode survives: naïve café, 東京, emoji 🙂, tabs\tand\nnewlines.\n" * 30,
    "A document that mentions <|endoftext|> literally must keep it as text. " * 30,
    "def f(x):\n    return x * 2  # code is text too\n" * 40,
]


@pytest.fixture
def small_txt_dir(tmp_path):
    folder = tmp_path / "txt"
    folder.mkdir()
    for i, doc in enumerate(SMALL_DOCS):
        (folder / f"doc{i}.txt").write_text(doc, encoding="utf-8")
    (folder / "notes.md").write_text("ignored: not a corpus file")
    return str(folder)


def work_folders(out: str) -> list[str]:
    """What a prepare of ``out`` builds or retires beside it (``.<out>.partial-*``, ``.<out>.old-*``)."""
    parent, base = os.path.split(out)
    return [name for name in os.listdir(parent) if name.startswith((f".{base}.partial-", f".{base}.old-"))]


def fast_prepare(**kwargs):
    kwargs.setdefault("num_workers", 1)
    kwargs.setdefault("start_method", "fork")
    kwargs.setdefault("verbose", False)
    return prepare(**kwargs)


# ------------------------------------------------------------------------------------------------ prepare


def test_tiny_corpus_round_trips_exactly(tiny_corpus_dir, tiny_corpus_docs):
    """Decoding val then train gives back every input document, each followed by the end-of-text token."""
    _, docs = tiny_corpus_docs
    manifest = read_manifest(tiny_corpus_dir)
    val, train = read_split_tokens(tiny_corpus_dir, "val"), read_split_tokens(tiny_corpus_dir, "train")
    assert manifest["splits"]["val"]["tokens"] == len(val) and manifest["splits"]["train"]["tokens"] == len(train)
    tok = TokenDataModule(tiny_corpus_dir).load_tokenizer()
    assert tok.decode(np.concatenate([val, train]).tolist()) == joined(docs)
    assert int((train == manifest["eot_id"]).sum() + (val == manifest["eot_id"]).sum()) == len(docs)
    assert val[-1] == manifest["eot_id"], "validation must end on a document boundary"
    assert manifest["tokenizer"]["identity"]["name"] == "bpe:512" and manifest["vocab_size"] == 512
    assert manifest["dtype"] == "uint16"
    assert 0.15 < len(val) / (len(val) + len(train)) < 0.35  # val_fraction 0.25 of the characters


@pytest.mark.parametrize("fmt,val_tokens", [("txt", 1500), ("parquet", 50)])
def test_local_sources_round_trip(fmt, val_tokens, small_txt_dir, tmp_path):
    """txt: validation spans whole files and part of the next; parquet: part of one file."""
    if fmt == "txt":
        source = small_txt_dir
    else:
        import pyarrow as pa
        import pyarrow.parquet as pq

        source = str(tmp_path / "docs.parquet")
        pq.write_table(pa.table({"text": SMALL_DOCS, "id": list(range(len(SMALL_DOCS)))}), source)
    out = str(tmp_path / "out")
    manifest = fast_prepare(source=source, tokenizer="bpe:300", out=out, val_tokens=val_tokens)
    val = read_split_tokens(out, "val")
    stream = np.concatenate([val, read_split_tokens(out, "train")])
    tok = get_tokenizer(os.path.join(out, "tokenizer.json"), name="bpe:300")
    assert tok.decode(stream.tolist()) == joined(SMALL_DOCS)
    # The literal "<|endoftext|>" inside document 3 stays text: exactly one separator per document.
    assert int((stream == manifest["eot_id"]).sum()) == len(SMALL_DOCS)
    assert manifest["splits"]["val"]["tokens"] >= val_tokens
    assert 1 <= int((val == manifest["eot_id"]).sum()) < len(SMALL_DOCS)
    assert work_folders(out) == []


def test_rerun_is_a_noop_that_says_so(tiny_corpus_dir, capsys):
    manifest = read_manifest(tiny_corpus_dir)
    request = manifest["request"]
    chunk = os.path.join(tiny_corpus_dir, "train", "chunk-0-0.bin")
    before = os.stat(chunk).st_mtime_ns
    again = prepare(
        source=request["source"], tokenizer=request["tokenizer"], out=tiny_corpus_dir,
        val_fraction=request["val_fraction"], val_tokens=request["val_tokens"],
    )
    assert again == manifest
    assert "already prepared" in capsys.readouterr().out
    assert os.stat(chunk).st_mtime_ns == before


def test_conflicting_request_needs_overwrite(small_txt_dir, tmp_path):
    out = str(tmp_path / "out")
    fast_prepare(source=small_txt_dir, tokenizer="bpe:300", out=out, val_tokens=50)
    with pytest.raises(FileExistsError) as exc:
        fast_prepare(source=small_txt_dir, tokenizer="bpe:320", out=out, val_tokens=50)
    assert "--overwrite" in one_line(exc) and out in str(exc.value)
    manifest = fast_prepare(source=small_txt_dir, tokenizer="bpe:320", out=out, val_tokens=50, overwrite=True)
    assert manifest["vocab_size"] == 320 and read_manifest(out)["vocab_size"] == 320


def test_unfinished_output_is_not_mistaken_for_data(small_txt_dir, tmp_path):
    out = tmp_path / "out"
    (out / "train").mkdir(parents=True)
    with pytest.raises(FileExistsError) as exc:
        fast_prepare(source=small_txt_dir, tokenizer="bpe:300", out=str(out), val_tokens=50)
    assert "was not written by prepare" in one_line(exc) and "--overwrite replaces only" in one_line(exc)


def test_cli_with_spawned_workers(small_txt_dir, tmp_path, capsys):
    """The real start method (spawn): the mapped function must be importable by fresh worker processes."""
    out = str(tmp_path / "cli")
    assert prepare_main(["--source", small_txt_dir, "--tokenizer", "bpe:300", "--out", out, "--val-tokens", "50",
                         "--num-workers", "1", "--quiet"]) == 0
    assert read_manifest(out)["splits"]["train"]["tokens"] > 0
    with pytest.raises(SystemExit) as exit_info:
        prepare_main(["--source", small_txt_dir, "--tokenizer", "bpe:400", "--out", out, "--quiet"])
    assert exit_info.value.code == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert len(err) == 1 and "--overwrite" in err[0]


def test_bad_requests_are_one_line_errors(small_txt_dir, tmp_path):
    out = str(tmp_path / "x")
    cases = [
        (dict(source="no-such-source"), ValueError, "valid:"),
        (dict(source=str(tmp_path / "missing" / "*.jsonl")), FileNotFoundError, "no .txt/.jsonl/.parquet files"),
        (dict(source=small_txt_dir, tokenizer="wordpiece"), ValueError, "unknown tokenizer"),
        (dict(source=small_txt_dir, tokenizer="bpe:100"), ValueError, "N >= 258"),
        (dict(source=small_txt_dir, val_fraction=1.5), ValueError, "(0, 1)"),
        (dict(source=small_txt_dir, val_fraction=0.1, val_tokens=5), ValueError, "not both"),
        (dict(source="fineweb-edu", val_fraction=0.1), ValueError, "--val-tokens"),
        (dict(source="wikitext-103", val_tokens=1000), ValueError, "own validation split"),
        (dict(source=small_txt_dir, tokenizer="bpe:300", val_fraction=0.99), ValueError, "too small"),
    ]
    for kwargs, error, text in cases:
        kwargs.setdefault("tokenizer", "bpe:300")
        with pytest.raises(error) as exc:
            fast_prepare(out=out, **kwargs)
        assert text in one_line(exc), (kwargs, str(exc.value))


def test_jsonl_without_text_field_names_file_and_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"text": "fine"}\n{"body": "no text here"}\n')
    with pytest.raises(ValueError) as exc:
        list(get_source(str(path)).documents())
    assert f"{path}:2" in one_line(exc)


# Run in a child interpreter: forked workers run `dying`, which SIGKILLs the worker that reads doc2.txt, but only
# once the watchdog has looked at it (it writes `go` on the first look after `ready` exists), so the kill is always
# seen; a watchdog that missed it would let the run "succeed" without doc2/doc3, and a hang would hit the timeout.
KILL_SCRIPT = """
import functools, os, signal, sys, time
import cable_lightning.data.litdata_workers as workers
import cable_lightning.data.prepare as prep

ready, go = sys.argv[1] + ".ready", sys.argv[1] + ".go"
real_tokenize, real_look = prep.tokenize_work, workers.Watchdog.look

def dying(work, **kwargs):
    if work[0] == (".txt", 2):
        open(ready, "w").close()
        for _ in range(600):
            if os.path.exists(go):
                break
            time.sleep(0.1)
        os.kill(os.getpid(), signal.SIGKILL)
    yield from real_tokenize(work, **kwargs)

def look(self):
    seen = os.path.exists(ready)
    cause = real_look(self)
    if seen:
        open(go, "w").close()
    return cause

prep.tokenize_work, workers.Watchdog.look = dying, look
prep.prepare = functools.partial(prep.prepare, start_method="fork")
sys.exit(prep.main(sys.argv[2:]))
"""


def test_killed_worker_fails_fast_with_one_line_and_a_rerun_works(small_txt_dir, tmp_path):
    """A worker killed mid-run (say, for memory): prepare stops with one line, writes no <out>, releases the lock,
    leaves no helper process holding its output pipe, and the same command then succeeds."""
    import subprocess
    import sys

    out = str(tmp_path / "out")
    args = ["--source", small_txt_dir, "--tokenizer", "bpe:300", "--out", out, "--val-tokens", "50",
            "--num-workers", "2", "--quiet"]
    proc = subprocess.run([sys.executable, "-c", KILL_SCRIPT, str(tmp_path / "flag"), *args],
                          capture_output=True, text=True, timeout=180, check=False)
    assert proc.returncode == 1, proc.stderr  # a run that failed, as fit's
    error = proc.stderr.strip().splitlines()[-1]
    assert error.startswith(f"error: tokenizing into {out} failed: worker pid "), proc.stderr
    assert "was killed by signal 9 (SIGKILL; out of memory?)" in error and "run the same command again" in error
    assert not os.path.exists(out) and work_folders(out) == []
    manifest = fast_prepare(source=small_txt_dir, tokenizer="bpe:300", out=out, val_tokens=50, num_workers=2)
    stream = np.concatenate([read_split_tokens(out, "val"), read_split_tokens(out, "train")])
    tok = get_tokenizer(os.path.join(out, "tokenizer.json"), name="bpe:300")
    assert tok.decode(stream.tolist()) == joined(SMALL_DOCS) and manifest["splits"]["train"]["tokens"] > 0
    assert work_folders(out) == []


def test_a_process_a_worker_leaves_behind_is_ended_with_the_run(small_txt_dir, tmp_path, monkeypatch):
    """A process a worker started whose parent exits before the watchdog looks (litdata starts helpers in its workers)
    was re-parented to init, unseen, holding our stdout: the suite's `pytest | tail` once waited on such a process.
    Here a worker's child forks it and exits at once; it must be gone (ended and reaped) when prepare returns."""
    import signal
    import time

    import cable_lightning.data.prepare as prep

    pid_file, real_tokenize = tmp_path / "orphan", prep.tokenize_work

    def leaving(work, **kwargs):
        if work[0] == (".txt", 2):
            if os.fork() == 0:  # the worker's child: forks the orphan and exits before anyone looks
                if os.fork() == 0:
                    pid_file.write_text(str(os.getpid()))
                    time.sleep(60)
                os._exit(0)
            for _ in range(200):  # the orphan's pid is written before the worker raises
                if pid_file.exists() and pid_file.read_text():
                    break
                time.sleep(0.05)
            raise ValueError("a worker's error after its child forked")
        yield from real_tokenize(work, **kwargs)

    monkeypatch.setattr(prep, "tokenize_work", leaving)
    try:
        with pytest.raises(RuntimeError, match="a worker's error after its child forked"):
            fast_prepare(source=small_txt_dir, tokenizer="bpe:300", out=str(tmp_path / "out"), val_tokens=50,
                         num_workers=2)
        orphan = int(pid_file.read_text())
        assert not os.path.exists(f"/proc/{orphan}"), f"process {orphan} outlived the run (or was left a zombie)"
    finally:
        if pid_file.exists() and pid_file.read_text():
            try:
                os.kill(int(pid_file.read_text()), signal.SIGKILL)
            except ProcessLookupError:
                pass


@pytest.mark.parametrize("case", ["jsonl-row-with-other-fields", "txt-not-utf8"])
def test_bad_file_read_by_a_worker_is_named_with_its_cause(case, tmp_path):
    """The bad file is past the validation head and the tokenizer is a file (no BPE training reads the corpus
    here), so a litdata worker is the first to read it; its error must come back with the file and the cause."""
    folder = tmp_path / "corpus"
    folder.mkdir()
    suffix = case.split("-")[0]
    for i, doc in enumerate(SMALL_DOCS):
        text = json.dumps({"text": doc}) + "\n" if suffix == "jsonl" else doc
        (folder / f"doc{i}.{suffix}").write_text(text, encoding="utf-8")
    bad = folder / f"doc2.{suffix}"
    if suffix == "jsonl":
        bad.write_text(json.dumps({"text": "fine"}) + "\n" + json.dumps({"body": "no text"}) + "\n")
        named, cause = str(bad), "CastError: Couldn't cast"  # datasets' multi-line error, naming no file
    else:
        bad.write_bytes("café in latin-1 ".encode("latin-1") * 20)
        named, cause = str(bad), "UnicodeDecodeError"
    with pytest.raises(ValueError) as exc:  # read here, in this process
        list(get_source(str(folder)).documents())
    assert named in one_line(exc) and cause in str(exc.value)

    tokenizer = str(tmp_path / "tokenizer.json")
    train_bpe(SMALL_DOCS, 300).save(tokenizer)
    out = str(tmp_path / "out")
    with pytest.raises(RuntimeError) as exc:
        fast_prepare(source=str(folder), tokenizer=tokenizer, out=out, val_tokens=50, num_workers=2)
    message = one_line(exc)
    assert f"tokenizing into {out} failed in a worker: ValueError: {named}" in message, message
    assert cause in message and f"nothing was written to {out}" in message
    assert not os.path.exists(out)


# ------------------------------------------------------------------------------------------------ sources


def test_python_docs_is_real_text_and_deterministic():
    docs = python_docs()
    assert len(docs) >= 300
    assert sum(len(d) for d in docs) > 1_000_000
    assert any(d.startswith("Module json\n") for d in docs)
    assert any(d.startswith("Topic ") for d in docs)
    assert all(d.strip() for d in docs)
    # torch (imported here) replaces inspect.getfile; the corpus comes from a clean interpreter regardless.
    assert any("\ngetfile\n\nWork out which source or compiled file" in d for d in docs)
    assert python_docs() == docs


@pytest.mark.parametrize("source,repo", [("fineweb-edu", "HuggingFaceFW/fineweb-edu"),
                                         ("wikitext-103", "Salesforce/wikitext")])
def test_offline_hub_is_one_clear_line(source, repo, monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    kwargs = {"val_tokens": 1000} if source == "fineweb-edu" else {}
    with pytest.raises(RuntimeError) as exc:
        fast_prepare(source=source, tokenizer="bpe:512", out=str(tmp_path / "hub"), **kwargs)
    message = one_line(exc)
    assert repo in message and "python-docs" in message and "HF_HUB_OFFLINE" in message  # said before any retry
    assert not os.path.exists(tmp_path / "hub")


class StandIn:
    """A one-shard stand-in for a `datasets` streaming dataset."""

    n_shards = 1

    def __init__(self, rows):
        self.rows = rows

    def shard(self, num_shards, index):
        return iter(self.rows)


def test_wikitext_articles_split_on_titles():
    from cable_lightning.data.sources import WikiText103Source

    lines = ["", " = Alpha = \n", "", " text a \n", " = = Section = = \n", " more a \n", " = Beta = \n", " text b \n"]
    src = WikiText103Source()
    src.files, src.streams = ["lines"], {"lines": ("text", {"data_files": ["lines"]})}
    src._open["lines"] = StandIn([{"text": line} for line in lines])  # what the hub stream yields: one row per line
    docs = list(src.read(("lines", 0)))
    assert docs == ["\n = Alpha = \n\n text a \n = = Section = = \n more a \n", " = Beta = \n text b \n"]


# ------------------------------------------------------------------------------------------------ python-code


def code(name: str, lines: int = 12) -> str:
    """A distinct Python file's text."""
    return "".join(f"def {name}_{i}(value):\n    return value * {i} + len({name!r})\n\n" for i in range(lines))


def fake_distribution(site, name: str, version: str, files: dict[str, bytes | None], record: bool = True) -> None:
    """``files`` written under ``site`` and listed in ``<name>-<version>.dist-info``'s RECORD, as pip leaves them."""
    info = site / f"{name.replace('-', '_')}-{version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    for path, data in files.items():
        (site / path).parent.mkdir(parents=True, exist_ok=True)
        if data is not None:
            (site / path).write_bytes(data)
        else:  # listed, but a folder: a file that cannot be read
            (site / path).mkdir()
    if record:
        (info / "RECORD").write_text("".join(f"{p},,\n" for p in [*files, f"{info.name}/METADATA"]))


@pytest.fixture
def fake_python(tmp_path, monkeypatch):
    """A standard library and a site-packages folder with three distributions, two trained and one held out (names
    chosen by the source's own rule), with a vendored copy, files that are not text, an empty one and a file no
    distribution lists. Returns ({split: its documents in order}, the distributions' names in order (the stdlib,
    two trained, one held out), a file of the held-out one)."""
    import sys

    from cable_lightning.data import python_code

    def first(prefix, held):
        return next(f"{prefix}-{i}" for i in range(10_000) if python_code.held_out(f"{prefix}-{i}") == held)

    alpha, beta, gamma = first("alpha", False), first("beta", False), first("gamma", True)
    stdlib, site = tmp_path / "stdlib", tmp_path / "site"
    std = {"json/__init__.py": code("json_init"), "abc.py": code("abc")}
    for path, text in std.items():
        (stdlib / path).parent.mkdir(parents=True, exist_ok=True)
        (stdlib / path).write_text(text)
    (stdlib / "latin1.py").write_bytes("x = 'café'\n".encode("latin-1"))  # not UTF-8
    (stdlib / "site-packages").mkdir()
    (stdlib / "site-packages" / "other.py").write_text(code("another_interpreters_package"))
    fake_distribution(site, alpha, "1.0", {"alpha/core.py": code("core").encode(), "alpha/__init__.py": b"\n",
                                           "alpha/blob.py": b"x = 1\0\n", "alpha/data.txt": b"not python"})
    fake_distribution(site, beta, "2.5", {"beta/mod.py": code("mod").encode(),
                                          "beta/_vendor/core.py": code("core").encode()})  # a vendored copy
    fake_distribution(site, gamma, "0.3", {"gamma/util.py": code("util").encode(),
                                           "gamma/a.py": code("gamma_a").encode(),
                                           "gamma/_vendor/abc.py": code("abc").encode()})  # the stdlib's copy
    (site / "stray.py").write_text(code("stray"))
    monkeypatch.setattr(python_code, "python_environment", lambda: (str(stdlib), [str(site)]))
    stdlib_name = f"python-{sys.version_info.major}.{sys.version_info.minor}"
    by_dist = {stdlib_name: [code("abc"), code("json_init")], alpha: [code("core")], beta: [code("mod")],
               gamma: [code("gamma_a"), code("util")]}
    splits = {name: "val" if name != stdlib_name and python_code.held_out(name) else "train" for name in by_dist}
    expected = {split: [doc for name, docs in by_dist.items() if splits[name] == split for doc in docs]
                for split in ("train", "val")}
    return expected, [*by_dist], site / "gamma" / "util.py"


def stream_documents(out: str, split: str) -> list[str]:
    tok = get_tokenizer(os.path.join(out, "tokenizer.json"), name="bpe:300")
    text = tok.decode(read_split_tokens(out, split).tolist())
    assert text.endswith(EOT_TOKEN)
    return text.split(EOT_TOKEN)[:-1]


def test_python_code_reads_each_text_file_once_in_order(fake_python, capsys):
    """One document per .py file: the stdlib first, then distributions by name, files by path; a vendored copy, files
    that are not text, an empty one and one that no distribution lists are left out, each said in one line."""
    expected, names, _ = fake_python
    source = get_source("python-code")
    assert list(source.documents("train")) == expected["train"]
    assert list(source.documents("val")) == expected["val"]
    said = capsys.readouterr().err.splitlines()
    assert len(said) == 4 and all(line.startswith("source python-code: skipping ") for line in said), said
    assert "2 files (exact copies" in said[0] and "_vendor/core.py" in said[0] and "_vendor/abc.py" in said[0]
    assert "2 files (not UTF-8 text, or NUL bytes)" in said[1] and "1 files (empty)" in said[2]
    assert "stray.py" in said[3]
    described = source.describe()
    assert described["documents"] == {"train": len(expected["train"]), "val": len(expected["val"])}
    assert described["dropped"] == {"duplicates": 2, "not_text": 2, "empty": 1, "editable": 0, "unowned": 1}
    stdlib, alpha, _, gamma = names  # a selection, in any spelling, keeps those distributions in the same order
    chosen = get_source(f"python-code:{gamma.upper()}, {stdlib.replace('-', '_')},{alpha}")
    assert chosen.name == f"python-code:{stdlib},{alpha},{gamma}"
    assert [d["name"] for d in chosen.describe()["distributions"]] == [stdlib, alpha, gamma]


def test_python_code_holds_out_whole_distributions(fake_python, tmp_path, monkeypatch):
    """Validation is every file of the held-out distributions and nothing else; the manifest says which went where.
    The standard library always trains, whatever its version's name hashes to (python-3.12's is in the held-out
    share: a lent GPU's image would otherwise validate on its whole library)."""
    from types import SimpleNamespace

    from cable_lightning.data import python_code
    from cable_lightning.data.python_code import held_out

    assert held_out("python-3.12")
    with monkeypatch.context() as patch:
        patch.setattr(python_code, "sys", SimpleNamespace(version_info=SimpleNamespace(major=3, minor=12)))
        library = python_code._stdlib(str(tmp_path))
    assert (library.name, library.split) == ("python-3.12", "train")

    expected, names, _ = fake_python
    gamma = names[-1]
    out = str(tmp_path / "code")
    manifest = fast_prepare(source="python-code", tokenizer="bpe:300", out=out)
    train, val = stream_documents(out, "train"), stream_documents(out, "val")
    assert train == expected["train"] and val == expected["val"]
    dists = manifest["source"]["distributions"]
    assert [d["split"] for d in dists] == ["train"] + ["val" if held_out(d["name"]) else "train" for d in dists[1:]]
    assert {d["name"]: d["version"] for d in dists if d["split"] == "val"}.get(gamma) == "0.3"
    gamma_files = [code("gamma_a"), code("util")]
    assert not set(gamma_files) & set(train) and set(gamma_files) <= set(val)
    assert manifest["splits"]["val"]["tokens"] == len(read_split_tokens(out, "val"))


def test_python_code_two_workers_give_one_workers_tokens_and_the_hash_tells_corpora_apart(fake_python, tmp_path,
                                                                                         monkeypatch):
    """Work items of one file each, read by two workers, give the one-worker stream token for token; the corpus hash
    is the same for the same files and changes with a file's content."""
    from cable_lightning.data import python_code

    _, _, gamma_file = fake_python
    monkeypatch.setattr(python_code, "ITEM_BYTES", 1)
    assert len(get_source("python-code").work_items("train")) >= 4
    one = fast_prepare(source="python-code", tokenizer="bpe:300", out=str(tmp_path / "one"))
    tokenizer = str(tmp_path / "one" / "tokenizer.json")
    two = fast_prepare(source="python-code", tokenizer=tokenizer, out=str(tmp_path / "two"), num_workers=2)
    for split in ("train", "val"):
        np.testing.assert_array_equal(read_split_tokens(str(tmp_path / "two"), split),
                                      read_split_tokens(str(tmp_path / "one"), split))
    assert two["source"]["corpus_hash"] == one["source"]["corpus_hash"]
    assert two["source"]["distributions"] == one["source"]["distributions"]
    gamma_file.write_text(gamma_file.read_text().replace("value", "values"))
    assert get_source("python-code").describe()["corpus_hash"] != one["source"]["corpus_hash"]


def test_python_code_hash_does_not_depend_on_where_an_editable_project_lives(fake_python, tmp_path, capsys):
    """An editable install lists only the installer's generated finder, which holds the checkout's absolute path: two
    checkouts at different paths give one corpus and one hash, and the left-out file is said in one line."""
    from cable_lightning.data import python_code

    site = tmp_path / "site"
    editable = next(f"mine-{i}" for i in range(10_000) if not python_code.held_out(f"mine-{i}"))
    finder = f"__editable___{editable.replace('-', '_')}_0_1_finder.py"
    fake_distribution(site, editable, "0.1", {finder: b""})
    info = site / f"{editable.replace('-', '_')}-0.1.dist-info"
    (info / "direct_url.json").write_text('{"dir_info": {"editable": true}, "url": "file:///one"}')
    hashes, trained = [], []
    for checkout in ("/home/a/checkout", "/srv/b/another/checkout"):
        (site / finder).write_text(f"MAPPING = {{'mine': {checkout + '/mine'!r}}}\n" + code("finder"))
        source = get_source("python-code")
        hashes.append(source.describe()["corpus_hash"])
        trained.append(list(source.documents("train")))
    assert hashes[0] == hashes[1] and trained[0] == trained[1]
    assert not any("checkout" in doc for doc in trained[0])
    said = [line for line in capsys.readouterr().err.splitlines() if "editable install" in line]
    assert said and said[0].startswith("source python-code: skipping 1 files (generated by an editable install")
    assert source.describe()["dropped"]["editable"] == 1


def test_every_prepared_source_has_a_corpus_hash_of_its_text_wherever_it_lies(tiny_corpus_dir, tmp_path):
    """python-docs (its cache's jsonl parts) and local files had no corpus hash, so report mixed their runs with
    python-code runs without a word: the hash is over the files' contents in order, not their paths."""
    from cable_lightning.data.sources import local_files

    assert read_manifest(tiny_corpus_dir)["source"]["corpus_hash"]
    hashes = []
    for folder in ("one", "elsewhere/two"):
        parts = tmp_path / folder
        parts.mkdir(parents=True)
        for i in range(2):
            (parts / f"part-{i:02d}.jsonl").write_text(json.dumps({"text": f"document {i}"}) + "\n")
        hashes.append(local_files(str(parts), name="python-docs").describe()["corpus_hash"])
    assert hashes[0] == hashes[1] and len(hashes[0]) == 64
    (tmp_path / "one" / "part-01.jsonl").write_text(json.dumps({"text": "document 2"}) + "\n")
    assert local_files(str(tmp_path / "one"), name="python-docs").describe()["corpus_hash"] != hashes[0]


def test_python_code_bad_environments_are_one_line_errors(tmp_path, monkeypatch, capsys):
    """An empty environment, an unknown or one-sided selection, a distribution whose file cannot be read or whose
    RECORD is missing: one line, exit 2, before any output is written."""
    from cable_lightning.data import python_code

    stdlib, site = tmp_path / "stdlib", tmp_path / "site"
    stdlib.mkdir()
    site.mkdir()
    monkeypatch.setattr(python_code, "python_environment", lambda: (str(stdlib), [str(site)]))
    trained = next(f"lib-{i}" for i in range(10_000) if not python_code.held_out(f"lib-{i}"))

    def error(spec, *extra):
        with pytest.raises(SystemExit) as exit_info:
            prepare_main(["--source", spec, "--tokenizer", "bpe:300", "--out", str(tmp_path / "out"), "--quiet",
                          *extra])
        lines = capsys.readouterr().err.splitlines()
        assert exit_info.value.code == 2 and len(lines) == 1 and lines[0].startswith("error: "), lines
        assert not (tmp_path / "out").exists()
        return lines[0]

    assert "python-code found no .py files in the standard library" in error("python-code")
    (stdlib / "os.py").write_text(code("os"))
    fake_distribution(site, trained, "1.0", {"lib/a.py": code("a").encode()})
    assert "has no val files" in error(f"python-code:{trained}")  # not held out
    assert "no distribution named nosuch-pkg here" in error("python-code:nosuch_pkg")
    assert "python-code: has an empty name" in error("python-code:")
    held = next(f"lib-{i}" for i in range(10_000) if python_code.held_out(f"lib-{i}"))
    fake_distribution(site, held, "2.0", {"held/a.py": code("held_a").encode(), "held/b.py": None})
    message = error(f"python-code:{held}")
    assert "has no train files" in message and trained in message.partition("e.g. one of ")[2]
    assert f"held/b.py of {held} 2.0 cannot be read (IsADirectoryError" in error("python-code")
    assert "own validation split" in error(f"python-code:{held},{trained}", "--val-tokens", "100")
    fake_distribution(site, "no-record", "1.0", {"nr/a.py": code("nr").encode()}, record=False)
    assert "distribution no-record 1.0 lists no files (its RECORD" in error("python-code")


# ------------------------------------------------------------------------------------------------ tokenizers


def test_tokenizer_identity_tells_vocabularies_apart(tiny_corpus_dir):
    text = SMALL_DOCS * 3
    a, b, c = train_bpe(text, 300), train_bpe(text, 300), train_bpe(text, 320)
    assert a.identity == b.identity, "training is deterministic"
    assert a.identity["hash"] != c.identity["hash"]
    assert (a.eot_id, a.mask_id) == (0, 1) and a.special_ids == (0, 1)
    info = TokenDataModule(tiny_corpus_dir).describe()
    info.check_tokenizer(info.tokenizer)
    with pytest.raises(ValueError) as exc:
        info.check_tokenizer(c.identity)
    message = one_line(exc)
    assert "bpe:320" in message and "bpe:512" in message


def test_gpt2_from_a_local_rank_file(tmp_path):
    import base64

    ranks = {bytes([i]): i for i in range(256)}
    ranks.update({b"th": 256, b"the": 257, b" the": 258})
    path = str(tmp_path / "tiny.tiktoken")
    with open(path, "w") as f:  # the .tiktoken format: base64 token, space, rank
        f.writelines(f"{base64.b64encode(token).decode()} {rank}\n" for token, rank in ranks.items())
    tok = get_tokenizer(f"gpt2:{path}")
    assert (tok.vocab_size, tok.eot_id, tok.mask_id) == (260, 259, 260)  # like GPT-2: 50257, 50256, 50257
    text = "the theme of the day <|endoftext|> stays text"
    ids = tok.encode_batch([text])[0]
    assert 258 in ids and tok.eot_id not in ids
    assert tok.decode(ids) == text
    assert tok.identity["kind"] == "tiktoken" and tok.identity == get_tokenizer(f"gpt2:{path}").identity


def test_gpt2_download_failure_is_one_line(monkeypatch):
    import requests
    import tiktoken

    def offline(name):
        raise requests.exceptions.ConnectionError("Failed to resolve 'openaipublic.blob.core.windows.net'")

    monkeypatch.setattr(tiktoken, "get_encoding", offline)
    with pytest.raises(RuntimeError) as exc:
        get_tokenizer("gpt2")
    assert "gpt2:/path/to/r50k_base.tiktoken" in one_line(exc)


def test_bert_from_a_local_vocab(tmp_path):
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "hello", "world", "token", "##s", ",", "."]
    path = tmp_path / "vocab.txt"
    path.write_text("\n".join(vocab) + "\n")
    tok = get_tokenizer(f"bert:{path}")
    assert (tok.eot_id, tok.mask_id, tok.vocab_size) == (3, 4, len(vocab))
    assert tok.encode_batch(["Hello, tokens world."])[0] == [5, 9, 7, 8, 6, 10]  # lower-cased, no [CLS]/[SEP] added
    assert set(tok.special_ids) == {0, 1, 2, 3, 4}
    assert tok.identity["kind"] == "wordpiece"


def test_bpe_spec_alone_is_not_loadable():
    with pytest.raises(ValueError) as exc:
        get_tokenizer("bpe:4096")
    assert "tokenizer.json" in one_line(exc)


# ------------------------------------------------------------------------------------------------ datamodule


def test_datamodule_describes_the_manifest(tiny_corpus_dir):
    info = TokenDataModule(tiny_corpus_dir, block_size=64, eval_lengths=[64, 128], eval_stride=32).describe()
    assert (info.vocab_size, info.eot_id, info.mask_id, info.special_ids) == (512, 0, 1, (0, 1))
    assert info.tokenizer == read_manifest(tiny_corpus_dir)["tokenizer"]["identity"]
    assert info.block_size == 64 and info.eval_specs == ((64, 64), (128, 128), (64, 32), (128, 32))
    assert type(info).from_dict(json.loads(json.dumps(info.as_dict()))) == info, "survives a plain-values round trip"


def test_train_batches(tiny_corpus_dir):
    dm = TokenDataModule(tiny_corpus_dir, block_size=64, micro_batch_size=4)
    loader = dm.train_dataloader()
    train_tokens = read_manifest(tiny_corpus_dir)["splits"]["train"]["tokens"]
    assert len(loader) == train_tokens // 65 // 4
    batches = [b for _, b in zip(range(3), loader)]
    for batch in batches:
        assert batch.shape == (4, 65) and batch.dtype == torch.int64
        assert 0 <= int(batch.min()) and int(batch.max()) < 512
    assert not torch.equal(batches[0], batches[1])
    # Windows are real stretches of the stream: the first window is found verbatim in the train tokens.
    stream = read_split_tokens(tiny_corpus_dir, "train")
    first = batches[0][0].numpy()
    starts = np.flatnonzero(stream[: len(stream) - 64] == first[0])
    assert any(np.array_equal(stream[s : s + 65], first) for s in starts)


def test_shuffle_depends_on_seed(tiny_corpus_dir):
    first = [next(iter(TokenDataModule(tiny_corpus_dir, block_size=32, seed=s).train_dataloader())) for s in (1, 1, 2)]
    assert torch.equal(first[0], first[1]) and not torch.equal(first[0], first[2])


def test_val_loaders_per_length(tiny_corpus_dir):
    dm = TokenDataModule(tiny_corpus_dir, block_size=64, micro_batch_size=4, eval_lengths=[32, 64, 256],
                         eval_tokens=2048)
    loaders = dm.val_dataloader()
    assert dm.eval_specs() == [(32, 32), (64, 64), (256, 256)]
    assert isinstance(loaders, list) and len(loaders) == 3
    val = torch.from_numpy(read_split_tokens(tiny_corpus_dir, "val").astype(np.int64))
    for length, loader, batch_size in zip([32, 64, 256], loaders, [4, 4, 1]):
        batches = list(loader)
        assert batches[0]["tokens"].shape == (batch_size, length + 1)
        windows = torch.cat([b["tokens"] for b in batches])
        scored = sum(int((length - b["first_scored"]).sum()) for b in batches)
        assert scored == 2048, "every length scores the same eval_tokens targets"
        assert len(windows) == -(-2048 // length)
        assert torch.equal(windows[0], val[: length + 1])  # the head of the val split
        if len(windows) > 1:
            assert torch.equal(windows[1], val[length : 2 * length + 1])  # non-overlapping: next window
    single = TokenDataModule(tiny_corpus_dir, block_size=64, eval_tokens=1024).val_dataloader()
    assert isinstance(single, torch.utils.data.DataLoader)


def test_sliding_eval_specs(tiny_corpus_dir):
    dm = TokenDataModule(tiny_corpus_dir, block_size=64, eval_lengths=[32, 128], eval_stride=64, eval_tokens=1024)
    assert dm.eval_specs() == [(32, 32), (128, 128), (128, 64)]
    sliding = dm.val_dataloader()[2]
    assert sum(int((128 - b["first_scored"]).sum()) for b in sliding) == 1024


def test_eval_length_longer_than_val_is_named(tiny_corpus_dir):
    val_tokens = read_manifest(tiny_corpus_dir)["splits"]["val"]["tokens"]
    dm = TokenDataModule(tiny_corpus_dir, eval_lengths=[64, 1_000_000])
    with pytest.raises(ValueError) as exc:
        dm.val_dataloader()
    message = one_line(exc)
    assert "1000000" in message and str(val_tokens) in message


def _take(iterator, n):
    return [next(iterator) for _ in range(n)]


def test_resume_continues_the_exact_stream(tiny_corpus_dir):
    """Consume k batches, save the loader's state (what Lightning stores in a checkpoint), rebuild from it: the
    next batches are the uninterrupted run's. litdata itself refuses a state that no longer fits the data."""
    settings = dict(block_size=32, micro_batch_size=4, seed=7)
    expected = _take(iter(TokenDataModule(tiny_corpus_dir, **settings).train_dataloader()), 11)

    loader = TokenDataModule(tiny_corpus_dir, **settings).train_dataloader()
    it = iter(loader)
    assert all(torch.equal(a, b) for a, b in zip(_take(it, 6), expected[:6]))
    state = loader.state_dict()
    assert state["num_samples_yielded"] == 6 * 4

    resumed = TokenDataModule(tiny_corpus_dir, **settings).train_dataloader()
    resumed.load_state_dict(state)
    assert all(torch.equal(a, b) for a, b in zip(_take(iter(resumed), 5), expected[6:]))

    other = TokenDataModule(tiny_corpus_dir, **{**settings, "block_size": 64}).train_dataloader()
    other.load_state_dict(state)
    with pytest.raises(ValueError, match="`item_loader`"):  # refused before, by the model (trained at block_size 32)
        next(iter(other))
    reseeded = TokenDataModule(tiny_corpus_dir, **{**settings, "seed": 8}).train_dataloader()
    with pytest.raises(ConfigError, match="shuffled with data.seed 7, this run.s data.seed is 8; resume with"):
        reseeded.load_state_dict(state)


def test_a_resume_on_fewer_processes_continues_with_the_epochs_unseen_windows(small_corpus_dir, monkeypatch):
    """Two ranks read 2 batches each, and rank 0's loader state (what a checkpoint holds) is resumed by one process:
    litdata resumes elastically, with exactly the windows neither rank read in that epoch (none twice, none lost),
    then the one-process run's next epoch. (Environment variables stand in for the process group here.)"""
    settings = dict(block_size=128, micro_batch_size=8, seed=7)

    def loader(world_size, rank):
        monkeypatch.setenv("WORLD_SIZE", str(world_size))
        monkeypatch.setenv("GLOBAL_RANK", str(rank))
        return TokenDataModule(small_corpus_dir, **settings).train_dataloader()

    def windows(batches):
        return [row.numpy().tobytes() for batch in batches for row in batch]

    epoch = set()
    for rank in (0, 1):
        epoch |= set(windows(loader(2, rank)))
    ranks = [loader(2, rank) for rank in (0, 1)]
    read = [windows(_take(iter(one), 2)) for one in ranks]
    state = ranks[0].state_dict()
    alone = loader(1, 0)
    alone.load_state_dict(state)
    rest = windows(alone)
    assert len(epoch) == 96 and len(rest) == 64
    assert set(rest) == epoch - set(read[0]) - set(read[1])
    uninterrupted = loader(1, 0)
    list(uninterrupted)
    assert windows(alone) == windows(uninterrupted)


def test_resume_through_trainer_checkpoint(tiny_corpus_dir, tmp_path):
    """The same through Lightning: a checkpoint saved mid-run by ModelCheckpoint, resumed with ckpt_path."""
    import lightning as L
    from lightning.pytorch.callbacks import ModelCheckpoint

    class Recorder(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.zeros(1))
            self.seen = []

        def training_step(self, batch, batch_idx):
            self.seen.append(batch.clone())
            return self.w * batch.float().mean()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.0)

    def fit(steps, root, ckpt_path=None, callbacks=()):
        model = Recorder()
        trainer = L.Trainer(
            max_steps=steps, accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
            enable_model_summary=False, limit_val_batches=0, default_root_dir=str(root),
            callbacks=list(callbacks), enable_checkpointing=bool(callbacks),
        )
        trainer.fit(model, TokenDataModule(tiny_corpus_dir, block_size=16, micro_batch_size=2), ckpt_path=ckpt_path)
        return model.seen

    ckpt_dir = tmp_path / "ckpt"
    full = fit(8, tmp_path / "a", callbacks=[ModelCheckpoint(dirpath=ckpt_dir, every_n_train_steps=5, save_top_k=-1)])
    ckpt = next(p for p in os.listdir(ckpt_dir) if "step=5" in p)
    saved = torch.load(ckpt_dir / ckpt, weights_only=False)
    assert "TokenDataModule" not in saved, "one copy of the position: Lightning's, not the DataModule's"
    assert saved["loops"]["fit_loop"]["state_dict"]["combined_loader"][0]["num_samples_yielded"] == 5 * 2
    rest = fit(8, tmp_path / "b", ckpt_path=str(ckpt_dir / ckpt))
    assert len(full) == 8 and len(rest) == 3
    assert all(torch.equal(a, b) for a, b in zip(rest, full[5:]))


def test_missing_or_corrupt_data_is_named(tiny_corpus_dir, tmp_path):
    def error(path):
        with pytest.raises((FileNotFoundError, ValueError)) as exc:
            TokenDataModule(str(path)).describe()
        return one_line(exc)

    assert "python -m cable_lightning prepare" in error(tmp_path / "nowhere")
    broken = tmp_path / "copy"
    shutil.copytree(tiny_corpus_dir, broken)
    manifest = broken / "manifest.json"
    good = manifest.read_text()
    manifest.write_text(good[:100])
    assert str(manifest) in error(broken) and "--overwrite" in error(broken)
    manifest.unlink()
    assert "no manifest.json" in error(broken)
    manifest.write_text(good)
    val = broken / "val.npy"
    val.write_bytes(val.read_bytes()[:1000])
    assert str(val) in error(broken)
    shutil.copy(os.path.join(tiny_corpus_dir, "val.npy"), val)
    chunk = broken / "train" / json.loads((broken / "train" / "index.json").read_text())["chunks"][0]["filename"]
    chunk.write_bytes(chunk.read_bytes()[:1000])
    assert str(chunk) in error(broken) and "truncated" in error(broken)
    chunk.unlink()
    assert str(chunk) in error(broken) and "missing" in error(broken)


def test_the_cli_prepares_first_from_source_and_tokenizer(small_txt_dir, tmp_path, monkeypatch):
    """The data module only reads; the CLI prepares the data section's path first when it names a source."""
    import cable_lightning.data.prepare as prep
    from cable_lightning.run_setup import prepare_first

    monkeypatch.setattr(prep, "prepare", lambda **kw: fast_prepare(**kw, val_tokens=50))
    path = str(tmp_path / "auto")
    dm = TokenDataModule(path, source=small_txt_dir, tokenizer="bpe:300")
    with pytest.raises(FileNotFoundError):
        dm.describe()  # describing never prepares
    prepare_first(dm)
    assert dm.describe().vocab_size == 300 and os.path.isfile(os.path.join(path, "manifest.json"))
    with pytest.raises(ValueError) as exc:
        prepare_first(TokenDataModule(path, source=small_txt_dir, tokenizer="bpe:400"))
    assert "bpe:300" in one_line(exc) and "bpe:400" in str(exc.value)


def test_causal_training_takes_a_tokenizer_without_mask_and_mlm_refuses_it(small_txt_dir, tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    from cable_lightning.lit import CausalLM, MaskedLM
    from cable_lightning.models import BackboneConfig

    vocab = {EOT_TOKEN: 0, **{ch: i + 1 for i, ch in enumerate(sorted(set("".join(SMALL_DOCS))))}, "[UNK]": 999}
    no_mask = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    no_mask.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    no_mask.add_special_tokens([EOT_TOKEN])
    path = str(tmp_path / "tokenizer.json")
    no_mask.save(path)
    out = str(tmp_path / "nomask")
    manifest = fast_prepare(source=small_txt_dir, tokenizer=path, out=out, val_tokens=50)
    assert manifest["mask_id"] is None and manifest["special_ids"] == [0]
    info = TokenDataModule(out, block_size=16).describe()
    model = CausalLM(BackboneConfig(n_layer=1, n_head=2, n_embd=16), data=info)
    assert model.config.vocab_size == 1000
    with pytest.raises(ValueError) as exc:
        MaskedLM(BackboneConfig(preset="bert-base", n_layer=1, n_head=2, n_embd=16), data=info)
    assert "mask token" in one_line(exc) and "tokenizer" in str(exc.value)


# ------------------------------------------------------------------------------------------------ masking


def test_mask_tokens_statistics():
    vocab, mask_id, specials = 1000, 1, (0, 1, 2)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(3, vocab, (64, 1024), generator=gen)
    ids[:, ::16] = 0  # document separators sprinkled through
    ids[:, 5::32] = 2
    inputs, labels = mask_tokens(ids, mask_id, vocab, generator=torch.Generator().manual_seed(1), special_ids=specials)

    special = torch.isin(ids, torch.tensor(specials))
    chosen = labels != -100
    assert not (chosen & special).any(), "special tokens are never chosen"
    assert torch.equal(labels[chosen], ids[chosen])
    assert torch.equal(inputs[~chosen], ids[~chosen])
    rate = chosen.sum() / (~special).sum()
    assert 0.145 < rate < 0.155
    masked = (inputs == mask_id) & chosen
    kept = (inputs == ids) & chosen
    replaced = chosen & ~masked & ~kept
    n = chosen.sum()
    assert 0.79 < masked.sum() / n < 0.81
    assert 0.09 < kept.sum() / n < 0.11
    assert 0.09 < replaced.sum() / n < 0.11
    assert not torch.isin(inputs[replaced], torch.tensor(specials)).any(), "random tokens never forge specials"
    again = mask_tokens(ids, mask_id, vocab, generator=torch.Generator().manual_seed(1), special_ids=specials)
    assert torch.equal(again[0], inputs) and torch.equal(again[1], labels)
    assert torch.equal(ids[:, ::16], torch.zeros_like(ids[:, ::16])), "input tensor left untouched"


def test_evaluation_masks_a_token_by_its_stream_position_whatever_window_holds_it():
    """MLM perplexity at several lengths must score the same masked tokens: the masking of the validation stream
    cut into windows of 32 equals its masking cut into windows of 128 (DRAW_BLOCK boundaries crossed), and a
    different seed masks other tokens."""
    from cable_lightning.lit.masking import DRAW_BLOCK, position_draws

    stream = torch.randint(3, 1000, (2 * DRAW_BLOCK + 256,), generator=torch.Generator().manual_seed(5))
    stream[::50] = 0  # separators: never chosen, at every length

    def masked(length, seed=11):
        windows = stream[: len(stream) // length * length].view(-1, length)
        positions = torch.arange(windows.numel()).view_as(windows)
        inputs, labels = mask_tokens(windows, 1, 1000, draws=position_draws(positions, seed), special_ids=(0, 1))
        return inputs.flatten(), labels.flatten()

    short, long = masked(32), masked(128)
    assert torch.equal(short[0], long[0]) and torch.equal(short[1], long[1])
    chosen = short[1] != -100
    assert 0.13 < chosen.float().mean() < 0.17 and not (stream[: len(chosen)][chosen] == 0).any()
    assert not torch.equal(masked(32, seed=12)[1], short[1])


def test_mask_tokens_gpt2_mask_slot():
    """GPT-2's mask id is one past its vocabulary; random replacements stay inside the vocabulary."""
    ids = torch.randint(0, 50256, (4, 512), generator=torch.Generator().manual_seed(3))
    inputs, labels = mask_tokens(ids, 50257, 50257, generator=torch.Generator().manual_seed(4), special_ids=(50256,))
    assert int(inputs.max()) == 50257 and int(inputs[inputs != 50257].max()) < 50256


def test_hub_sources_with_a_local_stand_in(monkeypatch, tmp_path):
    """The hub code path (streaming, shards, wikitext's own splits and articles) end to end, with
    `datasets.load_dataset` answering from local parquet files instead of the hub."""
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    from cable_lightning.data import sources

    def parquet(name, texts):
        path = str(tmp_path / f"{name}.parquet")
        pq.write_table(pa.table({"text": texts}), path)
        return path

    web = [[f"web page {shard}.{i}: " + "education matters. " * (5 + i) for i in range(20)] for shard in range(3)]
    wiki = {
        "train": ["", " = Alpha = \n", "", " alpha text \n", " = Beta = \n", " beta text \n"],
        "validation": ["", " = Gamma = \n", " gamma text \n"] * 40,
        "test": ["", " = Delta = \n", " delta text \n"] * 40,
    }
    files = {("HuggingFaceFW/fineweb-edu", "train"): [parquet(f"web{i}", t) for i, t in enumerate(web)]}
    files.update({("Salesforce/wikitext", s): [parquet(f"wiki-{s}", lines)] for s, lines in wiki.items()})
    real_load = datasets.load_dataset

    def load_dataset(repo, name=None, split=None, streaming=False):
        assert streaming and name in ("sample-10BT", "wikitext-103-raw-v1")
        return real_load("parquet", data_files=files[(repo, split)], split="train", streaming=True)

    monkeypatch.setattr(datasets, "load_dataset", load_dataset)
    monkeypatch.setattr(sources, "check_hub", lambda repo: None)

    out = str(tmp_path / "web")
    manifest = fast_prepare(source="fineweb-edu", tokenizer="bpe:300", out=out, val_tokens=200, num_workers=2)
    stream = np.concatenate([read_split_tokens(out, "val"), read_split_tokens(out, "train")])
    tok = get_tokenizer(os.path.join(out, "tokenizer.json"), name="bpe:300")
    assert tok.decode(stream.tolist()) == joined([t for shard in web for t in shard])
    assert manifest["source"]["repo"] == "HuggingFaceFW/fineweb-edu"

    out = str(tmp_path / "wiki")
    manifest = fast_prepare(source="wikitext-103", tokenizer="bpe:300", out=out)
    assert set(manifest["splits"]) == {"train", "val", "test"}
    tok = get_tokenizer(os.path.join(out, "tokenizer.json"), name="bpe:300")
    assert tok.decode(read_split_tokens(out, "train").tolist()) == joined(["\n = Alpha = \n\n alpha text \n",
                                                                          " = Beta = \n beta text \n"])
    assert tok.decode(read_split_tokens(out, "val").tolist()).count(EOT_TOKEN) == 40
    dm = TokenDataModule(out, block_size=16, eval_tokens=64)
    assert torch.equal(dm.test_dataloader().dataset.tokens, dm.eval_stream("test"))
    assert torch.equal(dm.eval_stream("test"), torch.from_numpy(read_split_tokens(out, "test")[:65].astype(np.int64)))


def test_concurrent_prepares_of_one_folder_both_succeed_with_one_result(small_txt_dir, tmp_path):
    """Two processes prepare the same --out at once: the lock makes the second wait and find the first's work."""
    import subprocess
    import sys

    out = str(tmp_path / "shared")
    cmd = [sys.executable, "-m", "cable_lightning", "prepare", "--source", small_txt_dir, "--tokenizer", "bpe:300",
           "--out", out, "--val-tokens", "50", "--num-workers", "1"]
    procs = [subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    results = [proc.communicate(timeout=300) for proc in procs]
    assert [proc.returncode for proc in procs] == [0, 0], results
    logs = [stdout for stdout, _ in results]
    assert sum("nothing to do" in log for log in logs) == 1 and sum("wrote" in log for log in logs) == 1
    assert read_manifest(out)["splits"]["train"]["tokens"] > 0
    assert work_folders(out) == []


def test_empty_or_one_document_sources_say_so(tmp_path):
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    with pytest.raises(ValueError, match="empty.txt holds no text"):
        fast_prepare(source=str(empty), tokenizer="bpe:300", out=str(tmp_path / "a"))
    one = tmp_path / "one.txt"
    one.write_text("a single document " * 500)
    with pytest.raises(ValueError, match=r"validation took all 1 documents.*a \.txt file is one document"):
        fast_prepare(source=str(one), tokenizer="bpe:300", out=str(tmp_path / "b"), val_fraction=0.01)
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def test_a_held_out_document_far_longer_than_the_budget_is_warned_in_one_line(tmp_path, capsys):
    """Validation takes whole documents: a long first document holds out far more than asked, which is said."""
    source = tmp_path / "docs.jsonl"
    docs = ["a very long first document " * 2000] + [f"short document number {i} " * 20 for i in range(200)]
    source.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    manifest = fast_prepare(source=str(source), tokenizer="bpe:300", out=str(tmp_path / "out"), val_fraction=0.05)
    warning = [line for line in capsys.readouterr().err.splitlines() if line.startswith("warning:")]
    budget = 0.05 * sum(map(len, docs))
    assert len(warning) == 1 and f"x the {budget:.0f} asked for" in warning[0] and "--val-tokens" in warning[0]
    assert manifest["splits"]["val"]["tokens"] > 0
    fast_prepare(source=str(source), tokenizer="bpe:300", out=str(tmp_path / "even"), val_fraction=0.5)
    assert not [line for line in capsys.readouterr().err.splitlines() if line.startswith("warning:")]


def test_a_long_document_is_encoded_in_segments_to_the_same_ids(tiny_corpus_docs, monkeypatch):
    """Memory stays bounded on a one-line 40 MB document: it is encoded a segment at a time, cut only where a
    pre-token ends, so the ids equal those of encoding it whole (here on real text, segments of ~500 characters)."""
    import cable_lightning.data.prepare as prep
    from cable_lightning.data.tokenizers import train_bpe

    _, docs = tiny_corpus_docs
    long_doc = "".join(docs[:40])
    tok = train_bpe(iter(docs), 300)
    whole = next(prep.encode(tok, [long_doc], "uint16"))[1]
    monkeypatch.setattr(prep, "SEGMENT_CHARS", 500)
    pieces = prep.segments(long_doc, 500)
    assert len(pieces) > 20 and "".join(pieces) == long_doc
    calls = []
    monkeypatch.setattr(tok, "encode_batch", lambda texts, real=tok.encode_batch: calls.append(texts) or real(texts))
    segmented = next(prep.encode(tok, [long_doc], "uint16"))[1]
    assert max(len(text) for batch in calls for text in batch) <= 500  # never the whole document at once
    np.testing.assert_array_equal(segmented, whole)
