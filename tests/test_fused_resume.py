"""A run resumed from a checkpoint written with the non-fused AdamW (an older run, or fp16's grad scaler) steps with the
fused one it configures: torch's loader takes every param_group setting from the checkpoint, ``fused`` included."""

import os

import torch
from conftest import args

import cable_lightning.lit.modules as modules
from cable_lightning.cli import main
from cable_lightning.lit.optim import build_optimizer

QUIET = ["--diagnostics.enabled", "false", "--length_eval.figure", "false"]


def test_a_checkpoint_written_unfused_resumes_fused(tiny_corpus_dir, tmp_path, monkeypatch):
    runs = str(tmp_path)
    with monkeypatch.context() as unfused:
        unfused.setattr(modules, "build_optimizer", lambda *a, **kw: build_optimizer(*a, **{**kw, "fused": False}))
        main(["fit", *args(tiny_corpus_dir, runs, steps=2, every=2), *QUIET])
    last = os.path.join(runs, "test", "cable", "checkpoints", "last.ckpt")
    written = torch.load(last, weights_only=True)["optimizer_states"][0]["param_groups"]
    assert [group["fused"] for group in written] == [False, False]

    steps = []
    fused_step = torch._fused_adamw_
    monkeypatch.setattr(torch, "_fused_adamw_", lambda *a, **kw: steps.append(1) or fused_step(*a, **kw))
    resumed = main(["fit", *args(tiny_corpus_dir, runs, steps=4, every=2), *QUIET, "--ckpt_path", "last"])
    assert resumed.trainer.global_step == 4
    assert [group["fused"] for group in resumed.trainer.optimizers[0].param_groups] == [True, True]
    assert len(steps) == 2 * 2  # the fused kernel, once per parameter group in each resumed step
