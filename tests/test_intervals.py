"""Results over seeds: interval and test arithmetic, the best-marking rule, seeds as runs through sweep, fit and
report, the one-seed bootstrap, the extrapolation ratio table."""

import argparse
import csv
import json
import math
import os

import lightning as L
import pytest
import torch
from conftest import args as tiny_args
from scipy import stats

from cable_lightning import sweep
from cable_lightning.callbacks import LengthEvalRecorder
from cable_lightning.cli import main
from cable_lightning.data.datamodule import TokenDataModule
from cable_lightning.eval import report
from cable_lightning.eval.comparable import latest_rows
from cable_lightning.eval.intervals import seed_interval, separable, window_interval
from cable_lightning.eval.loss_curves import loss_curves
from cable_lightning.lit import CausalLM
from cable_lightning.models import BackboneConfig
from cable_lightning.records.io import find_records, read_records
from cable_lightning.records.schema import LengthRecord, LossPoint


def test_seed_interval_is_the_student_t_interval_by_hand():
    # mean 11.1667, sample sd sqrt(3.1667 / 2) = 1.2583, sem 1.2583 / sqrt(3) = 0.72648; t(0.975, df=2) = 4.30265
    e = seed_interval([10.0, 11.0, 12.5])
    assert (e.n, e.how) == (3, "t")
    assert e.mean == pytest.approx(11.16667, abs=1e-5)
    assert (e.low, e.high) == (pytest.approx(11.16667 - 4.30265 * 0.72648, abs=1e-4),
                               pytest.approx(11.16667 + 4.30265 * 0.72648, abs=1e-4))
    assert seed_interval([10.0]).low is None  # one seed: no interval over seeds


def test_paired_t_test_by_hand():
    # differences 0.1, 0.3, 0.2, 0.4: mean 0.25, sd 0.12910, t = 0.25 / (0.12910 / 2) = 3.873 with 3 df: p = 0.0305
    a, b = [1.0, 2.0, 3.0, 4.0], [1.1, 2.3, 3.2, 4.4]
    assert stats.ttest_rel(b, a).statistic == pytest.approx(3.873, abs=1e-3)
    assert 2 * stats.t.sf(3.873, 3) == pytest.approx(0.0305, abs=1e-4)
    assert separable(a, b)
    assert not separable(a, [1.1, 1.9, 3.2, 3.9])  # differences of either sign: within noise
    assert not separable(a, a) and separable(a, [x + 1 for x in a])


def test_one_seed_ratio_interval_pairs_windows_that_score_the_same_tokens():
    # two 4-token windows (mean NLL 2.0, 3.0) against four 2-token reference windows over the same 8 tokens: window
    # 0 goes with reference windows 0-1, window 1 with 2-3. A resample is windows (0, 0), (1, 1) or one of each: the
    # ratio exp(2.0 - 2.0), exp(3.0 - 2.8) or exp(2.5 - 2.4); the 2.5% and 97.5% percentiles are the extremes
    e = window_interval(([2.0, 3.0], [4, 4]), ([2.0, 2.0, 2.8, 2.8], [2, 2, 2, 2]))
    assert e.mean == pytest.approx(math.exp(0.1))
    assert (e.low, e.high) == (pytest.approx(1.0), pytest.approx(math.exp(0.2)))
    # the same reference windows in the other order pair differently: exp(2.0 - 2.8) and exp(3.0 - 2.0)
    e = window_interval(([2.0, 3.0], [4, 4]), ([2.8, 2.8, 2.0, 2.0], [2, 2, 2, 2]))
    assert (e.low, e.high) == (pytest.approx(math.exp(-0.8)), pytest.approx(math.exp(1.0)))


def test_one_seed_interval_narrows_with_more_windows(tiny_corpus_dir, tmp_path):
    widths = []
    for eval_tokens in (320, 5120):  # 10, then 160 windows of 32 tokens
        dm = TokenDataModule(tiny_corpus_dir, block_size=32, micro_batch_size=8, eval_lengths=[32],
                             eval_tokens=eval_tokens)
        torch.manual_seed(0)
        model = CausalLM(BackboneConfig(pos_encoding="cable", n_layer=1, n_head=2, n_embd=32), data=dm.describe())
        trainer = L.Trainer(accelerator="cpu", logger=False, enable_progress_bar=False, enable_model_summary=False,
                            default_root_dir=str(tmp_path / str(eval_tokens)),
                            callbacks=[LengthEvalRecorder(print_table=False, figure=False)])
        trainer.validate(model, datamodule=dm, verbose=False)
        [row] = read_records(str(tmp_path / str(eval_tokens) / LengthRecord.FILE), LengthRecord)
        assert len(row.window_nll) == eval_tokens // 32 and sum(row.window_tokens) == row.tokens
        # the windows reproduce the recorded perplexity (their NLLs are kept to 4 decimals)
        mean_nll = sum(n * t for n, t in zip(row.window_nll, row.window_tokens)) / row.tokens
        assert math.exp(mean_nll) == pytest.approx(row.ppl, rel=1e-4)
        e = window_interval((row.window_nll, row.window_tokens))
        assert e.how == "bootstrap" and e.low < row.ppl < e.high
        widths.append(e.high - e.low)
    assert widths[1] < widths[0] / 2  # 16 times the windows: about a quarter of the width


