"""The records (records/): one reader that names the file and line of a bad row, leaves out a torn last line, and
refuses a value its measure cannot take."""

import glob
import json

import pytest
from conftest import ROW, args, one_error_line

from cable_lightning.__main__ import main as verb_main
from cable_lightning.errors import ConfigError
from cable_lightning.records.io import read_records
from cable_lightning.records.schema import LengthRecord, TaskRecord


def test_report_names_the_file_and_line_of_a_bad_row_and_leaves_out_an_evaluation_a_torn_line_ends(tmp_path, capsys):
    """In this process, through the verb table and the error boundary the program uses (test_tools_... runs one
    verb as a program)."""
    records = tmp_path / "run" / "length_eval.jsonl"
    records.parent.mkdir()
    good = json.dumps(ROW) + "\n"
    out = str(tmp_path / "report")
    report = lambda folder, out=out: lambda: verb_main(["report", str(tmp_path / folder), "--out", out])  # noqa: E731
    earlier = json.dumps({**ROW, "step": 2, "ppl": 9.0}) + "\n"  # a whole evaluation, then one killed mid-row
    records.write_text(earlier + good + json.dumps({**ROW, "length": 64})[:30])
    assert report("run")() == 0
    assert (f"{records}:3: a torn last line (a writer stopped mid-row): the evaluation it ends, cable at step 4, is "
            "incomplete (1 whole row) and left out; this file's latest complete evaluation of that run is step 2"
            ) == capsys.readouterr().err.strip()  # said once
    assert "| 32 | **9.00** |" in (tmp_path / "report_nonoverlap.md").read_text()
    records.write_text(good + json.dumps({**ROW, "step": 6})[:70])  # torn as it began the next evaluation
    assert report("run")() == 0
    assert f"{records}:2: skipping a torn last line" in capsys.readouterr().err
    assert "| 32 | **9.50** |" in (tmp_path / "report_nonoverlap.md").read_text()

    records.write_text(good + "{not json\n" + good)
    assert one_error_line(capsys, report("run")) == (
        f"error: {records}:2: not a JSON record (Expecting property name enclosed in double quotes); fix or remove "
        "that line")
    older = {k: v for k, v in ROW.items() if k != "mode"}  # a row format from before window modes
    records.write_text(good + json.dumps(older) + "\n")
    assert one_error_line(capsys, report("run")) == (
        f"error: {records}:2: the row lacks mode (another record format?); valid rows have pe, train_length, step, "
        "length, mode, ppl")
    records.write_text("")
    assert one_error_line(capsys, report("run", str(tmp_path / "empty"))) == (
        f"error: {records} hold no evaluation rows; validate a run first")
    assert not glob.glob(str(tmp_path / "empty*"))
    assert one_error_line(capsys, report("nothing")) == (
        f"error: no length_eval.jsonl under {tmp_path / 'nothing'}; train or validate a run first")


TASK_ROW = {**ROW, "task": "passkey", "depth": 0.5, "accuracy": 0.5}


@pytest.mark.parametrize("kind, row, problem", [
    (LengthRecord, {**ROW, "length": -3}, "length -3 is not a number in [1, inf]"),
    (LengthRecord, {**ROW, "ppl": "9.5"}, "ppl '9.5' is not a number in [1, inf]"),
    (TaskRecord, {**TASK_ROW, "accuracy": 7.5}, "accuracy 7.5 is not a number in [0, 1]"),
], ids=["length", "ppl", "accuracy"])
def test_a_row_with_a_value_its_measure_cannot_take_is_named(tmp_path, kind, row, problem):
    """The report's reader: a value no run writes (an accuracy above 1, a negative length) is an error, not a row."""
    records = tmp_path / kind.FILE
    records.write_text(json.dumps(TASK_ROW if kind is TaskRecord else ROW) + "\n" + json.dumps(row) + "\n")
    with pytest.raises(ConfigError) as error:
        read_records(str(records), kind)
    assert str(error.value) == f"{records}:2: {problem}; fix or remove that line"


def test_records_round_trip_through_the_one_writer_and_reader(tmp_path):
    from cable_lightning.records.io import append_records, read_records
    from cable_lightning.records.schema import LengthRecord, TaskRecord

    length = LengthRecord(pe="dape_v2+cable", train_length=128, step=7, stage="validate", checkpoint="/c.ckpt",
                          length=512, mode="sliding", stride=64, ppl=12.5, loss=2.52, tokens=1000, seconds=1.5,
                          tokens_per_sec=666.7)
    task = TaskRecord(pe="cable", train_length=128, step=7, task="passkey", length=256, depth=0.5, trials=4,
                      correct=None, accuracy=None)
    append_records(str(tmp_path), [length, task, length])
    assert read_records(str(tmp_path / "length_eval.jsonl"), LengthRecord) == [length, length]
    assert read_records(str(tmp_path / "task_accuracy.jsonl"), TaskRecord) == [task]
    # a row an earlier version wrote: fewer keys (defaults fill them) and one this version no longer knows
    (tmp_path / "old.jsonl").write_text(json.dumps({"pe": "rope", "train_length": 32, "step": 4, "length": 64,
                                                    "mode": "nonoverlap", "ppl": 40.0, "retired": 1}) + "\n")
    [old] = read_records(str(tmp_path / "old.jsonl"), LengthRecord)
    assert (old.pe, old.ppl, old.stage, old.checkpoint) == ("rope", 40.0, "fit", None)


def test_two_trained_runs_that_differ_in_an_encoding_setting_are_two_report_columns(tiny_corpus_dir, tmp_path):
    """Two fits that differ only in CABLE's bias_activation shared one run key, and report kept one column of them
    (the later-read run's) without a word: the key holds every weight-defining setting, so they are two columns, each
    named by the difference. A row written before records held settings and a run that records them, otherwise the
    same run, would be one column and seed: refused, naming it."""
    from cable_lightning.cli import main
    from cable_lightning.eval.comparable import incomparable, latest_rows
    from cable_lightning.eval.report import build_table
    from cable_lightning.records.io import find_records

    folders = []
    for activation in ("relu", "softplus"):
        runs = str(tmp_path / activation)
        main(["fit", *args(tiny_corpus_dir, runs, steps=2, every=2),
              "--model.init_args.backbone.pos_encoding.bias_activation", activation])
        folders.append(runs)
    rows = latest_rows(find_records(folders))
    assert incomparable(rows) is None
    columns, table = build_table(rows, "nonoverlap")
    assert columns == ["cable bias_activation=relu", "cable bias_activation=softplus"]
    relu, softplus = (table[0][1].values[7], table[0][2].values[7])
    assert relu != softplus  # two runs' numbers, not one run's twice
    settings = {r.settings["pos_encoding.bias_activation"] for r in rows}
    assert settings == {"relu", "softplus"} and all(r.settings["dropout"] == 0.0 for r in rows)
    earlier = LengthRecord(**{**vars(rows[0]), "settings": None})
    problem = incomparable([rows[0], earlier])
    assert problem is not None and "differ in settings (recorded vs none recorded)" in problem, problem
