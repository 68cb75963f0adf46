"""The sharded recipe (configs/trainer/fsdp8_bf16.yaml: FSDP2 through Lightning's ModelParallelStrategy, bf16 through
FSDP2's mixed-precision policy), and plain DDP, as real two-process fits on CPU over gloo: a run resumed from inside
its first epoch has the losses of one that was not, bitwise, through the whole second epoch; the sharded checkpoint
validates and exports in one process."""

import json

import pytest
import torch
from conftest import MODEL, QUIET
from conftest import two_process_data as data
from conftest import two_process_fit as fit

from cable_lightning.cli import main
from cable_lightning.errors import ConfigError
from cable_lightning.hf import load_backbone
from cable_lightning.hf.export import main as export
from cable_lightning.lit.checkpoint_format import checkpoint_backbone


def resumed_equals_uninterrupted(runs, losses, strategy, data_path):
    """An uninterrupted 12-step run, and one resumed from its step-3 checkpoint (what a run stopped there leaves),
    which replays steps 4 to 12: the first epoch's last three, the whole second epoch."""
    whole = fit(runs, losses / "whole", strategy, *data(data_path))
    step3 = runs / "default" / "cable" / "checkpoints" / "step0000003.ckpt"
    resumed = fit(runs, losses / "resumed", strategy, *data(data_path), "--ckpt_path", str(step3))
    assert [(r["step"], r["epoch"]) for r in whole] == [(step, (step - 1) // 6) for step in range(1, 13)]
    assert [r["step"] for r in resumed] == list(range(4, 13))
    # Weights, optimizer state, schedule and the data stream's position all come back: the same losses, bitwise.
    assert [r["loss"] for r in resumed] == [r["loss"] for r in whole[3:]]


def windows(folder, rank=None) -> list[dict]:
    """The micro-batches ddp_probe.Windows recorded (every rank's, or one rank's)."""
    files = sorted(folder.glob("windows_rank*.jsonl")) if rank is None else [folder / f"windows_rank{rank}.jsonl"]
    return [row for f in files for row in map(json.loads, open(f)) if "step" in row]  # not the placement line


def test_ddp_two_processes_resumed_inside_the_first_epoch_equal_uninterrupted(small_corpus_dir, tmp_path, capsys):
    resumed_equals_uninterrupted(tmp_path / "runs", tmp_path, "ddp", small_corpus_dir)
    # Resumed on one process the global batch would halve: refused, naming the setting that keeps it; with it, the
    # accumulation doubles and the stream goes on with the epoch's unseen windows.
    step3 = tmp_path / "runs" / "default" / "cable" / "checkpoints" / "step0000003.ckpt"
    one = ["fit", *MODEL, *data(small_corpus_dir), "--trainer.accelerator", "cpu", "--trainer.devices", "1",
           "--trainer.max_steps", "12", "--checkpoint.every_n_train_steps", "3", *QUIET,
           "--trainer.enable_progress_bar", "false", "--runs_dir", str(tmp_path / "runs"), "--seed_everything", "5",
           "--trainer.callbacks+=ddp_probe.Windows", f"--trainer.callbacks.out_dir={tmp_path / 'alone'}",
           "--ckpt_path", str(step3)]
    refused = (r"global batch of 2048 tokens \(2 processes x 8 x 128 tokens x accumulation 1\) and this run's is 1024 "
               r"tokens .*; resume with --global_batch_tokens 2048")
    with pytest.raises(ConfigError, match=refused):
        main(one)
    saved = step3.read_bytes()
    alone = main([*one, "--global_batch_tokens", "2048"])
    assert alone.trainer.global_step == 12 and alone.trainer.accumulate_grad_batches == 2
    assert ("resuming step 3 of a run trained with 2048 tokens (2 processes x 8 x 128 tokens x accumulation 1) as "
            "2048 tokens (1 process x 8 x 128 tokens x accumulation 2): the same global batch, every step a whole "
            "one") in capsys.readouterr().out
    assert step3.read_bytes() == saved
    # Step 3 was odd: the first resumed step still accumulates two micro-batches (it took one, then every step was a
    # micro-batch behind), every step is a whole global batch, and the epoch ends at the uninterrupted run's step.
    whole, read = windows(tmp_path / "whole"), windows(tmp_path / "alone", rank=0)
    steps = [r["step"] for r in read]
    assert steps == [step for step in range(4, 13) for _ in range(2)]
    epoch_of = {r["step"]: r["epoch"] for r in whole}
    assert all(r["epoch"] == epoch_of[r["step"]] for r in read)
    # The first epoch's windows: what both ranks read in steps 1-3, then exactly the rest, each once.
    first_epoch = [row for r in whole if r["epoch"] == 0 for row in r["windows"]]
    before = [row for r in whole if r["step"] <= 3 for row in r["windows"]]
    after = [row for r in read if r["epoch"] == 0 for row in r["windows"]]
    assert len(set(first_epoch)) == len(first_epoch) == 96
    assert sorted(before + after) == sorted(first_epoch)
    # From an even step (the epoch's last), the resumed run's first micro-batch is still at that step: it used to save
    # step 6 again there, one micro-batch on and that micro-batch's gradient gone.
    step6 = step3.with_name("step0000006.ckpt")
    saved = step6.read_bytes()
    again = main([*one[:one.index("--trainer.callbacks+=ddp_probe.Windows")], "--trainer.max_steps", "7",
                  "--global_batch_tokens", "2048", "--ckpt_path", str(step6)])
    assert again.trainer.global_step == 7 and step6.read_bytes() == saved, "the resumed run saved step 6 again"


def test_fsdp2_two_processes_resumed_inside_the_first_epoch_equal_uninterrupted_and_the_checkpoint_exports(
        small_corpus_dir, tmp_path):
    resumed_equals_uninterrupted(tmp_path / "runs", tmp_path, "fsdp2", small_corpus_dir)

    # The checkpoint is the ordinary single file, full weights: one process validates it at 4x and exports it.
    ckpt = tmp_path / "runs" / "default" / "cable" / "checkpoints" / "last.ckpt"
    state = torch.load(ckpt, map_location="cpu", weights_only=True)
    assert state["global_step"] == 12 and state["state_dict"]["backbone.wte.weight"].shape[1] == 32
    record = [json.loads(line) for line in open(tmp_path / "runs" / "default" / "cable" / "version_1"
                                                / "length_eval.jsonl")][-1]
    alone = main(["validate", *MODEL, *data(small_corpus_dir)[:-4], "--data.eval_lengths", "[32, 512]",
                  "--data.eval_tokens", "128", "--trainer.accelerator", "cpu", "--trainer.devices", "1",
                  "--trainer.precision", "bf16-mixed", "--trainer.enable_progress_bar", "false",
                  "--runs_dir", str(tmp_path / "runs"), "--ckpt_path", "last"])
    rows = {r.length: r for r in alone.model.length_results}
    assert rows[32].loss == pytest.approx(record["loss"], abs=2e-2), "one process scores the trained weights"
    assert torch.isfinite(torch.tensor(rows[512].loss)) and rows[512].tokens == 512
    out = tmp_path / "hf"
    export(["--ckpt_path", str(ckpt), "--out", str(out)])
    trained, _, _ = checkpoint_backbone(str(ckpt))
    exported = load_backbone(str(out))
    assert all(torch.equal(v, exported.state_dict()[k]) for k, v in trained.state_dict().items())
