"""The report (eval/report.py) and its tables (eval/tables.py), on records written here: no run is trained."""

import json

from cable_lightning.eval import report
from cable_lightning.eval.tables import Cell, markdown, markdown_table
from cable_lightning.records import LossPoint, RetrievalRecord, append_records


def test_a_torn_last_line_of_a_fine_tuning_loss_curve_is_left_out_with_a_note(tmp_path, capsys):
    """finetune_loss.jsonl is read as every record is: a retrieval run killed as it wrote its curve's last point left
    a line the report could not parse, and the report stopped in a traceback."""
    run, tuned = tmp_path / "run", tmp_path / "run" / "export-tuned"
    tuned.mkdir(parents=True)
    append_records(str(run), [RetrievalRecord(pe="cable", train_length=32, step=4, checkpoint="last.ckpt",
                                              dataset="set", length=32, ndcg=0.5)])
    (tuned / "config.json").write_text(json.dumps({"provenance": {"checkpoint": "last.ckpt"}}))
    (tuned / LossPoint.FILE).write_text('{"step": 1, "loss": 2.5}\n{"step": 2, "loss": 2.0}\n{"step": 3, "lo')
    curves = report.loss_curves([str(run)])
    assert curves["contrastive loss"] == {"cable": {1: [2.5], 2: [2.0]}}
    assert f"{tuned / LossPoint.FILE}:3: skipping a truncated last line" in capsys.readouterr().err


def test_a_table_is_written_as_markdown_with_its_rule_and_bold_where_no_test_separates():
    assert markdown_table(["length", "a", "b"], [[32, "1", ""]]) == "| length | a | b |\n|---|---|---|\n| 32 | 1 |  |"
    columns, rows = ["alibi", "cable"], [[64, Cell({0: 3.0, 1: 3.1, 2: 2.9}), Cell({0: 9.0, 1: 9.2, 2: 8.8})]]
    lines = markdown(columns, rows).splitlines()
    assert lines[:2] == ["| length | alibi | cable |", "|---|---|---|"]
    assert lines[2].startswith("| 64 | **3.00 [") and "| 9.00 [" in lines[2]  # cable is separated from the best