def sweep_args(data, runs, seeds):
    """The sweep's run commands for CABLE at the given seeds, with the tiny model and data of test_cli."""
    drop = {"--runs_dir", "--experiment", "--seed_everything", "--model.init_args.backbone.pos_encoding"}
    tiny = tiny_args(data, runs, steps=4, every=2)
    extra = [a for i, a in enumerate(tiny) if a not in drop and (i == 0 or tiny[i - 1] not in drop)]
    namespace = type("Args", (), dict(config=[], pes=["cable"], seeds=seeds, train_lengths=None, lrs=None,
                                      experiment="seeds", runs_dir=runs, extra=extra, stage="fit"))
    return [cmd[3:] for _, cmd in sweep.commands(namespace)]  # after python -m cable_lightning


@pytest.fixture(scope="module")
def two_seeds(tiny_corpus_dir, tmp_path_factory):
    """Seeds 0 and 1 of CABLE through the sweep's commands; seed 1 is interrupted at step 2 and run again."""
    runs = str(tmp_path_factory.mktemp("seeds"))
    seed0, seed1 = sweep_args(tiny_corpus_dir, runs, [0, 1])
    main(seed0)
    stopped = main(seed1 + ["--trainer.callbacks+=recorders.StopAt", "--trainer.callbacks.step=2"])
    resumed = main(seed1)  # the sweep run again: --ckpt_path auto continues it
    return runs, stopped.trainer.global_step, resumed


def test_two_seeds_are_two_run_folders_and_both_reach_the_report(two_seeds, tmp_path):
    runs, _, _ = two_seeds
    for seed in (0, 1):
        folder = os.path.join(runs, "seeds", "cable", f"seed{seed}")
        assert os.path.exists(os.path.join(folder, "checkpoints", "last.ckpt"))
        records = [r for path in sorted(os.listdir(folder)) if path.startswith("version_")
                   for r in read_records(os.path.join(folder, path, LengthRecord.FILE), LengthRecord)]
        assert records and {r.run_seed for r in records} == {seed}
    tables = report.report([os.path.join(runs, "seeds")], str(tmp_path / "r"))
    assert "mean over n=2 seeds [95% Student-t interval]" in tables["nonoverlap"]
    with open(tmp_path / "r_nonoverlap.csv") as f:
        lines = [row for row in csv.DictReader(f) if row["length"] == "64"]
    assert sorted(row["seed"] for row in lines) == ["0", "1"]
    ppls = [float(row["ppl"]) for row in lines]
    assert ppls[0] != ppls[1]  # the seeds trained different weights
    assert float(lines[0]["mean"]) == pytest.approx(sum(ppls) / 2)
    assert (tmp_path / "r_nonoverlap_training.png").stat().st_size > 1000  # evaluated at steps 2 and 4
    assert "position" in tables


