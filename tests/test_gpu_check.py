"""``python -m cable_lightning gpu-check``: its CPU rehearsal writes a row per part, compiling does not take the steady
steps' budget, the memory estimate counts the encodings' position tables, a recompile-limit hit fails it, and without
CUDA it stops in one line."""

import os
import re
import signal
import time
from types import SimpleNamespace

import pytest
import torch

from cable_lightning.__main__ import main as verb
from cable_lightning.gpu_check import evaluation, fits, memory, plan, run
from cable_lightning.models import BackboneConfig
from cable_lightning.positional import available, from_label
from cable_lightning.positional.fire import HIDDEN


class Clock:
    """gpu-check's ``time`` with ``monotonic`` (its budgets' clock) moved on by ``ahead`` seconds."""

    def __init__(self):
        self.ahead = 0.0

    def __getattr__(self, name):
        return getattr(time, name)

    def monotonic(self):
        return time.monotonic() + self.ahead


def test_parts_follow_the_backend_each_encoding_takes_on_cuda():
    """The issue's groups come out of the registry, and every backend an encoding can take on CUDA has a part."""
    assert plan.parts_of(plan.ENCODINGS) == {
        "fit sdpa": ["nope", "rope"], "fit fold": ["cable", "alibi", "fox"], "fit flex": ["kerple_log", "fire", "t5"],
        "fit chunked": ["cope", "dape_v2+cable", "stick_breaking"]}
    assert {f"fit {plan.backend_of(name)}" for name in available()} <= set(plan.parts_of(plan.ENCODINGS))


def cells(text: str, part: str) -> list[list[str]]:
    return [[cell.strip() for cell in line.strip("|").split("|")] for line in text.splitlines()
            if line.startswith(f"| {part}")]


def test_rehearsal_writes_a_row_per_part(tiny_corpus_dir, tmp_path, monkeypatch):
    """Every part runs on the CPU at toy sizes: a real fit through the CLI per backend (compiled by Dynamo, timed,
    validated with diagnostics, checkpointed), the bench's evaluation and the FlexAttention tests (collected), each a
    row of the file. The first fit's warm-up takes 30 s by the budgets' clock, past its compile budget and past the
    24 s that once was a whole fit's: its steady steps are timed all the same, and its row says so."""
    out, cwd = tmp_path / "gpu_check.md", tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    clock, record = Clock(), fits.FitClock.on_train_batch_start

    def slow_first_compile(self, trainer, *args):
        if len(self.marks) == 1 and not clock.ahead:  # the first fit's warm-up step, where it compiled, took 30 s
            clock.ahead = 30.0
        record(self, trainer, *args)

    for module in (fits, evaluation, run):
        monkeypatch.setattr(module, "time", clock)
    monkeypatch.setattr(fits.FitClock, "on_train_batch_start", slow_first_compile)
    assert verb(["gpu-check", "--rehearse_on_cpu", "--data_path", tiny_corpus_dir, "--out", str(out),
                 "--runs_dir", str(tmp_path / "runs")]) == 0
    text = out.read_text()
    rows = [row for row in cells(text, "") if row[0].startswith(("fit ", "gpt2-vocab fit "))]
    assert [row[0] for row in rows] == [f"{shape}{part}" for part in plan.parts_of(plan.ENCODINGS)
                                        for shape in ("gpt2-vocab ", "")]  # each part at each shape, the paper's first
    for number, row in enumerate(rows):
        cell = dict(zip(fits.FIT_HEAD, row))
        assert cell["steady steps"] == str(plan.REHEARSAL.steady), row
        warmup, steady, _ = map(int, cell["Dynamo compiles: warm-up / steady / validations"].split(" / "))
        assert warmup >= 1 and steady == 0, row  # compiled in the warm-up, no recompile in the steady steps
        assert float(cell["tokens/s"].replace(",", "")) > 0
        for name in ("first validation s", "evaluation s", "diagnostics s (x evaluation)", "checkpoint s"):
            assert float(cell[name].split()[0]) > 0, (name, row)
        compiled, budget = map(float, cell["compile s (warm-up) / budget"].split(" / "))
        assert budget == plan.COMPILE_BUDGET_S and (compiled >= 30) == (number == 0), row
        assert cell["steady s / budget"].endswith(f" / {plan.STEADY_BUDGET_S:.0f}"), row
        assert len(cell["estimate GiB: state + activations + logits + tables"].split(" + ")) == 4, row
        # two validations (the second's costs reported), within the budgets but the first fit's compiling
        assert re.fullmatch(r"compiling took 3\d s, past its 20 s budget" if number == 0 else "", cell["note"]), row
    bench = [dict(zip(["part", "encoding", "backend", "compile", "eval s", "x", "mib", "x mib", "compiles"], row))
             for row in cells(text, "bench |")]
    assert [(row["encoding"], row["backend"]) for row in bench] == [  # NoPE on flex: the kernel without a bias
        ("nope", "sdpa"), ("nope:flex", "flex"), ("cable", "fold"), ("kerple_log", "flex")]
    assert all("failed" not in row["compile"] and "skipped" not in row["compile"] for row in bench)
    assert all(row["compiles"].endswith(" / 0") for row in bench)  # the timed forwards reuse the first's compile
    (flex_tests,) = cells(text, "pytest |")
    assert flex_tests[1:4] == ["tests/test_attention.py -k flex", "0", flex_tests[3]] and "collected" in flex_tests[3]
    assert torch.compile.__name__ == "compile"  # the rehearsal's eager backend is undone
    assert list(cwd.iterdir()) == []  # every record under --runs_dir


