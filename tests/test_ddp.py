"""DDP through the CLI: two CPU processes (gloo) train a few steps; the step equals one process's
step on the union of both ranks' batches."""

import json
import os
import subprocess
import sys

import pytest
import torch

from cable_lightning import cli
from cable_lightning.cli import main
from cable_lightning.data.datamodule import TokenDataModule
from cable_lightning.data.remote import Store
from cable_lightning.lit import CausalLM
from cable_lightning.lit.optim import build_optimizer
from cable_lightning.models import BackboneConfig

HERE = os.path.dirname(os.path.abspath(__file__))
SHAPE = dict(pos_encoding="cable", n_layer=2, n_head=2, n_embd=32)


def test_a_run_that_finishes_destroys_its_process_group_and_one_that_fails_leaves_it(monkeypatch, tmp_path):
    """Left to interpreter shutdown, Gloo's worker threads aborted a rank of the two-process test after its fit had
    finished (SIGABRT, "terminate called without an active exception"); the entry point now destroys the group after a
    run that finished, and not after an error (another rank may still wait in a collective)."""
    dist = torch.distributed

    def run_in_group(fail):
        def verb(args):
            dist.init_process_group("gloo", init_method=f"file://{tmp_path / f'store{fail}'}", rank=0, world_size=1)
            if fail:
                raise cli.ConfigError("--data.path nowhere: no such dataset")
        monkeypatch.setattr(cli, "main", verb)
        cli.run([])

    run_in_group(fail=False)
    assert not dist.is_initialized()
    with pytest.raises(SystemExit):
        run_in_group(fail=True)
    try:
        assert dist.is_initialized()
    finally:
        dist.destroy_process_group()


def test_two_process_ddp_matches_one_process_on_the_union(tiny_corpus_dir, tiny_corpus_docs, s3_url, tmp_path):
    """The data is not prepared when the run starts, and it lives in an S3-compatible store (a real server on
    127.0.0.1): both ranks ask to prepare it (data.source + data.tokenizer), one does while the other waits on the
    store's lock, then both stream their shares from the store, each node caching them in data.cache_dir."""
    out, data, cache = tmp_path / "probe", s3_url, tmp_path / "cache"
    cmd = [
        sys.executable, "-m", "cable_lightning", "fit",
        "--model", "cable_lightning.lit.CausalLM",
        *[arg for k, v in SHAPE.items() for arg in (f"--model.init_args.backbone.{k}", str(v))],
        "--model.init_args.warmup_steps", "2",
        "--data.path", data, "--data.cache_dir", str(cache),
        "--data.source", tiny_corpus_docs[0], "--data.tokenizer", "bpe:512",
        "--data.block_size", "32", "--data.micro_batch_size", "4",
        "--data.eval_lengths", "[32, 64]", "--data.eval_tokens", "256",
        "--trainer.accelerator", "cpu", "--trainer.devices", "2", "--trainer.strategy", "ddp",
        "--trainer.max_steps", "3", "--trainer.num_sanity_val_steps", "0", "--trainer.enable_progress_bar", "false",
        "--checkpoint.every_n_train_steps", "3",
        "--trainer.callbacks+=ddp_probe.Probe", f"--trainer.callbacks.out_dir={out}",
        "--runs_dir", str(tmp_path / "runs"), "--seed_everything", "3",
        "--data.tasks", '{"passkey": {}}', "--data.task_fraction", "0",
        "--task_eval.lengths", "[80]", "--task_eval.depths", "[0.5]", "--task_eval.trials", "2",
    ]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([HERE, os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1"}
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    store = Store(data)
    assert "manifest.json" in store.sizes() and not store.client.list_objects_v2(
        Bucket=store.bucket, Prefix=f"{store.prefix}.lock").get("Contents"), "published, lock released"
    assert done.stdout.count("nothing to do") == 1 and done.stdout.count("published") == 1, "one preparation"
    # The loss by position is reduced across ranks like the perplexity (each rank scored half the windows), and
    # the passkey's accuracy is written once (rank 0).
    run = tmp_path / "runs" / "default" / "cable" / "version_0"
    read = lambda name: [json.loads(line) for line in open(run / name)]  # noqa: E731
    for row in read("length_eval.jsonl"):
        buckets = [r for r in read("position_loss.jsonl") if r["length"] == row["length"]]
        assert sum(r["tokens"] for r in buckets) == row["tokens"] == 256
        assert sum(r["loss"] * r["tokens"] for r in buckets) / 256 == pytest.approx(row["loss"], rel=1e-5)
    assert [(r["task"], r["length"], r["depth"], r["trials"]) for r in read("task_accuracy.jsonl")] == [
        ("passkey", 80, 0.5, 2)]
    # Each rank evaluated every other window; the record lists them all in stream order, as one process does.
    final = {r["length"]: r for r in read("length_eval.jsonl") if r["step"] == 3}
    alone = main(["validate", *cmd[4:cmd.index("--trainer.devices")], "--trainer.devices", "1",
                  "--runs_dir", str(tmp_path / "runs"), "--ckpt_path", "last"])
    for row in alone.model.length_results:
        assert sum(final[row.length]["window_tokens"]) == 256
        assert final[row.length]["window_tokens"] == row.window_tokens
        assert final[row.length]["window_nll"] == pytest.approx(row.window_nll, abs=2e-4)

    load = lambda name, rank: torch.load(out / f"{name}_rank{rank}.pt")  # noqa: E731
    batches = [load("batch0", r) for r in (0, 1)]
    assert not torch.equal(batches[0], batches[1]), "both ranks read the same samples"
    for name in ("init", "step1", "final"):
        for key, value in load(name, 0).items():
            torch.testing.assert_close(load(name, 1)[key], value, atol=0, rtol=0,
                                       msg=f"{name}: {key} differs across ranks")

    # One process, the union of the two ranks' batches, the same recipe (AdamW, schedule, clip 1.0).
    init = load("init", 0)
    described = TokenDataModule(data, block_size=32, cache_dir=str(cache)).describe()
    model = CausalLM(BackboneConfig(**SHAPE), data=described, warmup_steps=2)
    model.backbone.load_state_dict(init)
    union = torch.cat(batches)
    loss = model.backbone.loss(union[:, :-1], union[:, 1:])
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.backbone.parameters(), 1.0)
    optim = build_optimizer(model.backbone, model.optimizer_recipe, 3)
    optim["optimizer"].step()
    step1 = load("step1", 0)
    for key, value in model.backbone.state_dict().items():
        torch.testing.assert_close(step1[key], value, atol=1e-5, rtol=0, msg=key)
    assert not torch.equal(step1["wte.weight"], init["wte.weight"])
