"""prepare (data/prepare.py): a source tokenised into LitData chunks, a held-out array and a manifest; reruns,
conflicts, killed workers, bad files, concurrent prepares.

CPU only, no network (the no_network guard refuses internet sockets). Preparing uses forked litdata workers, except
one CLI test that uses the default spawn start, as a real run does.
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
from conftest import SMALL_DOCS, fast_prepare, joined, one_line, read_split_tokens, work_folders

from cable_lightning.data.datamodule import TokenDataModule
from cable_lightning.data.manifest import read_manifest
from cable_lightning.data.prepare import main as prepare_main
from cable_lightning.data.prepare import prepare
from cable_lightning.data.sources import get_source
from cable_lightning.data.tokenizers import get_tokenizer, train_bpe

pytestmark = pytest.mark.usefixtures("no_network")


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
    assert prepare_main(["--source", small_txt_dir, "--tokenizer", "bpe:300", "--out", out, "--val_tokens", "50",
                         "--num_workers", "1", "--quiet"]) == 0
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
        (dict(source="fineweb-edu", val_fraction=0.1), ValueError, "--val_tokens"),
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
    leaves no child process holding its output pipe, and the same command then succeeds."""
    import subprocess
    import sys

    out = str(tmp_path / "out")
    args = ["--source", small_txt_dir, "--tokenizer", "bpe:300", "--out", out, "--val_tokens", "50",
            "--num_workers", "2", "--quiet"]
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
    """A process a worker started whose parent exits before the watchdog looks (litdata forks in its workers)
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


def test_concurrent_prepares_of_one_folder_both_succeed_with_one_result(small_txt_dir, tmp_path):
    """Two processes prepare the same --out at once: the lock makes the second wait and find the first's work."""
    import subprocess
    import sys

    out = str(tmp_path / "shared")
    cmd = [sys.executable, "-m", "cable_lightning", "prepare", "--source", small_txt_dir, "--tokenizer", "bpe:300",
           "--out", out, "--val_tokens", "50", "--num_workers", "1"]
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
    assert len(warning) == 1 and f"x the {budget:.0f} asked for" in warning[0] and "--val_tokens" in warning[0]
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