def test_the_paper_shape_fits_carry_mfu_the_anchors_and_the_issues_targets(tiny_corpus_dir, tmp_path, monkeypatch):
    """Beside the prepared data's fits, fits at GPT-2's vocabulary (the paper's shape: the prepared ids in a
    50257-entry vocabulary, no tokenizer), each row with its MFU, its tokens/s over the paper's and llm.c's and the
    issue's target met or missed (NoPE's ratio at the same shape)."""
    monkeypatch.setattr(run.Run, "bench", lambda *args: None)
    monkeypatch.setattr(run.Run, "pytest", lambda *args: None)
    out = tmp_path / "gpu_check.md"
    assert verb(["gpu-check", "--rehearse_on_cpu", "--data_path", tiny_corpus_dir, "--out", str(out), "--runs_dir",
                 str(tmp_path / "runs"), "--encodings", "nope", "cable", "--shapes", "gpt2-vocab"]) == 0
    rows = {row[1]: dict(zip(fits.FIT_HEAD, row)) for row in cells(out.read_text(), "gpt2-vocab fit ")}
    assert set(rows) == {"nope", "cable"}
    for label, row in rows.items():
        assert row["vocab"] == "50257" and row["steady steps"] == str(plan.REHEARSAL.steady), row
        rate = float(row["tokens/s"].replace(",", ""))
        assert re.fullmatch(r"\d+\.\d%", row["MFU"]), row
        assert row["x paper 238k / llm.c 460k"] == f"{rate / 237500:.2f} / {rate / 460000:.2f}", row
    assert re.fullmatch(r"MFU >= 40%: (met|missed)", rows["nope"]["target"])
    assert rows["nope"]["target"].endswith("met" if float(rows["nope"]["MFU"][:-1]) >= 40 else "missed")
    # a toy model on a CPU trains far below 357k tokens/s: the target is missed, and its ratio to NoPE is there
    assert rows["cable"]["target"] == ">= 357k tokens/s and >= 0.9x NoPE: missed"
    assert float(rows["cable"]["x NoPE"]) > 0
    assert "\n| fit " not in out.read_text()  # --shapes gpt2-vocab: no fit at the prepared data's vocabulary


