"""Two nodes on one machine: two ``torchrun --nnodes 2 --nproc_per_node 1`` launchers (static rendezvous on
127.0.0.1, gloo, CPU), as one command per node would start them, streaming the prepared data from the S3-compatible
test store, each node with its own chunk cache; and SLURM's path, two tasks started with the variables ``srun`` sets.
docs/multi-gpu.md shows these commands."""

import collections
import hashlib
import json
import os
import signal
import socket
import subprocess
import sys

import numpy as np
import pytest
import recorders
import torch
from conftest import TINY_VAL_FRACTION, S3Server, args, write_tiny_corpus

from cable_lightning.callbacks.preemption import requeue_slurm_job
from cable_lightning.cli import run
from cable_lightning.data import prepare as prepare_module
from cable_lightning.data.remote import Store
from cable_lightning.owned import MARKER

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
CHUNK = 16 * 129  # tokens per chunk: 16 windows of block_size 128 (+1); the corpus is 10 chunks, 130 windows
STEPS = 8  # accumulation 2, 8 micro-batches a rank an epoch: 4 steps an epoch, 2 epochs


def fit_args(data, out, node):
    """One node's fit: 2 nodes x 1 process, 8 x 128 tokens a micro-batch, global batch 4096 tokens (accumulation 2),
    a checkpoint every 2 steps; each rank's windows and rank 0's losses written under ``out/probe``."""
    return ["--model", "cable_lightning.lit.CausalLM", "--model.init_args.backbone.pos_encoding", "cable",
            "--model.init_args.backbone.n_layer", "2", "--model.init_args.backbone.n_head", "2",
            "--model.init_args.backbone.n_embd", "32", "--model.init_args.warmup_steps", "2",
            "--data.path", data, "--data.block_size", "128", "--data.micro_batch_size", "8",
            "--data.eval_lengths", "[32]", "--data.eval_tokens", "128", "--data.cache_dir", str(out / f"cache{node}"),
            "--trainer.accelerator", "cpu", "--trainer.devices", "1", "--trainer.num_nodes", "2",
            "--trainer.strategy", "ddp", "--trainer.max_steps", str(STEPS), "--global_batch_tokens", "4096",
            "--checkpoint.every_n_train_steps", "2", "--trainer.num_sanity_val_steps", "0",
            "--trainer.enable_progress_bar", "false", "--trainer.enable_model_summary", "false",
            "--diagnostics.enabled", "false", "--length_eval.figure", "false",
            "--trainer.callbacks+=ddp_probe.Losses", f"--trainer.callbacks.out_dir={out / 'probe'}",
            "--trainer.callbacks+=ddp_probe.Windows", f"--trainer.callbacks.out_dir={out / 'probe'}",
            "--runs_dir", str(out.parent / "runs"), "--seed_everything", "5"]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def environment(**extra):
    # NNODES=2 is what litdata would see on two one-GPU nodes (world size // visible GPUs), or from a launch script
    # that exports it: the project must still split every epoch between the nodes (see data/datamodule.py).
    return {**os.environ, "PYTHONPATH": os.pathsep.join([HERE, ROOT]), "OMP_NUM_THREADS": "1", "NNODES": "2",
            **extra}


def start(out, commands, envs):
    out.mkdir(parents=True)
    return [subprocess.Popen(cmd, env=env, stdout=open(out / f"node{rank}.log", "w"), stderr=subprocess.STDOUT,
                             cwd=ROOT, start_new_session=True) for rank, (cmd, env) in enumerate(zip(commands, envs))]


def finish(out, nodes, timeout=240):
    """Each node's exit status; on a timeout both process groups are killed and the logs shown."""
    try:
        return [node.wait(timeout=timeout) for node in nodes]
    except subprocess.TimeoutExpired:
        for node in nodes:
            if node.poll() is None:
                os.killpg(node.pid, signal.SIGKILL)
        pytest.fail("the nodes did not finish: " + " | ".join(log(out, r)[-1500:] for r in range(len(nodes))))


def log(out, node):
    return (out / f"node{node}.log").read_text()


def torchrun(data, out, *extra):
    """Both nodes' launchers at once, as ``torchrun`` on two machines; their exit statuses."""
    port = free_port()
    commands = [[sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc_per_node", "1",
                 "--node_rank", str(node), "--master_addr", "127.0.0.1", "--master_port", str(port),
                 "-m", "cable_lightning", "fit", *fit_args(data, out, node), *extra] for node in (0, 1)]
    return finish(out, start(out, commands, [environment()] * 2))


