"""The sharded recipe (configs/trainer/fsdp8_bf16.yaml: FSDP2 through Lightning's ModelParallelStrategy, bf16 through
FSDP2's mixed-precision policy) as a real two-process fit on CPU over gloo: a run stopped and resumed has the losses
of one that was not, and its checkpoint validates and exports in one process."""

import json
import os
import subprocess
import sys

import pytest
import torch

from cable_lightning.cli import main
from cable_lightning.hf import load_backbone
from cable_lightning.hf.export import main as export
from cable_lightning.lit.checkpoint_format import checkpoint_backbone

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
MODEL = ["--model", "cable_lightning.lit.CausalLM", "--model.init_args.backbone.pos_encoding", "cable",
         "--model.init_args.backbone.n_layer", "2", "--model.init_args.backbone.n_head", "2",
         "--model.init_args.backbone.n_embd", "32", "--model.init_args.warmup_steps", "2"]


def data(path):
    return ["--data.path", path, "--data.block_size", "32", "--data.micro_batch_size", "2",
            "--data.eval_lengths", "[32]", "--data.eval_tokens", "128"]


def fit(runs, losses, *extra):
    cmd = [sys.executable, "-m", "cable_lightning", "fit", "--config", f"{ROOT}/configs/trainer/fsdp8_bf16.yaml",
           "--trainer.accelerator", "cpu", "--trainer.devices", "2", *MODEL, *extra,
           "--trainer.max_steps", "4", "--checkpoint.every_n_train_steps", "2", "--trainer.num_sanity_val_steps", "0",
           "--trainer.enable_progress_bar", "false", "--trainer.enable_model_summary", "false",
           "--trainer.callbacks+=ddp_probe.Losses", f"--trainer.callbacks.out_dir={losses}",
           "--runs_dir", str(runs), "--seed_everything", "5"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([HERE, os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1"}
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return [json.loads(line) for line in open(losses / "losses.jsonl")]


def test_fsdp2_two_processes_resume_equals_uninterrupted_and_the_checkpoint_validates_and_exports(
        tiny_corpus_dir, tmp_path):
    whole = fit(tmp_path / "runs", tmp_path / "whole", *data(tiny_corpus_dir))
    # The checkpoint written at step 2 is what a run stopped there leaves; resuming from it replays steps 3 and 4.
    step2 = tmp_path / "runs" / "default" / "cable" / "checkpoints" / "step0000002.ckpt"
    resumed = fit(tmp_path / "runs", tmp_path / "resumed", *data(tiny_corpus_dir), "--ckpt_path", str(step2))
    assert [r["step"] for r in whole] == [1, 2, 3, 4] and [r["step"] for r in resumed] == [3, 4]
    # Weights, optimizer state, schedule and the data stream's position all come back: the same losses.
    assert [r["loss"] for r in resumed] == pytest.approx([r["loss"] for r in whole[2:]], rel=1e-6, abs=0)

    # The checkpoint is the ordinary single file, full weights: one process validates it at 4x and exports it.
    ckpt = tmp_path / "runs" / "default" / "cable" / "checkpoints" / "last.ckpt"
    state = torch.load(ckpt, map_location="cpu", weights_only=True)
    assert state["global_step"] == 4 and state["state_dict"]["backbone.wte.weight"].shape[1] == 32
    record = [json.loads(line) for line in open(tmp_path / "runs" / "default" / "cable" / "version_1"
                                                / "length_eval.jsonl")][-1]
    alone = main(["validate", *MODEL, *data(tiny_corpus_dir)[:-4], "--data.eval_lengths", "[32, 128]",
                  "--data.eval_tokens", "128", "--trainer.accelerator", "cpu", "--trainer.devices", "1",
                  "--trainer.precision", "bf16-mixed", "--trainer.enable_progress_bar", "false",
                  "--runs_dir", str(tmp_path / "runs"), "--ckpt_path", "last"])
    rows = {r.length: r for r in alone.model.length_results}
    assert rows[32].loss == pytest.approx(record["loss"], abs=2e-2), "one process scores the trained weights"
    assert torch.isfinite(torch.tensor(rows[128].loss)) and rows[128].tokens == 128
    out = tmp_path / "hf"
    export(["--ckpt_path", str(ckpt), "--out", str(out)])
    trained, _, _ = checkpoint_backbone(str(ckpt))
    exported = load_backbone(str(out))
    assert all(torch.equal(v, exported.state_dict()[k]) for k, v in trained.state_dict().items())
