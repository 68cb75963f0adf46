"""One trust policy at every door: checkpoints from anywhere (URLs included) load weights-only, a checkpoint may
name only this package's model classes, and a crafted file never runs code. Each case goes through a real command
(``python -m cable_lightning`` as :func:`run`, or ``export``) and must end in one ``error:`` line."""

import functools
import glob
import http.server
import os
import signal
import subprocess
import sys
import threading
import time
import zipfile

import pytest
import torch
from conftest import ROOT, args, error_lines, one_error_line, tool

from cable_lightning.checkpoints import resolve_ckpt_path
from cable_lightning.cli import main, run
from cable_lightning.errors import ConfigError
from cable_lightning.hf.export import main as export_main
from cable_lightning.lit import CausalLM, MaskedLM
from cable_lightning.lit.checkpoint_format import package_model_class
from cable_lightning.positional.registry import available


class WritesMarker:
    """Unpickling this (``weights_only=False``) runs ``open(marker, "w")``."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (exec, (f"open({self.marker!r}, 'w').write('pwned')",))


def crafted_checkpoint(path, marker) -> str:
    torch.save({"state_dict": {}, "hyper_parameters": {"_class_path": "cable_lightning.lit.CausalLM"},
                "payload": WritesMarker(str(marker))}, str(path))
    return str(path)


@pytest.fixture
def served(tmp_path):
    """A folder served over http on 127.0.0.1 (an ephemeral port) for the test's duration; yields (folder, url)."""
    folder = tmp_path / "served"
    folder.mkdir()
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(folder))
    handler.log_message = lambda *a, **k: None
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield folder, f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


def test_the_crafted_checkpoint_runs_code_when_unpickled_in_full(tmp_path):
    """The payload the other tests serve is live: a plain ``torch.load(weights_only=False)`` writes the marker."""
    marker = tmp_path / "marker"
    path = crafted_checkpoint(tmp_path / "evil.ckpt", marker)
    subprocess.run([sys.executable, "-c", f"import torch; torch.load({path!r}, weights_only=False)"], check=True,
                   cwd=os.path.dirname(__file__))
    assert marker.read_text() == "pwned"


@pytest.mark.parametrize("subcommand", ["validate", "fit"])
def test_a_crafted_checkpoint_url_is_refused_in_one_line_and_never_runs(tiny_corpus_dir, tmp_path, served, capsys,
                                                                        subcommand):
    folder, base = served
    marker = tmp_path / "marker"
    crafted_checkpoint(folder / "evil.ckpt", marker)
    for url in (f"{base}/evil.ckpt", (folder / "evil.ckpt").as_uri()):
        line = one_error_line(capsys, lambda: run([subcommand, *args(tiny_corpus_dir, str(tmp_path / "runs")),
                                                   "--ckpt_path", url]))
        assert "evil.ckpt cannot be loaded (UnpicklingError" in line, line
        assert not marker.exists()
    line = one_error_line(capsys, lambda: run([subcommand, *args(tiny_corpus_dir, str(tmp_path / "runs")),
                                               "--ckpt_path", f"{base}/missing.ckpt"]))
    assert f"checkpoint {base}/missing.ckpt cannot be downloaded (FileNotFoundError" in line, line
    assert not (tmp_path / "runs").exists()  # refused before anything was written


def test_export_refuses_a_crafted_checkpoint_url(tmp_path, served, capsys):
    folder, base = served
    marker = tmp_path / "marker"
    crafted_checkpoint(folder / "evil.ckpt", marker)
    line = one_error_line(capsys, lambda: export_main(["--ckpt_path", f"{base}/evil.ckpt", "--out",
                                                       str(tmp_path / "hf"), "--data_path", str(tmp_path)]))
    assert "evil.ckpt cannot be loaded (UnpicklingError" in line
    assert not marker.exists() and not (tmp_path / "hf").exists()