def srun(data, out, scontrol_dir, *extra):
    """Two tasks on two nodes as ``srun`` starts them (its variables, one task a node), job 4242; their exit
    statuses."""
    port = free_port()
    commands = [[sys.executable, "-m", "cable_lightning", "fit", *fit_args(data, out, node), *extra] for node in (0, 1)]
    envs = [environment(SLURM_JOB_ID="4242", SLURM_JOB_NAME="cable", SLURM_NTASKS="2", SLURM_NTASKS_PER_NODE="1",
                        SLURM_NNODES="2", SLURM_PROCID=str(node), SLURM_NODEID=str(node), SLURM_LOCALID="0",
                        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                        PATH=os.pathsep.join([str(scontrol_dir), os.environ["PATH"]])) for node in (0, 1)]
    return finish(out, start(out, commands, envs))


def losses(out):
    return [json.loads(line) for line in open(out / "probe" / "losses.jsonl")]


def windows(out, rank):
    """(how Lightning placed the rank, its micro-batches: step, epoch, window digests)."""
    rows = [json.loads(line) for line in open(out / "probe" / f"windows_rank{rank}.jsonl")]
    return rows[0], rows[1:]


def weights(path):
    return torch.load(path, map_location="cpu", weights_only=True)["state_dict"]


def digest(window) -> str:
    return hashlib.sha1(np.asarray(window).astype(np.int64).tobytes()).hexdigest()[:16]