def test_each_fit_has_its_bare_step_beside_it_and_their_ratio(tiny_corpus_dir, tmp_path, monkeypatch):
    """The fit's own compiled model trained on one batch without Lightning (forward, backward, clipping, fused AdamW)
    in the same process after the fit, reusing the fit's compile; the row gives its step and the fit's over it against
    the 1.10x target."""
    monkeypatch.setattr(run.Run, "bench", lambda *args: None)
    monkeypatch.setattr(run.Run, "pytest", lambda *args: None)
    out = tmp_path / "gpu_check.md"
    assert verb(["gpu-check", "--rehearse_on_cpu", "--data_path", tiny_corpus_dir, "--out", str(out), "--runs_dir",
                 str(tmp_path / "runs"), "--encodings", "nope", "--shapes", "prepared"]) == 0
    (row,) = [dict(zip(fits.FIT_HEAD, row)) for row in cells(out.read_text(), "fit ")]
    step, bare = float(row["step ms (median)"]), float(row["bare step ms"])
    ratio = re.fullmatch(r"(\d+\.\d\d) \(<= 1\.10: (met|missed)\)", row["fit / bare step"])
    assert bare > 0 and ratio, row
    assert abs(float(ratio[1]) - step / bare) <= 0.01 + 0.05 * step / bare, row  # the cells are rounded to 0.1 ms
    assert ratio[2] == ("met" if float(ratio[1]) <= 1.10 else "missed")
    assert row["note"] == "", row  # the bare step compiled nothing more: it ran the fit's compiled blocks


def test_the_targets_are_the_issues():
    from cable_lightning.gpu_check.targets import target_of

    texts = {label: getattr(target_of(label, plan.backend_of(label)), "text", None) for label in plan.ENCODINGS}
    assert texts == {"nope": "MFU >= 40%", "rope": None, "cable": ">= 357k tokens/s and >= 0.9x NoPE",
                     "alibi": ">= 0.9x NoPE", "fox": ">= 0.9x NoPE", "kerple_log": ">= 0.6x NoPE",
                     "fire": ">= 0.6x NoPE", "t5": ">= 0.6x NoPE", "cope": ">= 0.3x NoPE",
                     "dape_v2+cable": ">= 0.3x NoPE", "stick_breaking": ">= 0.3x NoPE"}
    cable = target_of("cable", "fold")
    assert cable.verdict(None, 360e3, 0.95).endswith(": met") and cable.verdict(None, 350e3, 0.95).endswith(": missed")
    assert cable.verdict(None, 360e3, 0.85).endswith(": missed")
    assert cable.verdict(None, 360e3, None).endswith(": not measured")  # no NoPE row at that shape


def test_a_fit_stops_at_its_steady_budget_once_a_steady_step_is_timed_and_one_with_none_says_why():
    """The steady budget runs from the first steady step's start; a first steady step longer than the whole budget
    (a recompile) is still followed by one more, so that its period is timed. A fit that timed none says why."""
    clock = fits.FitClock(warmup=1, steady_budget=0.0, device=torch.device("cpu"))
    trainer = SimpleNamespace(should_stop=False)
    module = SimpleNamespace(backbone=SimpleNamespace(training_flops_per_token=lambda length: 1.0))
    batch = torch.zeros(2, 9, dtype=torch.long)
    assert clock.no_steps() == "no steady step: training ended after 0 of its 1 warm-up steps"
    for step in range(3):
        clock.on_train_batch_start(trainer, module, batch, step)
        if step == 1:
            assert clock.no_steps() == ("no steady step: training ended in the first steady step, whose period "
                                        "never closed")
        clock.on_train_batch_end(trainer, module, None, batch, step)
        assert trainer.should_stop == (step == 2) and clock.stopped == (step == 2)
    assert len(clock.steps()) == 1


def test_the_memory_estimate_counts_the_position_tables_each_encoding_keeps():
    """gpt2-small at 1024 tokens, 16 sequences: a bias of positions alone on the flex path keeps a 12-head 1024 x 1024
    fp32 table per layer for the backward, and what autograd keeps to differentiate it (FIRE: its MLP's hidden units
    over the whole table); a folded bias, one of tokens, a logit score or none keeps no table."""
    def tables(label, **settings):
        config = BackboneConfig(preset="gpt2-small", pos_encoding=from_label(label), block_size=1024, vocab_size=4096,
                                **settings)
        with torch.device("meta"):
            model = SimpleNamespace(config=config, parameters=lambda: [torch.empty(10)])
        state, activations, logits, table = memory.memory_estimate(model, 16, 1024)
        assert (state, activations, logits) == (160, 34 * 16 * 1024 * 768 * 12, 6 * 16 * 1024 * 4096)
        return table

    alone = 12 * 12 * 1024**2 * 4  # the tables themselves, 0.56 GiB
    assert tables("kerple_log") > alone and tables("t5") > alone
    assert tables("fire") >= alone + 12 * HIDDEN * 1024**2 * 4  # each hidden unit's ReLU over the whole table
    assert tables("alibi", attention_backend="flex") >= alone  # ALiBi keeps a table only off its fold path
    for label in ("nope", "rope", "alibi", "cable", "k_cable", "cope", "dape_v2+kerple_log"):
        assert tables(label) == 0, label


