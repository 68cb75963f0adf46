"""The paper's experiment on one CUDA machine: the script a GPU runs, rehearsed on the CPU at toy sizes, and the
records that let the runs of several machines join one table, or refuse to."""

import json
import os
import signal
import subprocess
import sys
import tarfile
import time

import pytest

from cable_lightning.errors import ConfigError
from cable_lightning.eval import report

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
RECIPE = {"steps": 1000, "batch_tokens": 65536, "warmup_steps": 100, "min_lr": 6e-5, "betas": [0.9, 0.95],
          "eps": 1e-8, "weight_decay": 0.1, "gradient_clip": 1.0, "tokenizer": "ab12"}


def write_run(folder, pe, corpus_hash=None, recipe=None, machine=None):
    """Length records of one run as a fit writes them (plain JSON rows: any version of the report reads them)."""
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "length_eval.jsonl"), "w") as f:
        for length, ppl in ((1024, 20.0), (2048, 21.0)):
            row = dict(pe=pe, train_length=1024, step=1000, stage="fit", run_seed=0, lr=6e-4, model="decoder L12",
                       length=length, mode="nonoverlap", ppl=ppl, stride=length, tokens=4096)
            if corpus_hash is not None:
                row.update(corpus_hash=corpus_hash, recipe=recipe, machine=machine)
            f.write(json.dumps(row) + "\n")


def test_report_refuses_runs_of_different_corpora_or_recipes(tmp_path):
    """Runs of two machines join one table when their corpus and recipe agree (the machines may differ); another corpus,
    or another recipe at the same training length, is one line naming the runs and what differs, before anything is
    written. Rows without a corpus hash (an earlier version's) are compared as before."""
    runs = tmp_path / "runs"
    write_run(runs / "a", "cable", "1" * 64, RECIPE, "NVIDIA H100 80GB HBM3")
    write_run(runs / "b", "alibi", "1" * 64, RECIPE, "NVIDIA H200")
    tables = report.report([str(runs)], str(tmp_path / "joined"))
    assert "| length | alibi | cable |" in tables["nonoverlap"]

    write_run(runs / "c", "rope", "2" * 64, RECIPE, "NVIDIA H100 80GB HBM3")
    with pytest.raises(ConfigError) as refused:
        report.report([str(runs)], str(tmp_path / "mixed"))
    line = str(refused.value)
    assert "\n" not in line and "different corpora" in line
    assert f"corpus {'1' * 12}: alibi@1024 seed 0, cable@1024 seed 0; corpus {'2' * 12}: rope@1024 seed 0" in line
    assert not list(tmp_path.glob("mixed*"))  # refused before anything was written

    write_run(runs / "c", "rope", "1" * 64, {**RECIPE, "steps": 500}, "NVIDIA H100 80GB HBM3")
    with pytest.raises(ConfigError, match=r"different recipes.*steps 1000 \(alibi@1024 seed 0, cable@1024 seed 0\) vs "
                                          r"500 \(rope@1024 seed 0\)"):
        report.report([str(runs)], str(tmp_path / "mixed"))

    old = tmp_path / "old"  # no corpus hash: as before, whatever else the rows say
    write_run(old / "a", "cable")
    write_run(old / "b", "alibi")
    assert "| length | alibi | cable |" in report.report([str(old)], str(tmp_path / "old_report"))["nonoverlap"]