@pytest.fixture(scope="module")
def store(s3_server, tmp_path_factory):
    """The first ~44k characters of the tiny corpus prepared (bpe:512) in chunks of 16 windows, as a large corpus
    is prepared in 8 MB chunks, and published to the test store: (URL, {window digest: chunk index}, chunk files)."""
    from litdata import StreamingDataset, TokensLoader

    folder = tmp_path_factory.mktemp("chunked")
    jsonl, _ = write_tiny_corpus(str(folder), chars=44_000)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(prepare_module, "CHUNK_TOKENS", CHUNK)
        patch.setattr(prepare_module, "PIECE_TOKENS", CHUNK)
        prepare_module.prepare(source=jsonl, tokenizer="bpe:512", out=str(folder / "data"),
                               val_fraction=TINY_VAL_FRACTION, num_workers=1, start_method="fork", verbose=False)
    url = f"s3://{S3Server.BUCKET}/multinode"
    Store(url).publish(str(folder / "data"), MARKER, lambda *_: None)
    with open(folder / "data" / "train" / "index.json") as f:
        chunks = json.load(f)["chunks"]
    per_chunk = [int(chunk["dim"]) // 129 for chunk in chunks]
    train = StreamingDataset(str(folder / "data" / "train"), item_loader=TokensLoader(block_size=129))
    every = [digest(window) for window in train]
    chunk_of = dict(zip(every, np.repeat(np.arange(len(per_chunk)), per_chunk).tolist()))
    assert len(per_chunk) == 10 and len(every) == len(chunk_of) == 130, (per_chunk, len(every), len(chunk_of))
    return url, chunk_of, [chunk["filename"] for chunk in chunks]


@pytest.fixture(scope="module")
def uninterrupted(store, tmp_path_factory):
    """The 8-step two-node run the other tests are compared with (its folder)."""
    out = tmp_path_factory.mktemp("uninterrupted") / "run"
    assert torchrun(store[0], out) == [0, 0], log(out, 0)[-3000:] + log(out, 1)[-3000:]
    return out


def test_two_nodes_stream_disjoint_shares_whose_union_is_each_epoch(store, uninterrupted):
    _, chunk_of, chunk_files = store
    placed = [windows(uninterrupted, rank) for rank in (0, 1)]
    assert [p for p, _ in placed] == [{"world_size": 2, "num_nodes": 2, "node_rank": node, "global_rank": node,
                                      "environment": "TorchElasticEnvironment"} for node in (0, 1)]
    by_epoch = [collections.defaultdict(list) for _ in placed]
    for (_, batches), epochs in zip(placed, by_epoch):
        assert [b["step"] for b in batches] == [step for step in range(1, STEPS + 1) for _ in range(2)]
        for b in batches:
            epochs[b["epoch"]] += b["windows"]
    for epoch in (0, 1):  # two epochs of 4 steps
        shares = [epochs[epoch] for epochs in by_epoch]
        assert [len(share) for share in shares] == [64, 64]  # 8 micro-batches of 8 windows each
        assert all(len(set(share)) == 64 and set(share) <= set(chunk_of) for share in shares)
        assert not set(shares[0]) & set(shares[1]), f"epoch {epoch}: a window read on both nodes"
        # the epoch: every window but the 2 of 130 that do not fill a global batch of 2 x 8 (litdata's drop_last)
        assert len(set(shares[0]) | set(shares[1])) == 128
        chunks = [{chunk_of[w] for w in share} for share in shares]
        assert len(chunks[0] & chunks[1]) <= 1, "the nodes' shares meet in one chunk, read in part by each"
    for node in (0, 1):  # a node fetched into its cache the chunks it read, no other
        cached = {name for _, _, files in os.walk(uninterrupted / f"cache{node}") for name in files
                  if name.startswith("chunk-")}
        read = {chunk_files[chunk_of[w]] for epoch_windows in by_epoch[node].values() for w in epoch_windows}
        assert cached == read
    assert set(by_epoch[0][0]) != set(by_epoch[0][1]), "each epoch's windows are shared out afresh"


def test_a_node_killed_and_both_requeued_resume_exactly(store, uninterrupted, tmp_path):
    """Node 1 (its torchrun and its process) is killed mid-accumulation in step 5, after the step-4 checkpoint; node
    0's torchrun then fails. Both started again with --ckpt_path last (new chunk caches, as on other machines) train
    the uninterrupted run's steps 5-8 on the same windows with the same losses, bitwise, to the same weights."""
    url = store[0]
    killed = tmp_path / "killed"
    statuses = torchrun(url, killed, "--trainer.callbacks+=ddp_probe.KillNodeAt", "--trainer.callbacks.batch=10")
    assert statuses == [1, -signal.SIGKILL], log(killed, 0)[-2000:]
    ckpt = tmp_path / "runs" / "default" / "cable" / "checkpoints" / "last.ckpt"
    assert torch.load(ckpt, weights_only=True)["global_step"] == 4

    requeued = tmp_path / "requeued"
    assert torchrun(url, requeued, "--ckpt_path", "last") == [0, 0], log(requeued, 0)[-3000:]
    whole = losses(uninterrupted)
    assert [r["loss"] for r in losses(killed)][:8] == [r["loss"] for r in whole][:8]
    assert losses(requeued) == whole[8:]  # steps 5-8, two micro-batches each
    for rank in (0, 1):
        assert windows(requeued, rank)[1] == windows(uninterrupted, rank)[1][8:]
    final, expected = weights(ckpt), weights(uninterrupted.parent / "runs" / "default" / "cable" / "checkpoints"
                                              / "last.ckpt")
    assert final.keys() == expected.keys() and all(torch.equal(final[k], expected[k]) for k in expected)


def test_a_lost_peer_ends_the_surviving_process_in_one_line_naming_the_checkpoint_kept(
        tiny_corpus_dir, tmp_path, monkeypatch, capsys):
    """What the surviving node meets when the other is killed (the test above: gloo's all-reduce fails in the
    backward), in-process: one `error:` line with exit status 1 that names the lost peer, the checkpoint kept and how
    to continue, not gloo's traceback; torchrun's failure summary gets the same line from its error file."""
    error_file = tmp_path / "error.json"
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(error_file))
    runs = str(tmp_path / "runs")
    with pytest.raises(SystemExit) as stopped:
        run(["fit", *args(tiny_corpus_dir, runs, steps=6, every=2), "--diagnostics.enabled", "false",
             "--length_eval.figure", "false", "--trainer.callbacks+=recorders.PeerLostAt",
             "--trainer.callbacks.step=3"])
    assert stopped.value.code == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err and "GLHF" not in err, err
    lines = err.strip().splitlines()
    assert [line for line in lines if line.startswith("error:")] == lines[-1:], err
    ckpt = tmp_path / "runs" / "test" / "cable" / "checkpoints" / "last.ckpt"
    assert lines[-1] == (
        "error: fit lost another process of this run (1 process on 1 node; this is rank 0) at step 3: RuntimeError: "
        "Connection closed by peer [127.0.0.1]:17053; its own log says why it stopped; the last checkpoint, "
        f"{ckpt} (step 2), is kept: start every node again with --ckpt_path last (--ckpt_path auto in a job script) "
        "to continue from it")
    assert torch.load(ckpt, weights_only=True)["global_step"] == 2
    assert json.loads(error_file.read_text())["message"]["extraInfo"]["py_callstack"] == lines[-1]


