"""The report (eval/report.py) and its tables (eval/tables.py), on records written here: no run is trained."""

import json

import pytest
from scipy import stats

from cable_lightning.errors import ConfigError
from cable_lightning.eval import report
from cable_lightning.eval.comparable import latest_rows
from cable_lightning.eval.intervals import seed_interval
from cable_lightning.eval.loss_curves import loss_curves
from cable_lightning.eval.retrieval_tables import retrieval_tables
from cable_lightning.eval.tables import Cell, markdown, markdown_table, neighbours
from cable_lightning.figures import line_figure
from cable_lightning.records.io import append_records
from cable_lightning.records.schema import LengthRecord, LossPoint, RetrievalRecord


def test_a_torn_last_line_of_a_fine_tuning_loss_curve_is_left_out_with_a_note(tmp_path, capsys):
    """finetune_loss.jsonl is read as every record is: a retrieval run killed as it wrote its curve's last point left
    a line the report could not parse, and the report stopped in a traceback."""
    run, tuned = tmp_path / "run", tmp_path / "run" / "export-tuned"
    tuned.mkdir(parents=True)
    append_records(str(run), [RetrievalRecord(pe="cable", train_length=32, step=4, checkpoint="last.ckpt",
                                              dataset="set", length=32, ndcg=0.5)])
    (tuned / "config.json").write_text(json.dumps({"provenance": {"checkpoint": "last.ckpt"}}))
    (tuned / LossPoint.FILE).write_text('{"step": 1, "loss": 2.5}\n{"step": 2, "loss": 2.0}\n{"step": 3, "lo')
    curves = loss_curves([str(run)])
    assert curves["contrastive loss"] == {"cable": {1: [2.5], 2: [2.0]}}
    assert f"{tuned / LossPoint.FILE}:3: skipping a truncated last line" in capsys.readouterr().err


def test_a_table_is_written_as_markdown_with_its_rule_and_bold_where_no_test_separates():
    assert markdown_table(["length", "a", "b"], [[32, "1", ""]]) == "| length | a | b |\n|---|---|---|\n| 32 | 1 |  |"
    columns, rows = ["alibi", "cable"], [[64, Cell({0: 3.0, 1: 3.1, 2: 2.9}), Cell({0: 9.0, 1: 9.2, 2: 8.8})]]
    lines = markdown(columns, rows).splitlines()
    assert lines[:2] == ["| length | alibi | cable |", "|---|---|---|"]
    assert lines[2].startswith("| 64 | **3.00 [") and "| 9.00 [" in lines[2]  # cable is separated from the best


def test_each_row_ranks_its_encodings_with_the_paired_p_value_against_the_one_before():
    """A ranking's every step is tested, not only its distance from the best: the p-value between neighbours is the
    paired t-test's by hand (t = mean(d) / (sd(d) / sqrt(n)), n - 1 degrees of freedom); a pair that differs by the
    same amount at every seed gives 0; columns without shared seeds say so; a row of one encoding is left out."""
    columns = ["rope", "alibi", "cable", "fire"]
    rows = [[2048, Cell({0: 1.59, 1: 1.64, 2: 1.55}), Cell({0: 0.5, 1: 0.75, 2: 0.5}),
             Cell({0: 0.625, 1: 0.875, 2: 0.625}), Cell({3: 1.02, 4: 1.03})],
            [4096, Cell({0: 2.0, 1: 2.1}), None, None, None]]
    d = [1.59 - 0.625, 1.64 - 0.875, 1.55 - 0.625]  # rope against cable, its neighbour by mean
    mean = sum(d) / 3
    sd = (sum((x - mean) ** 2 for x in d) / 2) ** 0.5
    p = 2 * stats.t.sf(mean / (sd / 3 ** 0.5), 2)
    text = neighbours(columns, rows, digits=3)
    assert text.splitlines()[2:] == ["- 2048: alibi 0.583 < cable 0.708 (p = 0) < fire 1.025 (no pair) < rope 1.593 "
                                     "(no pair)"]
    lines = neighbours(["rope", "cable"], [[2048, rows[0][1], rows[0][3]]], best=max, digits=3).splitlines()
    assert lines[2] == f"- 2048: rope 1.593 > cable 0.708 (p = {p:.3g})"
    assert neighbours(columns, rows[1:]) == ""