def test_the_retrieval_stage_records_each_seeds_export_and_the_report_gives_an_interval(two_seeds, tiny_corpus_docs,
                                                                                      tiny_corpus_dir, tmp_path):
    """--stage retrieval: per seed folder, export its last checkpoint, fine-tune (its loss curve kept), evaluate
    (rows recorded as that seed's run); the report aggregates the seeds. Run in this process (the commands' argv)."""
    pytest.importorskip("sentence_transformers")  # the hf extra
    from cable_lightning.data import retrieval_set
    from cable_lightning.hf import retrieval
    from cable_lightning.hf.export import main as export
    from cable_lightning.records.schema import RetrievalRecord

    runs, _, _ = two_seeds
    retrieval_set.main(["--source", tiny_corpus_docs[0], "--tokenizer", os.path.join(tiny_corpus_dir, "tokenizer.json"),
                        "--out", str(tmp_path / "set"), "--doc_tokens", "256", "--queries", "8",
                        "--train_pairs", "16"])
    cmds = [cmd for _, cmd in sweep.commands(argparse.Namespace(
        config=["c.yaml"], pes=["cable"], seeds=[0, 1], train_lengths=None, lrs=None, experiment="seeds", runs_dir=runs,
        extra=[], stage="retrieval", retrieval_set=str(tmp_path / "set"), retrieval_lengths=[32, 256],
        finetune_steps=2, finetune_batch=4, finetune_lr=1e-4, finetune_mini_batch=None))]
    assert [cmd[1:5] for cmd in cmds] == [["-m", "cable_lightning", "export", "--ckpt_path"],
                                          ["-m", "cable_lightning", "retrieval", "finetune"],
                                          ["-m", "cable_lightning", "retrieval", "evaluate"]] * 2
    assert cmds[1][cmds[1].index("--lr") + 1] == "0.0001"
    for cmd in cmds:
        export(cmd[4:]) if cmd[3] == "export" else retrieval.main(cmd[4:])
    rows = []
    for seed in (0, 1):
        folder = os.path.join(runs, "seeds", "cable", f"seed{seed}")
        rows += read_records(os.path.join(folder, RetrievalRecord.FILE), RetrievalRecord)
        assert open(os.path.join(folder, "export-tuned", LossPoint.FILE)).read().count("loss") >= 1
    assert sorted((r.run_seed, r.length) for r in rows) == [(0, 32), (0, 256), (1, 32), (1, 256)]
    assert all(r.pe == "cable" and r.train_length == 32 and r.step == 4 and r.queries == 8 for r in rows)
    visible = {r.length: r.visible for r in rows}
    assert visible[256] == 1.0 and visible[32] < 0.5  # 256-token documents: whole at 256, mostly hidden at 32
    tables = report.report([os.path.join(runs, "seeds")], str(tmp_path / "r"))
    assert "mean over n=2 seeds [95% Student-t interval]" in tables["retrieval set"]
    assert (tmp_path / "r_retrieval_set.png").exists()
    curves = loss_curves([os.path.join(runs, "seeds")])
    contrastive = [[json.loads(line)["loss"] for line in open(os.path.join(runs, "seeds", "cable", f"seed{seed}",
                                                                            "export-tuned", LossPoint.FILE))]
                   for seed in (0, 1)]
    assert [sorted(v) for v in curves["contrastive loss"]["cable"].values()] == [sorted(pair) for pair in
                                                                                 zip(*contrastive)]
    pretraining = curves["pre-training loss"]["cable"]  # seed 1 was stopped at step 2 and resumed: still one curve
    assert sorted(pretraining) == list(range(4)) and all(len(v) == 2 and min(v) > 0 for v in pretraining.values())
    assert (tmp_path / "r_loss_curves.png").exists()


def test_an_interrupted_seed_resumes_in_its_own_folder(two_seeds):
    runs, stopped_at, resumed = two_seeds
    assert stopped_at == 2 and resumed.trainer.global_step == 4
    assert resumed.trainer.ckpt_path.endswith(os.path.join("seeds", "cable", "seed1", "checkpoints", "last.ckpt"))
    assert not os.path.exists(os.path.join(runs, "seeds", "cable", "checkpoints"))


def test_a_validation_of_a_seeds_checkpoint_is_recorded_as_that_seed(two_seeds, tiny_corpus_dir, tmp_path):
    runs, _, _ = two_seeds
    ckpt = os.path.join(runs, "seeds", "cable", "seed1", "checkpoints", "last.ckpt")
    cli = main(["validate", *tiny_args(tiny_corpus_dir, str(tmp_path)), "--ckpt_path", ckpt])  # seed_everything 7
    assert {r.run_seed for r in cli.model.length_results} == {1}


def test_ratio_table_from_a_real_fit(two_seeds):
    runs, _, _ = two_seeds
    latest = latest_rows(find_records([os.path.join(runs, "seeds")]))
    by_seed = {(r.run_seed, r.length): r.ppl for r in latest if r.mode == "nonoverlap"}
    ratios = [by_seed[seed, 64] / by_seed[seed, 32] for seed in (0, 1)]
    columns, table = report.ratio_table(latest, "nonoverlap")
    assert columns == ["cable"] and [row[0] for row in table] == [64]  # the training length's row is 1 by definition
    cell = table[0][1]
    assert sorted(cell.values.values()) == pytest.approx(sorted(ratios))
    assert cell.estimate() == seed_interval([cell.values[0], cell.values[1]])


def test_folder_per_seed_needs_a_seed(tiny_corpus_dir, tmp_path):
    with pytest.raises(ValueError, match="folder_per_seed true names the run folder by the seed, but seed_everything "
                                         "is False") as err:
        main(["fit", *tiny_args(tiny_corpus_dir, str(tmp_path)), "--folder_per_seed", "true",
              "--seed_everything", "false"])
    assert "\n" not in str(err.value)