def stand_in_scontrol(folder, status=0, said=""):
    """An ``scontrol`` that appends its arguments to ``folder/scontrol.calls`` and exits with ``status``."""
    folder.mkdir(exist_ok=True)
    script = folder / "scontrol"
    script.write_text(f'#!/bin/sh\necho "$@" >> "{folder}/scontrol.calls"\n'
                      + (f'echo "{said}" >&2\n' if said else "") + f"exit {status}\n")
    script.chmod(0o755)
    return folder / "scontrol.calls"


def test_srun_tasks_on_sigusr1_save_at_the_step_requeue_and_the_requeued_job_ends_as_uninterrupted(
        store, uninterrupted, tmp_path):
    """SLURM's warning (#SBATCH --signal=SIGUSR1@90) reaches task 1 between step 5's two micro-batches: both tasks
    finish step 5, agree on it at the end of step 6 (read a step late: no step waits for the device), save last.ckpt
    there, task 0 runs `scontrol requeue 4242` (it was not signalled itself), both exit 138.
    The requeued job (--ckpt_path last) ends as the torchrun run that was never stopped, bitwise."""
    url = store[0]
    calls = stand_in_scontrol(tmp_path / "bin")
    signalled = tmp_path / "signalled"
    statuses = srun(url, signalled, tmp_path / "bin", "--trainer.callbacks+=ddp_probe.SignalAt",
                    "--trainer.callbacks.batch=10", "--trainer.callbacks.rank=1")
    assert statuses == [138, 138], log(signalled, 0)[-3000:] + log(signalled, 1)[-3000:]
    assert calls.read_text() == "requeue 4242\n"
    assert [windows(signalled, rank)[0]["environment"] for rank in (0, 1)] == ["SLURMEnvironment"] * 2
    checkpoints = tmp_path / "runs" / "default" / "cable" / "checkpoints"
    assert torch.load(checkpoints / "last.ckpt", weights_only=True)["global_step"] == 6
    assert not list(tmp_path.rglob("hpc_ckpt*")), "Lightning's own SIGUSR1 handler saved too"
    assert not any("auto-requeueing enabled" in log(signalled, rank) for rank in (0, 1)), "Lightning's handler is on"
    last_line = log(signalled, 0).strip().splitlines()[-1]
    assert last_line.startswith("error: stopped by SIGUSR1; saved ") and last_line.endswith(
        "; requeued SLURM job 4242; continue with --ckpt_path last"), last_line

    requeued = tmp_path / "requeued"
    assert srun(url, requeued, tmp_path / "bin", "--ckpt_path", "last") == [0, 0], log(requeued, 0)[-3000:]
    whole = losses(uninterrupted)
    assert losses(signalled) == whole[:12] and losses(requeued) == whole[12:]
    final, expected = weights(checkpoints / "last.ckpt"), weights(uninterrupted.parent / "runs" / "default" / "cable"
                                                                  / "checkpoints" / "last.ckpt")
    assert all(torch.equal(final[k], expected[k]) for k in expected)
    assert calls.read_text() == "requeue 4242\n", "the requeued job, not signalled, did not requeue"


def test_requeue_names_an_array_task_and_says_a_failure_in_one_line(tmp_path, monkeypatch):
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    monkeypatch.setenv("SLURM_ARRAY_JOB_ID", "77")
    monkeypatch.setenv("SLURM_ARRAY_TASK_ID", "3")
    calls = stand_in_scontrol(tmp_path / "ok")
    monkeypatch.setenv("PATH", os.pathsep.join([str(tmp_path / "ok"), os.environ["PATH"]]))
    assert requeue_slurm_job() == "requeued SLURM job 77_3" and calls.read_text() == "requeue 77_3\n"

    stand_in_scontrol(tmp_path / "fails", status=1, said="scontrol: error: Job has already finished")
    monkeypatch.setenv("PATH", str(tmp_path / "fails"))
    assert requeue_slurm_job() == ("scontrol requeue 77_3 failed (exit 1: scontrol: error: Job has already "
                                   "finished); requeue or submit the job again")
    monkeypatch.setenv("PATH", str(tmp_path / "nothing"))
    assert requeue_slurm_job().startswith("scontrol requeue 77_3 failed (FileNotFoundError: ")
    monkeypatch.delenv("SLURM_ARRAY_JOB_ID")
    monkeypatch.delenv("SLURM_JOB_ID")
    assert requeue_slurm_job() == "not requeued: no SLURM job id in the environment (''); submit the job again"