def test_a_spent_budget_skips_each_part_with_a_row(tmp_path):
    out = tmp_path / "gpu_check.md"
    assert verb(["gpu-check", "--rehearse_on_cpu", "--budget_scale", "1e-9", "--out", str(out)]) == 0
    rows = [line for line in out.read_text().splitlines() if line.startswith("| ")]
    parts = ["bench", *plan.parts_of(plan.ENCODINGS), *(f"gpt2-vocab {p}" for p in plan.parts_of(plan.ENCODINGS)),
             "pytest"]
    assert {row.split(" | ")[0][2:] for row in rows if "skipped: its budget is spent" in row} == set(parts)


def test_a_recompile_limit_hit_fails_the_verb_naming_the_function(monkeypatch, tmp_path, capsys):
    """Dynamo's real warning (a function recompiled past its limit) is caught, and the verb exits 1 naming it."""

    def thrashing_fit(self, part, label, shape):
        @torch.compile(backend="eager")
        def thrashed(x):
            return x * 2

        torch._dynamo.reset()
        with torch._dynamo.config.patch(recompile_limit=1, fail_on_recompile_limit_hit=False):  # as in a run
            for dtype in (torch.float32, torch.float64):  # a dtype change fails the guards: a recompile
                thrashed(torch.ones(2, dtype=dtype))

    monkeypatch.setattr(run.Run, "fit", thrashing_fit)
    monkeypatch.setattr(run.Run, "bench", lambda *args: None)
    monkeypatch.setattr(run.Run, "pytest", lambda *args: None)
    with pytest.raises(SystemExit) as stopped:
        verb(["gpu-check", "--rehearse_on_cpu", "--out", str(tmp_path / "out.md"), "--encodings", "nope"])
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
    from conftest import only_line

    quick = ["gpu-check", "--rehearse_on_cpu", "--budget_scale", "1e-9", "--encodings", "nope"]  # every part skipped
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


@pytest.mark.parametrize("stopped_in", ["bench", "pytest"], ids=["before-its-first-row", "after-rows"])
def test_a_sigterm_keeps_the_earlier_file_until_the_first_row_and_says_what_out_holds(tmp_path, capsys, monkeypatch,
                                                                                       stopped_in):
    """``--overwrite`` stopped by SIGTERM before its first row left an earlier file (a GPU run's rows) as its heading
    line alone, and said nothing (SIGTERM's default ended the process)."""
    results = tmp_path / "gpu_check.md"
    earlier = "## gpu-check: NVIDIA H200, torch 2.11, 2026-11-27\n\n| bench | nope | a GPU's row |\n"
    results.write_text(earlier)

    def unhandled(signum, frame):  # SIGTERM's default would end pytest itself
        raise AssertionError("gpu-check left SIGTERM to its default: the process ends with nothing said")

    monkeypatch.setattr(run.Run, stopped_in, lambda *args: signal.raise_signal(signal.SIGTERM))
    before = signal.signal(signal.SIGTERM, unhandled)
    try:
        with pytest.raises(SystemExit) as stopped:  # every part skipped: rows at once, after the bench
            verb(["gpu-check", "--rehearse_on_cpu", "--budget_scale", "1e-9", "--encodings", "nope", "--out",
                  str(results), "--overwrite"])
    finally:
        signal.signal(signal.SIGTERM, before)
    said = {"bench": f"it had no row yet: the earlier {results} is kept as it was",
            "pytest": f"the rows so far are in {results}"}[stopped_in]
    assert stopped.value.code == 143 and capsys.readouterr().err.splitlines() == [
        f"error: gpu-check stopped by SIGTERM; {said}"]
    text = results.read_text()
    if stopped_in == "bench":
        assert text == earlier
    else:
        assert text.startswith("## gpu-check: CPU rehearsal") and "skipped: its budget is spent" in text
        assert "a GPU's row" not in text
    assert os.listdir(tmp_path) == ["gpu_check.md"]  # no partial file left beside it