def test_gpu_run_script_rehearsed_on_cpu(tmp_path):
    """tools/gpu/run.sh with REHEARSE=1: every part runs at toy sizes (a 2-layer model, 4 steps, lengths 32 and 64,
    two small distributions' code with a 300-token BPE), each writes its line to $OUT/results.jsonl, the fit's line
    has the perplexity at each length, the ratio, tokens trained and the steady rate, and its records (in
    records.tar.gz) carry the corpus hash of the prepared data and the machine; the report comes back as report.md."""
    out = tmp_path / "out"
    env = {**os.environ, "REHEARSE": "1", "OUT": str(out), "PY": sys.executable, "ENCODINGS": "cable",
           "OMP_NUM_THREADS": "1"}
    done = subprocess.run(["bash", "tools/gpu/run.sh"], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    lines = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert [(row["part"], row["status"]) for row in lines] == [
        ("env", "ok"), ("gpu-check", "skipped"), ("prepare", "prepared"), ("fit", "done"), ("report", "done")]
    prepared, fit = lines[2], lines[3]
    manifest = json.loads((out / "manifest.json").read_text())
    assert prepared["corpus_hash"] == manifest["source"]["corpus_hash"] and prepared["vocab_size"] == 300
    assert fit["pe"] == "cable" and set(fit["ppl"]) == {"32", "64"} and fit["ppl_2x_over_1x"] > 0
    assert fit["tokens"] == 4 * 64 and fit["tokens_per_sec"] > 0 and fit["steady_steps"] == 3
    assert fit["corpus_hash"] == prepared["corpus_hash"] and fit["machine"].startswith("cpu")
    assert fit["recipe"]["steps"] == 4 and fit["recipe"]["batch_tokens"] == 64
    with tarfile.open(out / "records.tar.gz") as tar:
        names = tar.getnames()
        assert not any(name.endswith(".ckpt") for name in names)
        for name in ("runs/cable/length_eval.jsonl", "runs/cable/throughput.jsonl"):
            rows = [json.loads(line) for line in tar.extractfile(name).read().decode().splitlines()]
            assert rows and all(r["corpus_hash"] == prepared["corpus_hash"] and r["machine"] == fit["machine"]
                                for r in rows)
    assert "report_nonoverlap" in (out / "report.md").read_text()
    assert "| cable seed 1337 | cpu" in (out / "report.md").read_text()  # the speed table's row
    assert sorted(os.listdir(out)) == ["manifest.json", "records.tar.gz", "report.md", "results.jsonl",
                                       "run-log.txt"]  # the device tool returns at most 8 files


@pytest.mark.parametrize("second, named", [
    (("2" * 64, RECIPE), "different corpora, which one table cannot compare: corpus 111111111111: cable@1024 seed 0; "
                         "corpus 222222222222: cable@1024 seed 0"),
    (("1" * 64, {**RECIPE, "steps": 500}), "steps 1000 (cable@1024 seed 0) vs 500 (cable@1024 seed 0); report them "
                                           "apart, or train them alike; two runs of one name and seed, evaluated at "
                                           "the same steps, were trained by different recipes"),
    ((None, None), "cable (training length 1024, seed 0) is 2 runs that differ in corpus 111111111111 vs none "
                   "recorded; recipe (recorded vs none recorded): one table would show one of them as that run"),
], ids=["corpus", "recipe", "unrecorded"])
def test_report_never_drops_one_of_two_runs_that_share_encoding_length_and_seed(tmp_path, second, named):
    """Two machines' results joined: both start with cable, seed 0. Their rows were merged by a run key of encoding,
    training length and seed before the corpus check looked, so the table showed the later-written run alone. Now
    each run keeps its key (corpus and recipe in it) and the report refuses in one line naming what differs."""
    runs = tmp_path / "runs"
    write_run(runs / "machine1", "cable", "1" * 64, RECIPE, "NVIDIA H100 80GB HBM3")
    write_run(runs / "machine2", "cable", *second, "NVIDIA H200")
    with pytest.raises(ConfigError) as refused:
        report.report([str(runs)], str(tmp_path / "joined"))
    line = str(refused.value)
    assert "\n" not in line and named in line, line
    assert not list(tmp_path.glob("joined*"))


def test_two_lends_of_one_run_key_are_two_runs():
    """The run key is typed and holds the corpus and the recipe."""
    from cable_lightning.records.schema import LengthRecord, RunKey

    row = dict(pe="cable", train_length=1024, step=1000, run_seed=0, lr=6e-4, model="decoder L12", length=1024,
               mode="nonoverlap", ppl=20.0)
    one, two = LengthRecord(**row, corpus_hash="1" * 64, recipe=RECIPE), LengthRecord(**row, corpus_hash="2" * 64,
                                                                                       recipe=RECIPE)
    assert isinstance(one.run_key(), RunKey) and one.run_key() != two.run_key()
    assert one.run_key().corpus == "1" * 64 and json.loads(one.run_key().recipe) == RECIPE


FAKE_PYTHON = """#!/usr/bin/env bash
# the real Python, but a fit that waits to be stopped and a prepare that only says it was started
if [ "$1 $2 $3" = "-m cable_lightning fit" ]; then echo $$ > "$MARKS/fit.pid"; exec sleep 600; fi
if [ "$1 $2 $3" = "-m cable_lightning prepare" ]; then touch "$MARKS/prepare.started"; exit 1; fi
exec {python} "$@"
"""


def rehearsal(tmp_path, **env) -> tuple[subprocess.Popen, dict]:
    """tools/gpu/run.sh rehearsed with a fake Python (FAKE_PYTHON); its work folder under tmp_path/tmp."""
    marks, tmp, fake = tmp_path / "marks", tmp_path / "tmp", tmp_path / "python"
    marks.mkdir(), tmp.mkdir()
    fake.write_text(FAKE_PYTHON.format(python=sys.executable))
    fake.chmod(0o755)
    env = {**os.environ, "REHEARSE": "1", "OUT": str(tmp_path / "out"), "PY": str(fake), "ENCODINGS": "cable",
           "OMP_NUM_THREADS": "1", "TMPDIR": str(tmp), "MARKS": str(marks), **env}
    return subprocess.Popen(["bash", "tools/gpu/run.sh"], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True), {"marks": marks, "tmp": tmp}


def test_gpu_run_script_stopped_by_sigterm_stops_its_fit_and_removes_its_work_folder(tiny_corpus_dir, tmp_path):
    """The fit ran on in a process group of its own (timeout's) after the script was stopped, and the work folder
    stayed."""
    script, where = rehearsal(tmp_path, DATA=tiny_corpus_dir)
    pid_file = where["marks"] / "fit.pid"
    for _ in range(2400):  # the env part imports every package first: at most 240 s
        if pid_file.exists() or script.poll() is not None:
            break
        time.sleep(0.1)
    assert pid_file.exists(), script.communicate()[0][-3000:]
    fit = int(pid_file.read_text())
    script.send_signal(signal.SIGTERM)
    out, _ = script.communicate(timeout=60)
    assert script.returncode == 128 + signal.SIGTERM, out[-3000:]
    for _ in range(100):
        try:
            os.kill(fit, 0)
        except ProcessLookupError:
            break
        time.sleep(0.1)
    else:
        os.kill(fit, signal.SIGKILL)
        pytest.fail("the fit ran on after the script was stopped")
    assert not list(where["tmp"].glob("gpu-run-work.*"))  # the work folder is gone
    assert "stopped by signal 15" in (tmp_path / "out" / "run-log.txt").read_text()


def test_gpu_run_script_never_starts_a_part_with_timeout_0(tmp_path):
    """With no second left of the cap, prepare got `timeout 0`: no limit at all."""
    script, where = rehearsal(tmp_path, TOTAL_S="20", DATA=str(tmp_path / "absent"))
    out, _ = script.communicate(timeout=300)
    assert script.returncode == 1, out[-3000:]
    assert not (where["marks"] / "prepare.started").exists()
    lines = [json.loads(line) for line in (tmp_path / "out" / "results.jsonl").read_text().splitlines()]
    assert lines[-1] == {"part": "prepare", "status": "skipped", "note": "no second left of the 20s cap"}
    assert not list(where["tmp"].glob("gpu-run-work.*"))