def test_a_run_stopped_by_sigusr1_logs_the_loss_of_the_step_it_saved(tiny_corpus_dir, tmp_path, monkeypatch):
    """One task under SLURM, SIGUSR1 in step 3 (accumulation 2): last.ckpt holds step 4, and the TensorBoard curve
    read back from the event file ends at step 4 with that step's loss (Lightning logs step k at index k - 1). Before,
    it ended at step 3: the stop comes in a batch-end hook, before Lightning sends the step's metrics to the logger.
    With log_every_n_steps 2 the saved step is logged too, off the interval."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    for name, value in dict(SLURM_JOB_ID="4242", SLURM_JOB_NAME="cable", SLURM_NTASKS="1", SLURM_NTASKS_PER_NODE="1",
                            SLURM_NNODES="1", SLURM_PROCID="0", SLURM_NODEID="0", SLURM_LOCALID="0").items():
        monkeypatch.setenv(name, value)
    stand_in_scontrol(tmp_path / "bin")
    monkeypatch.setenv("PATH", os.pathsep.join([str(tmp_path / "bin"), os.environ["PATH"]]))
    recorders.LOSSES.clear()
    with pytest.raises(SystemExit) as stopped:
        run(["fit", *args(tiny_corpus_dir, str(tmp_path / "runs"), steps=6, every=4), "--global_batch_tokens", "256",
             "--diagnostics.enabled", "false", "--length_eval.figure", "false", "--trainer.log_every_n_steps", "2",
             "--trainer.callbacks+=ddp_probe.SignalAt", "--trainer.callbacks.batch=6",
             "--trainer.callbacks+=recorders.RecordBatches"])
    assert stopped.value.code == 138
    assert torch.load(tmp_path / "runs" / "test" / "cable" / "checkpoints" / "last.ckpt",
                      weights_only=True)["global_step"] == 4
    events = EventAccumulator(str(tmp_path / "runs" / "test" / "cable" / "version_0"))
    events.Reload()
    curve = {event.step: event.value for event in events.Scalars("train/loss")}
    assert sorted(curve) == [1, 3]  # steps 2 and 4
    # each logged point is the step's last micro-batch's loss (Lightning's outputs["loss"] is divided by the
    # accumulation, 2): step 2's as logged on the interval, step 4's as the stop logged it
    assert [curve[1], curve[3]] == pytest.approx([2 * recorders.LOSSES[3], 2 * recorders.LOSSES[7]], rel=1e-6)


def test_one_srun_task_on_sigusr1_mid_accumulation_saves_the_step_and_a_failing_requeue_is_one_line(
        tiny_corpus_dir, tmp_path, monkeypatch, capsys):
    """One task under SLURM (job array 77, task 3), accumulation 2; SIGUSR1 between step 3's micro-batches: last.ckpt
    holds step 4 whole (the signal is read at the end of the step after its own), scontrol fails, and the run still
    ends in one line with status 138, its handler gone."""
    for name, value in dict(SLURM_JOB_ID="4242", SLURM_ARRAY_JOB_ID="77", SLURM_ARRAY_TASK_ID="3",
                            SLURM_JOB_NAME="cable", SLURM_NTASKS="1", SLURM_NTASKS_PER_NODE="1", SLURM_NNODES="1",
                            SLURM_PROCID="0", SLURM_NODEID="0", SLURM_LOCALID="0").items():
        monkeypatch.setenv(name, value)
    calls = stand_in_scontrol(tmp_path / "bin", status=1, said="scontrol: error: Job has already finished")
    monkeypatch.setenv("PATH", os.pathsep.join([str(tmp_path / "bin"), os.environ["PATH"]]))
    runs = str(tmp_path / "runs")
    with pytest.raises(SystemExit) as stopped:
        run(["fit", *args(tiny_corpus_dir, runs, steps=6, every=4), "--global_batch_tokens", "256",
             "--diagnostics.enabled", "false", "--length_eval.figure", "false",
             "--trainer.callbacks+=ddp_probe.SignalAt", "--trainer.callbacks.batch=6"])
    assert stopped.value.code == 138
    assert calls.read_text() == "requeue 77_3\n"
    said = capsys.readouterr().err.strip().splitlines()[-1]
    assert said.startswith("error: stopped by SIGUSR1; saved ") and said.endswith(
        "; scontrol requeue 77_3 failed (exit 1: scontrol: error: Job has already finished); requeue or submit the "
        "job again; continue with --ckpt_path last"), said
    assert torch.load(tmp_path / "runs" / "test" / "cable" / "checkpoints" / "last.ckpt",
                      weights_only=True)["global_step"] == 4
    assert not list(tmp_path.rglob("hpc_ckpt*"))
    assert signal.getsignal(signal.SIGUSR1) == signal.SIG_DFL
