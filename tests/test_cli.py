"""The CLI end to end on the tiny prepared corpus: fit, resume, validate longer, errors."""

import glob
import json
import os
import shutil

import pytest
import recorders
import torch
from conftest import args

from cable_lightning.cli import main


@pytest.fixture(scope="module")
def trained(tiny_corpus_dir, tmp_path_factory):
    """One short CABLE run shared by the validate tests."""
    runs = str(tmp_path_factory.mktemp("runs"))
    main(["fit", *args(tiny_corpus_dir, runs)])
    return runs


@pytest.mark.parametrize("model,pe", [("CausalLM", "cable"), ("CausalLM", "rope"), ("MaskedLM", "alibi"),
                                      ("CausalLM", "learnable")])
def test_fit_writes_checkpoints_tensorboard_and_length_records(tiny_corpus_dir, tmp_path, model, pe):
    cli = main(["fit", *args(tiny_corpus_dir, str(tmp_path), pe=pe, model=model)])
    run = tmp_path / "test" / pe
    assert (run / "checkpoints" / "last.ckpt").exists()
    assert (run / "checkpoints" / "step0000002.ckpt").exists()
    assert glob.glob(str(run / "version_0" / "events.out.tfevents.*"))
    assert cli.trainer.global_step == 4
    rows = [json.loads(line) for line in open(run / "version_0" / "length_eval.jsonl")]
    final = {r["length"]: r for r in rows if r["step"] == 4}
    assert set(final) == {32, 64} and all(r["pe"] == pe for r in rows)
    if pe == "learnable":  # a 32-position table cannot serve 64 tokens: recorded, not a crash
        assert final[64]["ppl"] is None and final[32]["ppl"] > 1
    else:
        assert all(r["ppl"] > 1 and r["tokens"] > 0 for r in final.values())
    if model == "MaskedLM":  # the validation stream's masking is fixed by position: each length scores the same tokens
        assert final[32]["tokens"] == final[64]["tokens"]


def test_resume_continues_with_the_same_batches_and_loss_across_epochs(small_corpus_dir, tmp_path):
    """An epoch is 6 steps here. Resumed from step 4 (mid-epoch; what a run stopped there leaves) a run sees the
    uninterrupted run's batches and losses, bitwise, through the whole second epoch and into the third; so does one
    resumed from step 12, the last of an epoch. (Checkpoints every 4 steps: none at an epoch's end while the resumed
    epoch runs.)"""
    record = ["--trainer.callbacks+=recorders.RecordBatches", "--data.block_size", "128",
              "--data.micro_batch_size", "16", "--data.eval_lengths", "[32]", "--diagnostics.enabled", "false",
              "--length_eval.figure", "false"]
    fit = lambda folder, *extra: main(["fit", *args(small_corpus_dir, str(tmp_path / folder), steps=14,  # noqa: E731
                                                     every=4, extra=[*record, *extra])])
    recorders.BATCHES.clear(), recorders.LOSSES.clear()
    straight = fit("straight")
    assert straight.trainer.num_training_batches == 6, "an epoch is 6 steps"
    straight_batches, straight_losses = list(recorders.BATCHES), list(recorders.LOSSES)
    for step in (4, 12):
        recorders.BATCHES.clear(), recorders.LOSSES.clear()
        ckpt = tmp_path / "straight" / "test" / "cable" / "checkpoints" / f"step{step:07d}.ckpt"
        resumed = fit(f"from{step}", "--ckpt_path", str(ckpt))
        assert resumed.trainer.global_step == 14
        assert recorders.BATCHES == straight_batches[step:] and recorders.LOSSES == straight_losses[step:]
        for (name, p), q in zip(straight.model.named_parameters(), resumed.model.parameters()):
            torch.testing.assert_close(p, q, atol=0, rtol=0, msg=name)