def test_a_checkpoint_naming_a_foreign_class_is_refused_before_it_is_imported(tiny_corpus_dir, tmp_path, capsys,
                                                                              monkeypatch):
    """``_class_path`` naming a module on the path (here one that writes a marker when imported) is refused by
    validate and export without importing it."""
    marker = tmp_path / "marker"
    (tmp_path / "evil_module.py").write_text(f"open({str(marker)!r}, 'w').write('imported')\nclass Model: pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    for class_path in ("evil_module.Model", "os.system", "cable_lightning.data.prepare.prepare",
                       "torch.nn.Linear"):
        ckpt = str(tmp_path / "foreign.ckpt")
        torch.save({"state_dict": {}, "hyper_parameters": {"_class_path": class_path, "backbone": {}, "data": {}}},
                   ckpt)
        line = one_error_line(capsys, lambda: run(["validate", *args(tiny_corpus_dir, str(tmp_path / "runs")),
                                                   "--ckpt_path", ckpt]))
        assert f"names model class {class_path!r}, which is not one of this package's models" in line, line
        line = one_error_line(capsys, lambda: export_main(["--ckpt_path", ckpt, "--out", str(tmp_path / "hf"),
                                                           "--data_path", tiny_corpus_dir]))
        assert f"names model class {class_path!r}" in line, line
    assert not marker.exists() and "evil_module" not in sys.modules


class OutsideModel(CausalLM):
    pass


def test_package_model_class_accepts_only_the_packages_own_models():
    assert package_model_class("cable_lightning.lit.CausalLM", "x") is CausalLM
    assert package_model_class("cable_lightning.lit.modules.MaskedLM", "x") is MaskedLM
    for refused in (f"{__name__}.OutsideModel", "cable_lightning.lit.modules.torch", "CausalLM", ""):
        with pytest.raises(ConfigError, match="not one of this package's models"):
            package_model_class(refused, "x")


# --- verified reads: checkpoints are checked against the CRC-32s their zip stores -------------------------------------