def test_report_keeps_the_latest_evaluation_of_each_run(tmp_path):
    rows = [
        {"pe": "cable", "train_length": 128, "step": 10, "length": 256, "mode": "nonoverlap", "ppl": 50.0},
        {"pe": "cable", "train_length": 128, "step": 20, "length": 256, "mode": "nonoverlap", "ppl": 40.0},
        {"pe": "cable", "train_length": 128, "step": 20, "length": 256, "mode": "nonoverlap", "ppl": 39.0},
        {"pe": "rope", "train_length": 128, "step": 20, "length": 256, "mode": "nonoverlap", "ppl": 90.0},
    ]
    path = tmp_path / "length_eval.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    latest = latest_rows([str(path)])
    assert sorted((r.pe, r.ppl) for r in latest) == [("cable", 39.0), ("rope", 90.0)]
    assert markdown(*report.build_table(latest, "nonoverlap")).splitlines()[2] == "| 256 | **39.00** | 90.00 |"


def test_runs_that_differ_only_in_their_backbone_are_two_columns(tmp_path):
    """Two experiments with the same encoding, training length, seed and rate but another model size were one run to
    the report (the later file's numbers replaced the other's); a row written before records named the backbone
    (no ``model``) joins the run it matches."""
    rows = {"small": {"model": "decoder L12-D768-H12", "ppl": 30.0}, "tiny": {"model": "decoder L4-D256-H4",
                                                                             "ppl": 60.0}, "old": {"ppl": 45.0,
                                                                                                   "run_seed": 1}}
    paths = []
    for name, row in rows.items():
        path = tmp_path / name / "length_eval.jsonl"
        path.parent.mkdir()
        path.write_text(json.dumps({"pe": "cable", "train_length": 128, "step": 20, "run_seed": 0, "lr": 6e-4,
                                    "length": 256, "mode": "nonoverlap", **row}) + "\n")
        paths.append(str(path))
    lines = markdown(*report.build_table(latest_rows(paths[:2]), "nonoverlap")).splitlines()
    assert lines[0] == "| length | cable (decoder L12-D768-H12) | cable (decoder L4-D256-H4) |"
    assert lines[2] == "| 256 | **30.00** | 60.00 |"
    lines = markdown(*report.build_table(latest_rows(paths[1:]), "nonoverlap")).splitlines()
    assert lines[0] == "| length | cable |" and lines[2].startswith("| 256 | **52.50 [")  # seeds 0 and 1, one column


def test_report_without_records_names_the_paths(tmp_path):
    with pytest.raises(FileNotFoundError, match="no length_eval.jsonl under"):
        report.report([str(tmp_path)], str(tmp_path / "out"))


def test_best_marks_the_lowest_and_every_encoding_within_noise_of_it():
    latest = rows("cable", [10.0, 10.5, 11.0]) + rows("alibi", [10.1, 10.4, 11.2]) + rows("rope", [12.0, 12.6, 13.1])
    table = markdown(*report.build_table(latest, "nonoverlap"))
    row = table.splitlines()[2].split(" | ")
    assert row[1].startswith("**10.57 [") and row[1].endswith("]**")  # alibi, not separable from the best
    assert row[2].startswith("**10.50 [")  # cable, the lowest mean
    assert row[3].startswith("12.57 [") and "**" not in row[3]  # rope: clearly worse in every seed
    e = seed_interval([10.0, 10.5, 11.0])  # the interval printed is the t-interval over the three seeds
    assert row[2] == f"**{e.mean:.2f} [{e.low:.2f}, {e.high:.2f}]**"