def test_validate_at_longer_lengths_than_trained(tiny_corpus_dir, trained):
    ckpt = os.path.join(trained, "test", "cable", "checkpoints", "last.ckpt")
    cli = main(["validate", *args(tiny_corpus_dir, trained), "--data.eval_lengths", "[32, 256]",
                "--data.eval_stride", "16", "--ckpt_path", ckpt])
    metrics = cli.trainer.callback_metrics
    assert {"val_ppl/len_32", "val_ppl/len_256", "val_ppl_sliding/len_256"} <= set(metrics)
    assert all(torch.isfinite(metrics[k]) for k in ("val_ppl/len_256", "val_ppl_sliding/len_256"))


def test_checkpoint_and_data_with_different_tokenizers_is_an_error(tiny_corpus_dir, trained, tmp_path):
    other = tmp_path / "other-data"
    shutil.copytree(tiny_corpus_dir, other)
    manifest = json.loads((other / "manifest.json").read_text())
    manifest["tokenizer"]["identity"]["hash"] = "0" * 64  # as if prepared with another tokenizer of the same size
    (other / "manifest.json").write_text(json.dumps(manifest))
    ckpt = os.path.join(trained, "test", "cable", "checkpoints", "last.ckpt")
    with pytest.raises(ValueError, match="checkpoint was trained with tokenizer") as err:
        main(["validate", *args(str(other), trained), "--ckpt_path", ckpt])
    assert "\n" not in str(err.value)


def test_global_batch_tokens_sets_accumulation_or_names_the_divisor(tiny_corpus_dir, tmp_path):
    cli = main(["fit", *args(tiny_corpus_dir, str(tmp_path), steps=1, every=1), "--global_batch_tokens", "384"])
    assert cli.trainer.accumulate_grad_batches == 3  # 384 / (4 x 32 x 1)
    with pytest.raises(ValueError, match=r"global_batch_tokens=1000 is not a multiple of .* = 128"):
        main(["fit", *args(tiny_corpus_dir, str(tmp_path), steps=1), "--global_batch_tokens", "1000"])


def test_a_bf16_fit_on_a_cpu_whose_bf16_matmul_is_slow_is_told_so(tiny_corpus_dir, tmp_path, monkeypatch):
    from cable_lightning import hardware

    monkeypatch.setattr(hardware, "cpu_bf16_slowdown", lambda: 40.0)
    with pytest.warns(UserWarning, match=r"precision bf16-mixed on this CPU .* takes 40x an fp32 one"):
        main(["fit", *args(tiny_corpus_dir, str(tmp_path), steps=1, every=1), "--trainer.precision", "bf16-mixed"])


def test_global_batch_counts_the_built_trainers_world_size(monkeypatch):
    """Accumulation and the validation interval come from the Trainer Lightning built, whatever the spelling of
    devices: an int, a digit string, a list, "0,1" on a node with more GPUs visible, times num_nodes."""
    import lightning as L

    from cable_lightning.run_setup import apply_global_batch

    def accumulation(**trainer_args):
        trainer = L.Trainer(logger=False, enable_checkpointing=False, strategy="ddp", **trainer_args)
        apply_global_batch(trainer, 4096 * 24, micro_batch=4, block_size=1024, validate_every_n_steps=10)
        assert trainer.val_check_interval == 10 * trainer.accumulate_grad_batches
        return trainer.accumulate_grad_batches

    assert accumulation(accelerator="cpu", devices=2) == 12
    assert accumulation(accelerator="cpu", devices="3") == 8
    assert accumulation(accelerator="cpu", devices=2, num_nodes=2) == 6
    monkeypatch.setattr("lightning.fabric.accelerators.cuda.num_cuda_devices", lambda: 8)
    monkeypatch.setattr("lightning.pytorch.accelerators.cuda.CUDAAccelerator.is_available", staticmethod(lambda: True))
    monkeypatch.setattr("torch.cuda.is_available", lambda: True)
    assert accumulation(accelerator="gpu", devices="0,1") == 12  # 2 of the 8 visible GPUs
    assert accumulation(accelerator="gpu", devices=[2, 5, 7]) == 8
    assert accumulation(accelerator="gpu", devices="0,1", num_nodes=3) == 4