def flip_tensor_bytes(path: str, count: int = 64) -> None:
    """Flip ``count`` bytes in the middle of the largest tensor in a checkpoint (its zip directory stays intact)."""
    with zipfile.ZipFile(path) as archive:
        member = max(archive.infolist(), key=lambda info: info.file_size)
        content = archive.read(member)
    with open(path, "r+b") as f:
        start = f.read().find(content) + len(content) // 2
        f.seek(start)
        f.write(bytes(b ^ 0xFF for b in content[len(content) // 2:len(content) // 2 + count]))


def test_a_checkpoint_with_flipped_bytes_is_named_by_every_reader(tiny_corpus_dir, tmp_path, capsys):
    runs = str(tmp_path / "runs")
    main(["fit", *args(tiny_corpus_dir, runs)])
    folder = os.path.join(runs, "test", "cable", "checkpoints")
    last = os.path.join(folder, "last.ckpt")
    torch.load(last, weights_only=True)
    flip_tensor_bytes(last)
    torch.load(last, weights_only=True)  # torch itself does not notice
    line = one_error_line(capsys, lambda: run(["validate", *args(tiny_corpus_dir, runs), "--ckpt_path", last]))
    assert f"checkpoint {last} is corrupt: its member" in line and "fails the CRC-32 check" in line, line
    line = one_error_line(capsys, lambda: export_main(["--ckpt_path", last, "--out", str(tmp_path / "hf")]))
    assert f"checkpoint {last} is corrupt: its member" in line, line
    # --ckpt_path last passes over it to the newest checkpoint whose checksums hold
    assert resolve_ckpt_path("last", folder) == os.path.join(folder, "step0000004.ckpt")
    assert "skipping checkpoint" in capsys.readouterr().out


# --- owned replacement: --overwrite replaces only what the tool wrote, never its own input ----------------------------

def test_prepare_overwrite_never_deletes_its_source_or_a_folder_it_did_not_write(tmp_path, capsys):
    from cable_lightning.data.prepare import main as prepare_main

    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i in range(2):
        (corpus / f"doc{i}.txt").write_text(f"document {i}: the quick brown fox jumps over the lazy dog. " * 20)
    base = ["--source", str(corpus), "--tokenizer", "bpe:300", "--val_tokens", "20", "--num_workers", "1", "--quiet"]
    for extra in ([], ["--overwrite"]):
        line = one_error_line(capsys, lambda: prepare_main([*base, "--out", str(corpus), *extra]))
        assert line.startswith(f"error: --out {corpus} holds this command's input {corpus / 'doc0.txt'}"), line
        assert "--overwrite" not in line  # no advice that would delete the corpus
    assert sorted(os.listdir(corpus)) == ["doc0.txt", "doc1.txt"]
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "keep.txt").write_text("not prepared data")
    line = one_error_line(capsys, lambda: prepare_main([*base, "--out", str(mine), "--overwrite"]))
    assert f"{mine} already exists and was not written by prepare" in line, line
    assert os.listdir(mine) == ["keep.txt"]
    prepared = tmp_path / "prepared"  # its trained tokenizer.json, then given as the tokenizer of an overwrite
    (tmp_path / "prepared.partial").mkdir()  # the user's, by a name an earlier prepare used
    (tmp_path / "prepared.partial" / "keep.txt").write_text("not prepare's")
    prepare_main([*base, "--out", str(prepared)])
    assert os.listdir(tmp_path / "prepared.partial") == ["keep.txt"]
    tokenizer = prepared / "tokenizer.json"
    line = one_error_line(capsys, lambda: prepare_main([*base[:2], "--tokenizer", str(tokenizer), *base[4:], "--out",
                                                        str(prepared), "--overwrite"]))
    assert line.startswith(f"error: --out {prepared} holds this command's input {tokenizer}"), line
    assert tokenizer.is_file()


KILLED_WRITER = """
import os, shutil, sys
from cable_lightning import owned

out, stage = sys.argv[1], sys.argv[2]
staged = owned.staging_folder(out, "export")
with open(os.path.join(staged, "model.safetensors"), "wb") as f:
    f.write(bytes(1000))
if stage == "swap":  # killed while removing the replaced folder
    owned.shutil.rmtree = lambda *args, **kwargs: os.kill(os.getpid(), 9)
    owned.swap_in(staged, out, "export")
os.kill(os.getpid(), 9)  # killed while building
"""


def test_the_next_run_removes_what_a_killed_writer_left_and_nothing_else(tmp_path):
    from cable_lightning.owned import discard, staging_folder, write_marker

    out = tmp_path / "model"
    out.mkdir()
    write_marker(str(out), "export")
    for stage, left in (("build", ".model.partial"), ("swap", ".model.old")):  # the second run removes the first's
        done = subprocess.run([sys.executable, "-c", KILLED_WRITER, str(out), stage], env={**os.environ,
                              "PYTHONPATH": ROOT}, capture_output=True, text=True)
        assert done.returncode == -signal.SIGKILL, done.stderr
        assert [name.split("-")[0] for name in os.listdir(tmp_path) if name != "model"] == [left]
    look_alike = tmp_path / ".model.partial-mine"  # unmarked: not a writer's
    look_alike.mkdir()
    other = tmp_path / ".model.partial-other"  # another writer's
    other.mkdir()
    write_marker(str(other), "prepare")
    staged = staging_folder(str(out), "export")
    assert sorted(os.listdir(tmp_path)) == sorted([".model.partial-mine", ".model.partial-other", "model",
                                                   os.path.basename(staged)])
    live = staging_folder(str(out), "export")  # a live run's folder is held: not a leftover
    assert os.path.isdir(staged)
    discard(live), discard(staged)


def test_a_checkpoint_save_removes_only_its_own_partial_file(tmp_path):
    from cable_lightning.checkpoints import AtomicCheckpointIO

    folder = tmp_path / "checkpoints"
    folder.mkdir()
    for name in ("notes.partial", "step0000002.ckpt.partial", "last.ckpt.partial"):  # the last: a killed save's
        (folder / name).write_bytes(b"PK partial bytes")
    AtomicCheckpointIO().save_checkpoint({"step": 4}, str(folder / "last.ckpt"))
    assert sorted(os.listdir(folder)) == ["last.ckpt", "notes.partial", "step0000002.ckpt.partial"]
    assert torch.load(folder / "last.ckpt", weights_only=True) == {"step": 4}


# --- one error boundary for every tool --------------------------------------------------------------------------

def test_tools_print_one_error_line_and_a_traceback_only_with_the_debug_variable(tmp_path):
    line = error_lines(tool("-m", "cable_lightning", "sweep", "--config", "configs/quickstart.yaml", "--pes", "cable",
                            "dape_v2+nonesuch", "--print_only"))
    assert line == ["error: --pes dape_v2+nonesuch: unknown positional encoding 'nonesuch'; valid names: "
                    f"{', '.join(available())}"]
    env = {**os.environ, "PYTHONPATH": ROOT, "CABLE_LIGHTNING_DEBUG": "1"}
    debug = subprocess.run([sys.executable, "-m", "cable_lightning", "report", str(tmp_path / "nothing")],
                           capture_output=True, text=True, env=env, cwd=ROOT)
    assert debug.returncode == 1 and "Traceback" in debug.stderr and "MissingFileError: no length_eval.jsonl" in \
        debug.stderr


@pytest.mark.parametrize("endpoint", ["not-a-url", "ftp://store", "http://:9000", "http://store:port"])
def test_an_endpoint_that_is_not_an_http_url_is_one_line_before_any_connection(tmp_path, capsys, endpoint):
    line = one_error_line(capsys, lambda: run(["fit", *args("s3://bucket/prefix", str(tmp_path / "runs")),
                                               "--data.endpoint_url", endpoint]))
    assert line == (f"error: endpoint URL {endpoint!r} is not an http(s) URL with a host; give the store's endpoint "
                    "(e.g. https://s3.example.com or http://127.0.0.1:9000) with data.endpoint_url or --endpoint_url")


@pytest.mark.parametrize("stride", ["0", "-2"])
def test_a_zero_or_negative_eval_stride_is_refused_before_training(tiny_corpus_dir, tmp_path, capsys, stride):
    line = one_error_line(capsys, lambda: run(["fit", *args(tiny_corpus_dir, str(tmp_path / "runs")),
                                               "--data.eval_stride", stride]))
    assert line == f"error: eval_stride must be positive or None, got {stride}"
    assert not glob.glob(str(tmp_path / "runs" / "**" / "*.ckpt"), recursive=True)


def test_a_passkey_length_too_short_for_its_prompt_is_refused_before_training(tiny_corpus_dir, tmp_path, capsys):
    line = one_error_line(capsys, lambda: run(["fit", *args(tiny_corpus_dir, str(tmp_path / "runs")),
                                               "--data.tasks", '{"passkey": {}}', "--data.task_fraction", "0",
                                               "--task_eval.lengths", "[8, 64]"]))
    assert "evaluation length 8 is too short for a task: task passkey (no settings) needs a length of at least" \
        in line, line
    assert not glob.glob(str(tmp_path / "runs" / "**" / "*.ckpt"), recursive=True)  # no step was trained


# --- sources: each real file once, loops refused, skipped files listed ------------------------------------------------

def test_a_source_folder_reads_each_real_file_once_and_refuses_a_symlink_loop(tmp_path, capsys):
    from cable_lightning.data.sources import get_source

    corpus = tmp_path / "corpus"
    (corpus / "sub").mkdir(parents=True)
    (corpus / "a.txt").write_text("first document")
    (corpus / "sub" / "b.txt").write_text("second document")
    (corpus / "notes.md").write_text("not a corpus file")
    os.symlink(corpus / "a.txt", corpus / "sub" / "again.txt")  # the same file by a second path
    source = get_source(str(corpus))
    assert source.files == [str(corpus / "a.txt"), str(corpus / "sub" / "b.txt")]
    assert sorted(source.documents()) == ["first document", "second document"]
    err = capsys.readouterr().err
    assert f"skipping 1 files (the same file as another path): {corpus / 'sub' / 'again.txt'}" in err
    assert f"skipping 1 files (not .txt, .jsonl, .parquet): {corpus / 'notes.md'}" in err
    os.symlink(corpus, corpus / "sub" / "loop")  # a link back to the top: glob would read every file again and again
    with pytest.raises(ValueError, match=f"{corpus / 'sub' / 'loop'} is {corpus} again \\(a symlink loop"):
        get_source(str(corpus))


# --- SIGTERM or Ctrl-C during prepare: the workers stop, nothing is left, exit 128 + the signal ----------------------

SIGTERM_SCRIPT = """
import functools, os, sys, time
import cable_lightning.data.prepare as prep

flag = os.environ["STARTED_FLAG"]  # spawned workers import this file again (as __mp_main__): slow is found there
real_tokenize = prep.tokenize_work

def slow(work, **kwargs):
    with open(flag + ".workers", "a") as f:
        f.write(f"{os.getpid()}\\n")
    open(flag, "w").close()
    time.sleep(600)  # until stopped
    yield from real_tokenize(work, **kwargs)

if __name__ == "__main__":
    prep.tokenize_work = slow
    prep.prepare = functools.partial(prep.prepare, start_method=sys.argv[1])
    sys.exit(prep.main(sys.argv[2:]))
"""


@pytest.mark.parametrize("stop, start_method", [(signal.SIGTERM, "fork"), (signal.SIGINT, "fork"),
                                                (signal.SIGTERM, "spawn")], ids=["SIGTERM", "Ctrl-C", "spawn"])
def test_a_stop_during_prepare_ends_the_workers_leaves_nothing_and_exits_128_plus_the_signal(tmp_path, stop,
                                                                                            start_method):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i in range(4):
        (corpus / f"doc{i}.txt").write_text(f"document {i}: the quick brown fox jumps over the lazy dog. " * 20)
    out, flag = tmp_path / "out", str(tmp_path / "started")
    env = {**os.environ, "PYTHONPATH": ROOT, "STARTED_FLAG": flag}
    (tmp_path / "slow_prepare.py").write_text(SIGTERM_SCRIPT)
    child = subprocess.Popen([sys.executable, str(tmp_path / "slow_prepare.py"), start_method, "--source",
                              str(corpus), "--tokenizer", "bpe:300", "--out", str(out), "--val_tokens", "20",
                              "--num_workers", "2", "--quiet"], env=env, stderr=subprocess.PIPE, text=True)
    def started() -> int:
        return len(open(flag + ".workers").read().split()) if os.path.exists(flag + ".workers") else 0

    # Both workers are tokenizing (at most 120 s). A stop while a worker is still starting can leave a process it
    # was forking behind (a known gap, see docs/faults.md); this test covers a stop once the run is under way.
    for _ in range(1200):
        if started() == 2 or child.poll() is not None:
            break
        time.sleep(0.1)
    assert started() == 2, child.stderr.read()
    child.send_signal(stop)
    _, err = child.communicate(timeout=120)
    assert child.returncode == 128 + stop, err
    assert "Traceback" not in err and "resource_tracker" not in err, err  # the tracker is not ended with the workers
    assert err.strip().splitlines()[-1] == (f"error: stopped by {stop.name}; the workers were stopped and nothing was "
                                            f"written to {out}; run the same command again")
    assert not out.exists() and not glob.glob(f"{tmp_path}/.out.*")
    for pid in map(int, open(flag + ".workers").read().split()):
        for _ in range(100):  # a stopped worker is gone (reaped) within 10 s
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                break
            time.sleep(0.1)
        else:
            pytest.fail(f"worker {pid} still runs after prepare stopped")


FIT_PREPARE_SCRIPT = """
import os, sys, time
import cable_lightning.data.prepare as prep

def slow(*args, **kwargs):  # the preparation, stopped while it runs (its handler is set by then)
    open(os.environ["STARTED_FLAG"], "w").close()
    time.sleep(600)

prep._prepare = slow
from cable_lightning.cli import run
argv, sys.argv = sys.argv[1:], sys.argv[:1]
run(argv)
"""


@pytest.mark.parametrize("stop", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "Ctrl-C"])
def test_a_stop_during_fits_own_first_use_preparation_is_one_line_and_128_plus_the_signal(tmp_path, stop):
    """prepare alone said one line and exited 143/130; fit, preparing its data first, printed an 87-90-line
    traceback and exited 1."""
    (tmp_path / "doc.txt").write_text("a document to prepare")
    out, flag = tmp_path / "data", str(tmp_path / "started")
    (tmp_path / "fit_prepare.py").write_text(FIT_PREPARE_SCRIPT)
    env = {**os.environ, "PYTHONPATH": ROOT, "STARTED_FLAG": flag, "OMP_NUM_THREADS": "1"}
    child = subprocess.Popen([sys.executable, str(tmp_path / "fit_prepare.py"), "fit",
                              *args(str(out), str(tmp_path / "runs")), "--data.source", str(tmp_path / "doc.txt"),
                              "--data.tokenizer", "bpe:300"], env=env, stderr=subprocess.PIPE, text=True)
    for _ in range(1200):  # at most 120 s to start
        if os.path.exists(flag) or child.poll() is not None:
            break
        time.sleep(0.1)
    assert os.path.exists(flag), child.stderr.read()
    child.send_signal(stop)
    _, err = child.communicate(timeout=120)
    assert child.returncode == 128 + stop, err
    assert "Traceback" not in err, err
    assert err.strip().splitlines()[-1] == (f"error: stopped by {stop.name}; the workers were stopped and nothing was "
                                            f"written to {out}; run the same command again")
    assert not out.exists() and not os.path.exists(tmp_path / "runs" / "test")