def test_ratio_against_tokens_is_each_encodings_mean_over_seeds_at_the_longest_length(monkeypatch, tmp_path):
    """The figure's points, against a direct computation: x is the step times the recipe's tokens of a step, y the
    mean over seeds of each run's ppl(longest) / ppl(training length), with the seeds' t-interval as the band."""

    drawn = {}
    monkeypatch.setattr(report, "line_figure", lambda series, *a, bands=None: drawn.update(series=series,
                                                                                           bands=bands, args=a))
    monkeypatch.setattr(report, "save_figure", lambda fig, path: None)
    ppl = {(pe, seed, step, length): 100.0 + 7 * i + (length // 64) * (3 if pe == "rope" else -1) * step / 100
           for i, (pe, seed, step, length) in enumerate((pe, seed, step, length) for pe in ("cable", "rope")
                                                        for seed in (0, 1, 2) for step in (100, 200)
                                                        for length in (64, 256, 1024))}
    runs: dict = {}
    for (pe, seed, step, length), value in ppl.items():
        row = LengthRecord(pe=pe, train_length=64, step=step, run_seed=seed, length=length, mode="nonoverlap",
                           ppl=value, recipe={"batch_tokens": 512})
        runs.setdefault(row.run_key(), {}).setdefault(step, []).append(row)
    assert report.ratio_tokens_figure(report.step_tables(runs, "nonoverlap"), "nonoverlap", str(tmp_path / "f.png"))
    for pe in ("cable", "rope"):
        expected = [(step * 512, sum(ppl[pe, s, step, 1024] / ppl[pe, s, step, 64] for s in (0, 1, 2)) / 3)
                    for step in (100, 200)]
        assert [x for x, _ in drawn["series"][pe]] == [x for x, _ in expected]
        assert [y for _, y in drawn["series"][pe]] == pytest.approx([y for _, y in expected])
        ratios = [ppl[pe, s, 200, 1024] / ppl[pe, s, 200, 64] for s in (0, 1, 2)]
        low, high = stats.t.interval(0.95, 2, loc=sum(ratios) / 3, scale=stats.sem(ratios))
        assert list(drawn["bands"][pe][-1]) == pytest.approx([200 * 512, low, high])
    assert drawn["args"][2] == "tokens trained"
    one_step = {key: {100: steps[100]} for key, steps in runs.items()}
    assert not report.ratio_tokens_figure(report.step_tables(one_step, "nonoverlap"), "nonoverlap",
                                          str(tmp_path / "g.png"))


def rows(pe, ppls, length=256):
    return [LengthRecord(pe=pe, train_length=128, step=10, run_seed=seed, length=length, mode="nonoverlap", ppl=ppl)
            for seed, ppl in enumerate(ppls)]


def test_a_retrieval_set_gets_ndcg_mrr_and_recall_tables_over_seeds_and_its_in_view_shares():
    """The code set records MRR@10, Recall@100 and where each query's function lies: the report gives each metric's
    table (means over seeds, x100) and the in-view share by length; rows without MRR (MLDR) give nDCG@10 alone."""
    values = {(pe, seed, length): 0.1 + 0.01 * seed + (0.05 + 0.003 * seed ** 2 if pe == "alibi" else 0) + length / 1e4
              for pe in ("alibi", "cable") for seed in (0, 1, 2) for length in (128, 512)}
    rows = [RetrievalRecord(pe=pe, train_length=128, step=500, run_seed=seed, dataset="code", length=length,
                            ndcg=v, mrr=v / 2, recall=min(1.0, 4 * v), queries=200,
                            visible={128: 0.0, 512: 0.19}[length]) for (pe, seed, length), v in values.items()]
    text, table = retrieval_tables(rows)
    sections = text.split("\n\n")
    assert [s for s in sections if s.endswith("(x100)")] == ["nDCG@10 (x100)", "MRR@10 (x100)", "Recall@100 (x100)"]
    columns, lines = table
    assert columns == ["alibi", "cable"] and [line[0] for line in lines] == [128, 512]
    mean = sum(100 * values["cable", s, 512] for s in (0, 1, 2)) / 3
    assert lines[1][2].estimate().mean == pytest.approx(mean)
    mrr = text[text.index("MRR@10"):text.index("Recall@100")]
    assert f"{mean / 2:.2f} [" in mrr
    assert sections[-1] == "whole passage in view: 128: 0.0%, 512: 19.0%"
    [change] = [s for s in sections if s.startswith("nDCG@10 (x100), change from")]
    assert change.startswith("nDCG@10 (x100), change from 128 to 512 (paired t-test over seeds, p < 0.05): "
                             "alibi 3.84 [")
    mldr = [RetrievalRecord(pe="cable", train_length=512, step=1, run_seed=0, dataset="MultiLongDocRetrieval",
                            length=512, ndcg=0.15)]
    text, _ = retrieval_tables(mldr)
    assert "MRR" not in text and "in view" not in text and text.startswith("nDCG@10 (x100)")


def test_the_change_with_length_is_tested_over_seeds_per_encoding():
    """Table 2 of the paper is read by its shape: an encoding that rises past its seeds' noise, one that falls, one
    whose change the seeds do not separate from none, and one seed (no test) are each said as what they are."""
    ndcg = {"rise": [(0.10, 0.20), (0.12, 0.21), (0.11, 0.23)], "fall": [(0.15, 0.01), (0.14, 0.02), (0.16, 0.00)],
            "flat": [(0.10, 0.12), (0.12, 0.09), (0.11, 0.11)]}
    rows = [RetrievalRecord(pe=pe, train_length=128, step=500, run_seed=seed, dataset="code", length=length,
                            ndcg=pair[i], mrr=0.0, recall=0.0)
            for pe, pairs in ndcg.items() for seed, pair in enumerate(pairs) for i, length in enumerate((128, 2048))]
    rows += [RetrievalRecord(pe="one", train_length=128, step=500, run_seed=0, dataset="code", length=length,
                             ndcg=v, mrr=0.0, recall=0.0) for length, v in ((128, 0.1), (2048, 0.3))]
    text, _ = retrieval_tables(rows)
    [line] = [s for s in text.split("\n\n") if s.startswith("nDCG@10 (x100), change from 128 to 2048")]
    changes = dict(part.split(" ", 1) for part in line.split(": ", 1)[1].split("; "))
    rise = [100 * (b - a) for a, b in ndcg["rise"]]
    low, high = stats.t.interval(0.95, 2, loc=sum(rise) / 3, scale=stats.sem(rise))
    assert changes["rise"] == f"{sum(rise) / 3:.2f} [{low:.2f}, {high:.2f}] (rises)"
    assert changes["fall"].endswith("(falls)") and changes["flat"].endswith("(not separated from no change)")
    assert changes["one"] == "20.00 (one seed, no test)"
    # the rises ranked, each against the next by the same paired test (the one-seed encoding pairs with nothing)
    flat = [100 * (b - a) for a, b in ndcg["flat"]]
    [ranking] = [s for s in text.split("\n\n") if s.startswith("- change 128 to 2048: ")]
    assert ranking.startswith(f"- change 128 to 2048: one 20.00 > rise {sum(rise) / 3:.2f} (no pair) > flat ")
    assert f"(p = {stats.ttest_rel(rise, flat).pvalue:.3g}) > fall " in ranking


def test_a_contrastive_loss_curve_without_its_export_config_is_left_out_with_a_note(tmp_path, capsys):
    """Records kept in the repository copied finetune_loss.jsonl without the export's config.json, and the report
    stopped in a traceback (FileNotFoundError) after writing half its tables."""
    run = tmp_path / "run"
    append_records(str(run), [RetrievalRecord(pe="cable", train_length=32, step=4, checkpoint="last.ckpt",
                                              dataset="set", length=32, ndcg=0.5)])
    (run / LossPoint.FILE).write_text('{"step": 1, "loss": 2.5}\n')
    assert loss_curves([str(run)]) == {}
    assert f"{run / LossPoint.FILE}: no export's config.json beside it" in capsys.readouterr().err


def test_a_run_trained_on_with_a_longer_max_steps_is_one_run_at_its_latest_evaluation(tmp_path):
    """The ordinary resume, training on with a longer max_steps, made report refuse the whole folder (its evaluations
    named two recipes): it is one run, counted at its latest evaluation, and the report says it was trained on. Two
    runs whose evaluations overlap are still two runs, refused."""
    recipe = {"steps": 3000, "precision": "bf16-mixed"}
    row = {"pe": "cable", "train_length": 128, "run_seed": 0, "lr": 2e-3, "length": 128, "mode": "nonoverlap",
           "corpus_hash": "a" * 64}
    path = tmp_path / "run" / "length_eval.jsonl"
    path.parent.mkdir()
    rows = [{**row, "step": step, "ppl": 90.0 - step / 100, "recipe": recipe} for step in (1000, 3000)]
    longer = {**recipe, "steps": 6000}
    rows += [{**row, "step": step, "ppl": 90.0 - step / 100, "recipe": longer} for step in (4000, 6000)]
    rows += [{**row, "pe": "alibi", "step": 6000, "ppl": 40.0, "recipe": {**recipe, "steps": 6000}}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    tables = report.report([str(tmp_path / "run")], str(tmp_path / "out"), figures=False)
    assert tables["nonoverlap"].splitlines()[2] == "| 128 | 40.00 | **30.00** |"  # alibi, cable at step 6000
    assert tables["runs trained on"].endswith("- cable (training length 128, seed 0): evaluated at step 6000, trained "
                                              "to max_steps 3000 then 6000")
    other = tmp_path / "other" / "length_eval.jsonl"
    other.parent.mkdir()
    other.write_text("".join(json.dumps({**r, "recipe": {**recipe, "steps": 5000}}) + "\n" for r in rows[:2]))
    with pytest.raises(Exception, match="trained by different recipes"):
        report.report([str(tmp_path / "run"), str(tmp_path / "other")], str(tmp_path / "out2"), figures=False)


def test_each_encodings_ratio_at_a_shared_multiple_is_tabled_and_drawn_against_its_training_length(tmp_path):
    """Runs at 128 and 512 tokens, evaluated at 1x-16x of their own length: ppl(16x) / ppl(1x) per run, by training
    length, one column per encoding (seeds paired), and the figure of it."""
    rows = []
    for train, lengths in ((128, (128, 512, 2048)), (512, (512, 2048, 8192))):
        for pe, slope in (("cable", 0.9), ("alibi", 1.1)):
            for seed in (0, 1):
                base = 50.0 + seed
                rows += [{"pe": pe, "train_length": train, "step": 3000, "run_seed": seed, "length": n,
                          "mode": "nonoverlap", "ppl": base * (slope if n == 16 * train else 1.0) + (train == 512)}
                         for n in lengths]
    path = tmp_path / "runs" / "length_eval.jsonl"
    path.parent.mkdir()
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    tables = report.report([str(path.parent)], str(tmp_path / "out"))
    text = tables["nonoverlap ratio by training length"]
    assert text.startswith("ppl(16x) / ppl(1x) by training length, per run")
    lines = text.splitlines()
    assert lines[2] == "| training length | alibi | cable |"
    cable_512 = ((50 * 0.9 + 1) / 51 + (51 * 0.9 + 1) / 52) / 2
    assert lines[4].startswith("| 128 | 1.100 [") and "| **0.900 [" in lines[4]
    assert lines[5].startswith("| 512 | ") and f"**{cable_512:.3f} [" in lines[5]
    assert (tmp_path / "out_nonoverlap_training_length.png").stat().st_size > 0
    one = tmp_path / "one" / "length_eval.jsonl"  # one training length: no such table
    one.parent.mkdir()
    one.write_text("".join(json.dumps(r) + "\n" for r in rows if r["train_length"] == 128))
    assert "nonoverlap ratio by training length" not in report.report([str(one.parent)], str(tmp_path / "o"),
                                                                      figures=False)


def retrieval_run(folder, pe: str, seed: int, finetune: dict | None = None, dataset_hash: str | None = None,
                  ndcg: float = 0.2) -> str:
    """A run folder with one length row and its retrieval rows at two lengths (as ``retrieval evaluate --records``
    writes them)."""
    append_records(str(folder), [LengthRecord(pe=pe, train_length=128, step=500, run_seed=seed, length=128,
                                              mode="nonoverlap", ppl=9.0)])
    append_records(str(folder), [RetrievalRecord(pe=pe, train_length=128, step=500, run_seed=seed, dataset="code",
                                                 dataset_hash=dataset_hash, finetune=finetune, length=length,
                                                 ndcg=ndcg + length / 1e4, mrr=0.1, recall=0.5)
                                 for length in (128, 512)])
    return str(folder)


def test_two_fine_tunings_of_one_run_are_two_columns_named_by_their_difference(tmp_path):
    """Fine-tunings of one pre-trained run with other --finetune_steps shared a key, so the report showed whichever
    was read last as the run's; they are two columns named by the setting that differs. The fine-tuning seed follows
    the run's seed (the sweep's), which names no column."""
    paths = []
    for seed in (0, 1):
        for steps in (200, 400):
            tuning = {"max_steps": steps, "batch_size": 32, "lr": 2e-5, "seed": seed, "max_seq_length": 128,
                      "mini_batch_size": None}
            paths.append(retrieval_run(tmp_path / f"s{seed}" / f"t{steps}", "cable", seed, tuning,
                                       ndcg=0.1 if steps == 200 else 0.3))
    tables = report.report([str(tmp_path)], str(tmp_path / "report"), figures=False)
    header = tables["retrieval code"].split("\n\n")[1].splitlines()[0]
    assert header == "| length | cable finetune.max_steps=200 | cable finetune.max_steps=400 |"
    first = tables["retrieval code"].split("\n\n")[1].splitlines()[2]
    assert first.startswith("| 128 | 11.28 [") and "| **31.28 [" in first, first


def test_two_sets_of_one_name_with_other_contents_are_refused_in_one_line_naming_both_hashes(tmp_path):
    """A set built again under the same folder name was recorded as the same set: its rows carry its content hash,
    and two hashes under one name are refused, before anything is written; rows an earlier version wrote (no hash)
    report as before."""
    retrieval_run(tmp_path / "cable", "cable", 0, dataset_hash="a" * 64)
    retrieval_run(tmp_path / "alibi", "alibi", 0, dataset_hash="b" * 64)
    with pytest.raises(ConfigError) as refused:
        report.report([str(tmp_path)], str(tmp_path / "out" / "report"), figures=False)
    assert str(refused.value) == (
        f"report {tmp_path}: two retrieval sets are named code, with other contents: set aaaaaaaaaaaa (cable@128 "
        "seed 0) vs set bbbbbbbbbbbb (alibi@128 seed 0); report them apart, or give one of them another folder name")
    assert not (tmp_path / "out").exists()
    old = tmp_path / "old"
    retrieval_run(old / "cable", "cable", 0)
    retrieval_run(old / "alibi", "alibi", 0)
    tables = report.report([str(old)], str(tmp_path / "report"), figures=False)
    assert tables["retrieval code"].split("\n\n")[1].splitlines()[0] == "| length | alibi | cable |"


@pytest.mark.parametrize("ratios, zoomed", [({"cable": 0.95, "alibi": 0.97, "rope": 3.0}, ["alibi", "cable"]),
                                            ({"cable": 0.95, "alibi": 0.97}, None)])
def test_the_training_length_figure_gives_the_encodings_near_1_a_panel_of_their_own(tmp_path, monkeypatch, ratios,
                                                                                     zoomed):
    """Beside an encoding whose ratio is far from 1 (RoPE), those within 0.1 of it would be one line: they get a
    second panel; with none far from 1, one panel."""
    drawn = {}

    def two_panels(series, near, *args, **kwargs):
        drawn["zoomed"] = near
        return line_figure(series, "", None, "", "", False)

    monkeypatch.setattr(report, "zoomed_line_figure", two_panels)
    rows = [{"pe": pe, "train_length": train, "step": 3000, "run_seed": 0, "length": n, "mode": "nonoverlap",
             "ppl": 50.0 * (ratio if n == 4 * train else 1.0)}
            for pe, ratio in ratios.items() for train in (128, 512) for n in (train, 4 * train)]
    path = tmp_path / "runs" / "length_eval.jsonl"
    path.parent.mkdir()
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    report.report([str(path.parent)], str(tmp_path / "out"))
    assert drawn.get("zoomed") == zoomed
    assert (tmp_path / "out_nonoverlap_training_length.png").stat().st_size > 0
