"""``python -m cable_lightning gpu-check``: its CPU rehearsal writes a row per part, a recompile-limit hit fails it,
and without CUDA it stops in one line."""

import pytest
import torch

from cable_lightning import gpu_check
from cable_lightning.__main__ import main as verb
from cable_lightning.positional import available


def test_parts_follow_the_backend_each_encoding_takes_on_cuda():
    """The issue's groups come out of the registry, and every backend an encoding can take on CUDA has a part."""
    assert gpu_check.parts_of(gpu_check.ENCODINGS) == {
        "fit sdpa": ["nope", "rope"], "fit fold": ["cable", "alibi", "fox"], "fit flex": ["kerple_log", "fire", "t5"],
        "fit chunked": ["cope", "dape_v2+cable", "stick_breaking"]}
    assert {f"fit {gpu_check.backend_of(name)}" for name in available()} <= set(gpu_check.parts_of(gpu_check.ENCODINGS))


def test_rehearsal_writes_a_row_per_part(tiny_corpus_dir, tmp_path, monkeypatch):
    """Every part runs on the CPU at toy sizes: a real fit through the CLI per backend (compiled by Dynamo, timed,
    validated with diagnostics, checkpointed) and the bench's evaluation, each a row of the file."""
    out, cwd = tmp_path / "gpu_check.md", tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    assert verb(["gpu-check", "--rehearse-on-cpu", "--data-path", tiny_corpus_dir, "--out", str(out),
                 "--runs-dir", str(tmp_path / "runs")]) == 0
    rows = [[cell.strip() for cell in line.strip("|").split("|")] for line in out.read_text().splitlines()
            if line.startswith("| fit ")]
    assert [row[0] for row in rows] == list(gpu_check.parts_of(gpu_check.ENCODINGS))
    head = gpu_check.FIT_HEAD
    for row in rows:
        cell = dict(zip(head, row))
        assert cell["steady steps"] == str(gpu_check.REHEARSAL.steady), row
        warmup, steady, _ = map(int, cell["Dynamo compiles: warm-up / steady / validations"].split(" / "))
        assert warmup >= 1 and steady == 0, row  # compiled in the warm-up, no recompile in the steady steps
        assert float(cell["tokens/s"].replace(",", "")) > 0
        for name in ("first validation s", "evaluation s", "diagnostics s (x evaluation)", "checkpoint s"):
            assert float(cell[name].split()[0]) > 0, (name, row)
        assert cell["note"] == "", row  # two validations (the second's costs reported), within the budget
    bench_rows = [line for line in out.read_text().splitlines() if line.startswith("| bench |")]
    assert len(bench_rows) == 3 and all("failed" not in row and "skipped" not in row for row in bench_rows)
    assert torch.compile.__name__ == "compile"  # the rehearsal's eager backend is undone
    assert list(cwd.iterdir()) == []  # every record under --runs-dir


def test_a_spent_budget_skips_each_part_with_a_row(tmp_path):
    out = tmp_path / "gpu_check.md"
    assert verb(["gpu-check", "--rehearse-on-cpu", "--budget-scale", "1e-9", "--out", str(out)]) == 0
    rows = [line for line in out.read_text().splitlines() if line.startswith("| ")]
    parts = ["bench"] + list(gpu_check.parts_of(gpu_check.ENCODINGS))
    assert {row.split(" | ")[0][2:] for row in rows if "skipped: its budget is spent" in row} == set(parts)


def test_a_recompile_limit_hit_fails_the_verb_naming_the_function(monkeypatch, tmp_path, capsys):
    """Dynamo's real warning (a function recompiled past its limit) is caught, and the verb exits 1 naming it."""

    def thrashing_fit(self, part, label, deadline):
        @torch.compile(backend="eager")
        def thrashed(x):
            return x * 2

        torch._dynamo.reset()
        with torch._dynamo.config.patch(recompile_limit=1):
            for dtype in (torch.float32, torch.float64):  # a dtype change fails the guards: a recompile
                thrashed(torch.ones(2, dtype=dtype))

    monkeypatch.setattr(gpu_check.Run, "fit", thrashing_fit)
    monkeypatch.setattr(gpu_check.Run, "bench", lambda *args: None)
    with pytest.raises(SystemExit) as stopped:
        verb(["gpu-check", "--rehearse-on-cpu", "--out", str(tmp_path / "out.md"), "--encodings", "nope"])
    assert stopped.value.code == 1
    last = capsys.readouterr().err.splitlines()[-1]  # after Dynamo's own warning, where torch's logging prints it
    assert last.startswith("error: gpu-check: Dynamo hit its recompile limit in 'thrashed'")


def test_without_cuda_it_stops_in_one_line(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit) as stopped:
        verb(["gpu-check", "--out", str(tmp_path / "out.md")])
    assert stopped.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: gpu-check needs a CUDA GPU")
    assert not (tmp_path / "out.md").exists()


def test_out_replaces_only_a_file_gpu_check_wrote_and_only_with_overwrite(tmp_path, capsys):
    """A GPU run's rows cannot be made again without a GPU: a later run (a CPU rehearsal) does not truncate them
    unasked, nor a file gpu-check did not write even with --overwrite; the refusal comes before any work."""
    from test_doors import only_line

    quick = ["gpu-check", "--rehearse-on-cpu", "--budget-scale", "1e-9", "--encodings", "nope"]  # every part skipped
    notes, results = tmp_path / "notes.md", tmp_path / "gpu_check.md"
    notes.write_text("# my notes\n")
    for overwrite in ([], ["--overwrite"]):
        assert only_line(capsys, [*quick, "--out", str(notes), *overwrite]) == (
            f"error: {notes} already exists and was not written by gpu-check (its first line is not '## gpu-check: '); "
            "choose another --out (--overwrite replaces only what gpu-check wrote)")
    assert notes.read_text() == "# my notes\n"
    assert verb([*quick, "--out", str(results)]) == 0
    earlier = results.read_text()
    assert only_line(capsys, [*quick, "--out", str(results)]) == (
        f"error: {results} already exists (written by gpu-check); pass --overwrite to replace it or choose another "
        "--out")
    assert results.read_text() == earlier
    results.write_text(earlier.replace("skipped", "a GPU's row"))
    assert verb([*quick, "--out", str(results), "--overwrite"]) == 0
    assert results.read_text().startswith("## gpu-check: ") and "a GPU's row" not in results.read_text()
