"""Length evaluation (callbacks/length_eval.py, lit/length_eval.py): perplexity against a by-hand computation, the
recorder's rows and figure, and the report of two real runs."""

import glob
import json
import math
import os

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from cable_lightning.callbacks import LengthEvalRecorder
from cable_lightning.cli import main
from cable_lightning.data.datamodule import TokenDataModule
from cable_lightning.eval import report
from cable_lightning.lit import CausalLM
from cable_lightning.models import BackboneConfig


def tiny_model(dm, pe="cable"):
    torch.manual_seed(0)
    backbone = BackboneConfig(pos_encoding=pe, n_layer=2, n_head=2, n_embd=32)
    return CausalLM(backbone, data=dm.describe())


def test_validation_perplexity_is_exp_of_mean_token_nll_by_hand(tiny_corpus_dir, tmp_path):
    dm = TokenDataModule(tiny_corpus_dir, block_size=32, micro_batch_size=3, eval_lengths=[32, 96], eval_tokens=500,
                         eval_stride=16)
    model = tiny_model(dm)
    trainer = L.Trainer(accelerator="cpu", logger=False, enable_progress_bar=False, enable_model_summary=False,
                        default_root_dir=str(tmp_path), callbacks=[LengthEvalRecorder(print_table=False, figure=False)])
    trainer.validate(model, datamodule=dm, verbose=False)
    stream = dm.eval_stream("val")
    backbone = model.backbone.eval()
    for length in (32, 96):
        # Non-overlapping: windows side by side over the first 500 targets (the last one may reach back).
        nll, count, last = 0.0, 0, 0
        with torch.no_grad():
            while last < 500:
                end = min(last + length, 500)
                start = end - length
                logits = backbone(stream[start:end][None])
                per_token = F.cross_entropy(logits[0], stream[start + 1 : end + 1], reduction="none")
                scored = per_token[last - start :]
                nll, count, last = nll + scored.sum().item(), count + len(scored), end
        assert count == 500
        logged = trainer.callback_metrics[f"val_ppl/len_{length}"].item()
        assert logged == pytest.approx(math.exp(nll / count), rel=1e-4)
    # Sliding windows score the same tokens with more context: a different, finite number.
    sliding = trainer.callback_metrics["val_ppl_sliding/len_96"].item()
    assert math.isfinite(sliding) and sliding != pytest.approx(trainer.callback_metrics["val_ppl/len_96"].item(),
                                                               rel=1e-6)
    rows = [json.loads(line) for line in open(os.path.join(str(tmp_path), "length_eval.jsonl"))]
    assert {(r["length"], r["mode"]) for r in rows} == {(32, "nonoverlap"), (96, "nonoverlap"), (32, "sliding"),
                                                         (96, "sliding")}
    assert all(r["tokens"] == 500 for r in rows)


def cli_args(data, runs, pe):
    return ["fit", "--model", "cable_lightning.lit.CausalLM", "--model.init_args.backbone.pos_encoding", pe,
            "--model.init_args.backbone.n_layer", "1", "--model.init_args.backbone.n_head", "2",
            "--model.init_args.backbone.n_embd", "32", "--model.init_args.warmup_steps", "1",
            "--data.path", data, "--data.block_size", "32", "--data.micro_batch_size", "4",
            "--data.eval_lengths", "[32, 64]", "--data.eval_tokens", "128", "--trainer.accelerator", "cpu",
            "--trainer.max_steps", "2", "--trainer.log_every_n_steps", "1", "--trainer.enable_progress_bar", "false",
            "--trainer.num_sanity_val_steps", "0",
            "--trainer.enable_model_summary", "false", "--checkpoint.every_n_train_steps", "2",
            "--runs_dir", runs, "--experiment", "pair"]


@pytest.fixture(scope="module")
def two_runs(tiny_corpus_dir, tmp_path_factory):
    runs = str(tmp_path_factory.mktemp("two_runs"))
    for pe in ("alibi", "learnable"):
        main(cli_args(tiny_corpus_dir, runs, pe))
    return runs


def test_recorder_writes_jsonl_rows_and_tensorboard_scalars_and_figure(two_runs):
    run = os.path.join(two_runs, "pair", "alibi", "version_0")
    rows = [json.loads(line) for line in open(os.path.join(run, "length_eval.jsonl"))]
    assert {"step", "length", "mode", "ppl", "loss", "tokens", "seconds", "tokens_per_sec"} <= set(rows[0])
    assert glob.glob(os.path.join(run, "events.out.tfevents.*"))
    events = EventAccumulator(run, size_guidance={"images": 0})  # every event file of the run
    events.Reload()
    scalars = events.Tags()["scalars"]
    assert "val_ppl/len_64" in scalars and "train/loss" in scalars
    logged = events.Scalars("val_ppl/len_64")[-1].value
    assert logged == pytest.approx([r["ppl"] for r in rows if r["length"] == 64][-1], rel=1e-5)
    assert {"val_ppl_vs_length", "bias/last_layer"} <= set(events.Tags()["images"])


def test_report_table_marks_best_and_dashes_unsupported(two_runs, tmp_path):
    tables = report.report([os.path.join(two_runs, "pair")], str(tmp_path / "pair"))
    table = tables["nonoverlap"]
    lines = table.splitlines()
    assert lines[0] == "| length | alibi | learnable |"
    row32, row64 = lines[2], lines[3]
    assert row64.startswith("| 64 |") and row64.endswith("| - |")  # learnable cannot serve 64 tokens
    assert row64.count("**") == 2  # alibi, the only value, is the best
    # two 2-step models (ppl near the vocabulary size): one seed each, so a bootstrap interval over the 4
    # (32) or 2 (64) windows, and a paired test over the same windows that cannot tell them apart: both bold
    assert row32.count("**") == 4 and row32.count("[") == 2
    assert "one seed [95% percentile bootstrap over its n=2/4 evaluated windows]" in table
    assert (tmp_path / "pair_nonoverlap.png").stat().st_size > 1000
    csv_lines = (tmp_path / "pair_nonoverlap.csv").read_text().splitlines()
    assert csv_lines[0] == "length,encoding,seed,ppl,mean,low,high,n,interval"
    last = dict(zip(csv_lines[0].split(","), csv_lines[-1].split(",")))
    assert (last["length"], last["encoding"], last["ppl"]) == ("64", "learnable", "")  # no value where unsupported


