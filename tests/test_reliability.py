"""Faults and bad inputs: checkpoints that survive kills and full disks, divergence, SIGTERM, --ckpt_path handling,
seeds, and user errors as one line. Each test proves one fix; the runs are the CLI's own on the tiny corpus."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import lightning.pytorch
import pytest
import recorders
import torch
from conftest import ROOT, TESTS, args, checkpoints, jsonl_rows, user_error_line

from cable_lightning.checkpoints import PARTIAL_SUFFIX, AtomicCheckpointIO, claim_checkpoint_folder, resolve_ckpt_path
from cable_lightning.cli import main, run
from cable_lightning.errors import ConfigError, CorruptCheckpointError, RunFailedError
from cable_lightning.eval.comparable import latest_rows
from cable_lightning.positional.rope import Rope
from cable_lightning.records.io import find_records


@pytest.fixture(scope="module")
def rope_run(tiny_corpus_dir, tmp_path_factory):
    """A 4-step RoPE run with checkpoints at steps 2 and 4; returns its runs folder."""
    runs = str(tmp_path_factory.mktemp("rope_runs"))
    main(["fit", *args(tiny_corpus_dir, runs, pe="rope")])
    return runs


# --- --ckpt_path FILE: the command line wins, weight-defining settings must match ------------------------------------

def test_validate_ckpt_path_applies_eval_settings_and_refuses_weight_settings(tiny_corpus_dir, rope_run, tmp_path):
    ckpt = os.path.join(checkpoints(rope_run), "last.ckpt")
    longer = ["--data.eval_lengths", "[32, 128]", "--ckpt_path", ckpt]
    plain = main(["validate", *args(tiny_corpus_dir, rope_run, pe="rope"), *longer])
    scaled = main(["validate", *args(tiny_corpus_dir, rope_run, pe="rope"), *longer,
                   "--model.init_args.backbone.pos_encoding.scaling", "linear",
                   "--model.init_args.backbone.pos_encoding.scaling_factor", "4"])
    assert scaled.model.config.pos_encoding == Rope(scaling="linear", scaling_factor=4.0)
    assert plain.model.config.pos_encoding == Rope()
    ppl = {name: {r.length: r.ppl for r in cli.model.length_results}
           for name, cli in [("plain", plain), ("scaled", scaled)]}
    assert ppl["plain"][128] != ppl["scaled"][128]  # the scaling reached the model that was evaluated
    with open(os.path.join(scaled.trainer.log_dir, "config.yaml")) as f:
        assert "scaling: linear" in f.read()
    with open(os.path.join(scaled.trainer.log_dir, "length_eval.jsonl")) as f:
        assert {json.loads(line)["pe"] for line in f} == {"rope+linear4"}  # its own column in reports

    # Settings the command line leaves out come from the checkpoint (here: everything but the class).
    bare = ["--model", "cable_lightning.lit.CausalLM", *args(tiny_corpus_dir, rope_run, pe="rope")[14:]]
    cli = main(["validate", *bare, "--ckpt_path", ckpt])
    assert (cli.model.config.pos_encoding.label(), cli.model.config.n_layer, cli.model.config.n_embd) == ("rope", 2, 32)

    with pytest.raises(ConfigError, match=r"pos_encoding \(checkpoint 'rope', configured 'alibi'\)"):
        main(["validate", *args(tiny_corpus_dir, str(tmp_path), pe="alibi"), "--ckpt_path", ckpt])
    with pytest.raises(ConfigError, match=r"n_layer \(checkpoint 2, configured 3\)"):
        main(["validate", *args(tiny_corpus_dir, rope_run, pe="rope"), "--model.init_args.backbone.n_layer", "3",
              "--ckpt_path", ckpt])
    with pytest.raises(ConfigError, match="trained at block_size 32 but data.block_size is 64"):
        main(["validate", *args(tiny_corpus_dir, rope_run, pe="rope"), "--data.block_size", "64", "--ckpt_path", ckpt])


def test_a_resume_refuses_another_layout_or_global_batch_and_keeps_one_given_in_tokens(tiny_corpus_dir, rope_run,
                                                                                       tmp_path, capsys):
    """What a resumed run trains on is the checkpoint's: another data.layout or global batch is one line naming both
    values and the way on; --global_batch_tokens keeps the batch with another micro-batch (accumulation follows)."""
    step2 = os.path.join(checkpoints(rope_run), "step0000002.ckpt")
    resume = ["fit", *args(tiny_corpus_dir, str(tmp_path), pe="rope"), "--ckpt_path", step2]
    line = user_error_line(capsys, [*resume, "--data.layout.documents", "train"])
    assert "data.layout.documents (checkpoint 'none', configured 'train')" in line
    assert "resume with --data.layout.documents none" in line and f"init_weights {step2}" in line
    line = user_error_line(capsys, [*resume, "--data.micro_batch_size", "2"])
    assert ("global batch of 128 tokens (1 process x 4 x 32 tokens x accumulation 1) and this run's is 64 tokens "
            "(1 process x 2 x 32 tokens x accumulation 1); resume with --global_batch_tokens 128") in line
    resumed = main([*resume, "--data.micro_batch_size", "2", "--global_batch_tokens", "128"])
    assert resumed.trainer.global_step == 4 and resumed.trainer.accumulate_grad_batches == 2


def test_a_resume_on_a_world_that_cannot_keep_the_global_batch_says_so_and_what_can(tiny_corpus_dir, rope_run,
                                                                                      tmp_path, capsys, monkeypatch):
    """A checkpoint of 4 rows of 32 tokens a step (1 process x micro-batch 4) requeued on 3 processes (the world size
    Lightning reports, as 3 nodes would) or with micro-batch 3: whatever --global_batch_tokens says, one line says
    that the batch cannot be kept there and what keeps it; before, the two refusals advised each other (the
    accumulation's "pick a multiple of 384", the resume's "resume with --global_batch_tokens 128")."""
    step2 = os.path.join(checkpoints(rope_run), "step0000002.ckpt")
    resume = ["fit", *args(tiny_corpus_dir, str(tmp_path), pe="rope"), "--ckpt_path", step2]
    with monkeypatch.context() as patch:
        patch.setattr(lightning.pytorch.Trainer, "world_size", property(lambda trainer: 3))
        for flags in ([], ["--global_batch_tokens", "128"], ["--global_batch_tokens", "384"]):
            line = user_error_line(capsys, [*resume, *flags])
            assert line == (
                "error: this run's global batch of 128 tokens (1 process x 4 x 32 tokens x accumulation 1), checkpoint "
                f"{step2}, cannot be kept on 3 processes with micro-batch 4: its 4 rows a step are not a multiple of "
                "processes x micro-batch = 3 x 4; 3 processes can never keep it, whatever the micro-batch (4 is not a "
                "multiple of 3); resume it on 1 process (micro-batch 4); or start a new run from its weights "
                f"(--model.init_args.init_weights {step2}, another --experiment) with --global_batch_tokens 384: a new "
                "run, not a resume"), flags
    for flags in ([], ["--global_batch_tokens", "128"], ["--global_batch_tokens", "96"]):
        line = user_error_line(capsys, [*resume, "--data.micro_batch_size", "3", *flags])
        assert "cannot be kept on 1 process with micro-batch 3" in line and "--global_batch_tokens 128" not in line
        assert "resume it with --data.micro_batch_size 1 or 2; or start a new run" in line, flags


def test_revalidation_rows_carry_the_checkpoint_step_and_reach_the_report(tiny_corpus_dir, rope_run):
    folder = checkpoints(rope_run)
    main(["validate", *args(tiny_corpus_dir, rope_run, pe="rope"), "--data.eval_lengths", "[32, 64, 128]",
          "--ckpt_path", os.path.join(folder, "step0000002.ckpt")])
    main(["validate", *args(tiny_corpus_dir, rope_run, pe="rope"), "--data.eval_lengths", "[32, 64, 128]",
          "--ckpt_path", "last"])
    revalidated = [r for r in jsonl_rows(rope_run) if r["stage"] == "validate" and r["length"] == 128]
    assert [(r["step"], os.path.basename(r["checkpoint"])) for r in revalidated][-2:] == [(2, "step0000002.ckpt"),
                                                                                          (4, "last.ckpt")]
    latest = latest_rows(find_records([os.path.join(rope_run, "test", "rope")]))
    assert {r.length for r in latest} == {32, 64, 128} and {r.step for r in latest} == {4}


def test_report_reads_runs_in_the_order_they_were_written(tmp_path):
    """version_10 was written after version_9: its rows win at the same step even though its name sorts first."""
    for version, ppl in [("version_9", 50.0), ("version_10", 40.0)]:
        os.makedirs(tmp_path / version)
        row = {"pe": "cable", "train_length": 32, "step": 4, "length": 64, "mode": "nonoverlap", "ppl": ppl}
        (tmp_path / version / "length_eval.jsonl").write_text(json.dumps(row) + "\n")
        time.sleep(0.01)  # distinct modification times (ordering only, nothing is timed)
    assert [r.ppl for r in latest_rows(find_records([str(tmp_path)]))] == [40.0]


# --- seeds ---------------------------------------------------------------------------------------------------------

def test_first_fit_that_prepares_its_data_honours_the_seed(tiny_corpus_docs, tmp_path):
    """litdata's optimize reseeds everything to 42; a run that prepares its data must equal one that finds it done."""
    jsonl, _ = tiny_corpus_docs
    data = str(tmp_path / "data")
    source = ["--data.source", jsonl, "--data.tokenizer", "bpe:512", "--data.num_workers", "0"]
    first = main(["fit", *args(data, str(tmp_path / "a"), steps=1, every=1), *source])
    second = main(["fit", *args(data, str(tmp_path / "b"), steps=1, every=1), *source])
    for (name, p), q in zip(first.model.named_parameters(), second.model.parameters()):
        torch.testing.assert_close(p, q, atol=0, rtol=0, msg=name)


# --- divergence -------------------------------------------------------------------------------------------------------

def test_divergence_stops_the_run_and_keeps_the_last_finite_checkpoint(tiny_corpus_dir, tmp_path, capsys):
    """The NaN step's update is held back on the device (the fused optimizer's ``found_inf``), read a step later
    (no step waits for its own flag), and the run stops before the next checkpoint is written."""
    recorders.StateAtStepEnd.seen.clear()
    line = user_error_line(capsys, ["fit", *args(tiny_corpus_dir, str(tmp_path), steps=8, every=2),
                                    "--trainer.callbacks+=recorders.NanGradientsAt", "--trainer.callbacks.step=3",
                                    "--trainer.callbacks+=recorders.StateAtStepEnd"],
                           status=1)
    assert line.startswith("error: training diverged at step 3: loss ") and "gradient norm nan" in line
    seen = recorders.StateAtStepEnd.seen
    assert sorted(seen) == [1, 2, 3, 4]  # step 3's update ran (held back), then the checkpoint at 4 was refused
    (before, counted), (after, counted_after) = seen[3], seen[4]
    assert counted_after == counted  # the optimizer's state did not step
    for name, value in after.items():
        torch.testing.assert_close(value, before[name], atol=0, rtol=0, msg=name)  # nor did the weights
    assert any(not torch.equal(value, seen[2][0][name]) for name, value in before.items())  # a step that applies
    folder = checkpoints(str(tmp_path), "cable")
    assert sorted(os.listdir(folder)) == ["last.ckpt", "step0000002.ckpt"]
    last = torch.load(os.path.join(folder, "last.ckpt"), weights_only=True)
    assert last["global_step"] == 2
    assert all(torch.isfinite(t).all() for t in last["state_dict"].values())
    resumed = main(["fit", *args(tiny_corpus_dir, str(tmp_path), steps=4, every=2), "--ckpt_path", "last"])
    assert resumed.trainer.global_step == 4


def test_a_run_worse_than_guessing_says_so_and_prints_its_perplexity_short(tiny_corpus_dir, tmp_path, capsys):
    """lr 5: the loss stays finite (no divergence stop), the perplexity is ~1e225."""
    run(["fit", *args(tiny_corpus_dir, str(tmp_path), steps=4, every=4), "--model.init_args.lr", "5"])
    out, err = capsys.readouterr()
    [row] = [line.split() for line in out.splitlines() if line.startswith("    32 ")]
    assert "e+" in row[2] and float(row[2]) > 1e100, out  # three significant digits, not hundreds of digits
    warning = [line for line in err.splitlines() if line.startswith("warning: perplexity")]
    assert warning == [f"warning: perplexity {row[2]} at the training length 32 (step 4) is above the vocabulary size "
                       "512, worse than guessing every token: the model is not learning; lower the learning rate "
                       "(--model.init_args.lr)"], err


def test_rows_validated_from_a_url_record_the_url_not_its_temporary_copy(tiny_corpus_dir, rope_run, tmp_path):
    url = f"file://{os.path.join(checkpoints(rope_run), 'last.ckpt')}"
    cli = main(["validate", *args(tiny_corpus_dir, str(tmp_path), pe="rope"), "--ckpt_path", url])
    assert cli.model.length_results and {r.checkpoint for r in cli.model.length_results} == {url}


def test_perplexity_overflow_is_recorded_as_inf(tiny_corpus_dir, rope_run, tmp_path):
    state = torch.load(os.path.join(checkpoints(rope_run), "last.ckpt"), weights_only=True)
    state["state_dict"]["backbone.ln_f.weight"] *= 1e5  # logits ~1e5: mean NLL far beyond exp's float64 range
    broken = str(tmp_path / "huge.ckpt")
    torch.save(state, broken)
    cli = main(["validate", *args(tiny_corpus_dir, str(tmp_path), pe="rope"), "--ckpt_path", broken])
    rows = cli.model.length_results
    assert rows and all(r.ppl == float("inf") and r.loss > 709 for r in rows)


# --- --ckpt_path last / auto, corrupt checkpoints -------------------------------------------------------------------

def test_ckpt_path_last_skips_a_corrupt_last_and_refuses_when_nothing_loads(tiny_corpus_dir, tmp_path, capsys):
    runs = str(tmp_path / "runs")
    main(["fit", *args(tiny_corpus_dir, runs)])
    folder = checkpoints(runs, "cable")
    with open(os.path.join(folder, "last.ckpt"), "r+b") as f:
        f.truncate(1000)  # as a kill during a non-atomic copy would leave it
    assert resolve_ckpt_path("last", folder) == os.path.join(folder, "step0000004.ckpt")
    os.symlink(os.path.join(folder, "gone.ckpt"), os.path.join(folder, "dangling.ckpt"))  # a link to a deleted file
    assert resolve_ckpt_path("last", folder) == os.path.join(folder, "step0000004.ckpt")
    os.remove(os.path.join(folder, "dangling.ckpt"))
    future = time.time() + 3600
    os.utime(os.path.join(folder, "step0000002.ckpt"), (future, future))  # a copied folder: times say nothing
    assert resolve_ckpt_path("last", folder) == os.path.join(folder, "step0000004.ckpt")
    cli = main(["validate", *args(tiny_corpus_dir, runs), "--ckpt_path", "last"])
    assert cli.model.length_results[0].step == 4

    line = user_error_line(capsys, ["validate", *args(tiny_corpus_dir, runs), "--ckpt_path",
                                    os.path.join(folder, "last.ckpt")])
    assert "last.ckpt is corrupt or truncated" in line
    with pytest.raises(CorruptCheckpointError, match="not-a-checkpoint.ckpt"):
        (tmp_path / "not-a-checkpoint.ckpt").write_text("hello")
        main(["validate", *args(tiny_corpus_dir, runs), "--ckpt_path", str(tmp_path / "not-a-checkpoint.ckpt")])

    for name in os.listdir(folder):
        with open(os.path.join(folder, name), "r+b") as f:
            f.truncate(100)
    line = user_error_line(capsys, ["fit", *args(tiny_corpus_dir, runs), "--ckpt_path", "last"])
    assert "none of the 3 checkpoints in" in line
    line = user_error_line(capsys, ["fit", *args(tiny_corpus_dir, runs)])
    assert "already holds 3 checkpoints of an earlier run" in line  # a new run would overwrite them
    line = user_error_line(capsys, ["validate", *args(tiny_corpus_dir, str(tmp_path / "empty"))])
    assert "validate needs trained weights" in line
    line = user_error_line(capsys, ["validate", *args(tiny_corpus_dir, str(tmp_path / "empty")), "--ckpt_path", "last"])
    assert "no checkpoint in" in line and "pass a checkpoint file" in line
    line = user_error_line(capsys, ["fit", *args(tiny_corpus_dir, str(tmp_path / "empty")), "--ckpt_path", "last"])
    assert "no checkpoint in" in line and "--ckpt_path auto" in line
    assert resolve_ckpt_path("auto", str(tmp_path / "empty")) is None
    fresh = main(["fit", *args(tiny_corpus_dir, str(tmp_path / "auto"), steps=2), "--ckpt_path", "auto"])
    assert fresh.trainer.global_step == 2
    again = main(["fit", *args(tiny_corpus_dir, str(tmp_path / "auto"), steps=4), "--ckpt_path", "auto"])
    assert again.trainer.global_step == 4


# --- atomic checkpoint writes -----------------------------------------------------------------------------------------

SAVER = """
import sys, torch
from cable_lightning.checkpoints import AtomicCheckpointIO
io, version = AtomicCheckpointIO(), 0
while True:
    io.save_checkpoint({"version": version, "weights": torch.full((8_000_000,), float(version))}, sys.argv[1])
    print(version, flush=True)
    version += 1
"""


def test_kill_during_checkpoint_writes_leaves_a_loadable_last(tmp_path):
    """SIGKILL at arbitrary points of a stream of 32 MB saves: last.ckpt always loads and is one whole version; the
    system temp directory (on another path here) is never used; the next save removes the stale partial file."""
    target, temp = tmp_path / "ckpt" / "last.ckpt", tmp_path / "other-tmp"
    temp.mkdir()
    env = {**os.environ, "TMPDIR": str(temp), "PYTHONPATH": ROOT}
    for delay in (0.05, 0.2, 0.35):
        saver = subprocess.Popen([sys.executable, "-c", SAVER, str(target)], env=env, stdout=subprocess.PIPE, text=True)
        assert saver.stdout.readline()  # one save finished
        time.sleep(delay)  # then kill somewhere in the following ones
        saver.send_signal(signal.SIGKILL)
        saver.wait()
        loaded = torch.load(target, weights_only=True)
        assert (loaded["weights"] == loaded["version"]).all()
    assert os.listdir(temp) == []
    AtomicCheckpointIO().save_checkpoint({"version": -1}, str(target))
    assert os.listdir(target.parent) == ["last.ckpt"]


@pytest.mark.parametrize("error", [OSError(28, "No space left on device"),
                                   RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 64 vs 0")])
def test_a_failed_checkpoint_write_is_an_error_and_keeps_the_old_file(tmp_path, monkeypatch, error):
    """torch.save reports a full disk as OSError or, from its zip writer, as RuntimeError."""
    target = str(tmp_path / "last.ckpt")
    io = AtomicCheckpointIO()
    io.save_checkpoint({"version": 1}, target)

    def disk_full(obj, f):
        f.write(b"PK partial bytes")
        raise error

    monkeypatch.setattr("cable_lightning.checkpoints.torch.save", disk_full)
    with pytest.raises(RunFailedError,
                       match=rf"could not write checkpoint .*last.ckpt \({type(error).__name__}: .* MiB free there"):
        io.save_checkpoint({"version": 2}, target)
    assert torch.load(target, weights_only=True) == {"version": 1}
    assert not os.path.exists(target + PARTIAL_SUFFIX)


def test_a_file_size_limit_is_named_as_such_not_as_free_space(tmp_path):
    """``ulimit -f``: the write fails with EFBIG (Python ignores SIGXFSZ) while the disk has room."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, hard))
    try:
        with pytest.raises(RunFailedError) as failed:
            AtomicCheckpointIO().save_checkpoint({"weights": torch.zeros(1 << 19)}, str(tmp_path / "last.ckpt"))
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    assert "the file reached this process's file-size limit (ulimit -f) of 1 MiB; raise it" in str(failed.value)
    assert "free there" not in str(failed.value) and os.listdir(tmp_path) == []


@pytest.mark.parametrize("full, what", [("length_eval.jsonl", "the records "), ("config.yaml", "")],
                         ids=["records", "config"])
def test_a_full_logs_folder_is_one_line_naming_the_file(tiny_corpus_dir, tmp_path, capsys, monkeypatch, full, what):
    logs = tmp_path / "logs" / "test" / "v0"
    logs.mkdir(parents=True)
    if full == "config.yaml":  # jsonargparse refuses to write through a link: its save meets the full disk
        def disk_full(*args, **kwargs):
            raise OSError(28, "No space left on device")

        monkeypatch.setattr("cable_lightning.argument_errors.TerseParser.save", disk_full)
    else:
        os.symlink("/dev/full", logs / full)  # every write to it: ENOSPC
    line = user_error_line(capsys, ["fit", *args(tiny_corpus_dir, str(tmp_path), steps=2, every=2),
                                    "--trainer.logger", "lightning.pytorch.loggers.TensorBoardLogger",
                                    "--trainer.logger.save_dir", str(tmp_path / "logs"), "--trainer.logger.name",
                                    "test", "--trainer.logger.version", "v0"], status=1)
    assert line.startswith(f"error: could not write {what}{logs / full} (OSError: [Errno 28] No space left on "
                           "device; "), line


def test_a_checkpoint_folder_that_cannot_be_made_fails_before_training(tiny_corpus_dir, tmp_path, capsys):
    (tmp_path / "a-file").write_text("")
    line = user_error_line(capsys, ["fit", *args(tiny_corpus_dir, str(tmp_path)), "--checkpoint.dirpath",
                                    str(tmp_path / "a-file" / "checkpoints"),
                                    "--trainer.callbacks+=recorders.RecordBatches"])
    assert "cannot create the checkpoint folder" in line and "NotADirectoryError" in line
    line = user_error_line(capsys, ["fit", *args(tiny_corpus_dir, str(tmp_path / "a-file"))])  # --runs_dir is a file
    assert "cannot create the checkpoint folder" in line


def test_two_runs_cannot_write_into_one_checkpoint_folder(tiny_corpus_dir, tmp_path, capsys):
    folder = checkpoints(str(tmp_path), "cable")
    held = claim_checkpoint_folder(folder, resuming=False, lock=True)  # as a run that is still going would
    line = user_error_line(capsys, ["fit", *args(tiny_corpus_dir, str(tmp_path))])
    assert f"another run is writing checkpoints into {folder}" in line
    held.close()
    assert main(["fit", *args(tiny_corpus_dir, str(tmp_path), steps=2)]).trainer.global_step == 2


# --- SIGTERM ---------------------------------------------------------------------------------------------------------

def sigterm_run(data, runs, extra, sigterm_args=()):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, TESTS]), "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "cable_lightning", "fit", *args(data, runs, steps=6, every=4), *extra,
                           "--trainer.callbacks+=recorders.SigtermAt", "--trainer.callbacks.step=3", *sigterm_args],
                          env=env, capture_output=True, text=True, timeout=300)


def test_sigterm_saves_last_at_the_optimizer_step_exits_143_and_the_resumed_run_is_the_same(tiny_corpus_dir, tmp_path):
    """SIGTERM arrives mid-accumulation (2 micro-batches per step) in step 4: the run finishes that step and the next
    (the ranks' word on a step is read at the end of the next), saves last.ckpt at step 5, exits 143; resuming it
    with --ckpt_path last ends with the weights of a run that was never stopped."""
    accumulate = ["--global_batch_tokens", "256"]  # 2 x (4 x 32)
    straight = main(["fit", *args(tiny_corpus_dir, str(tmp_path / "straight"), steps=6, every=4), *accumulate])
    runs = str(tmp_path / "stopped")
    done = sigterm_run(tiny_corpus_dir, runs, accumulate)
    assert done.returncode == 143, done.stderr[-2000:]
    assert done.stderr.strip().splitlines()[-1].startswith("error: stopped by SIGTERM; saved ")
    assert torch.load(os.path.join(checkpoints(runs, "cable"), "last.ckpt"), weights_only=True)["global_step"] == 5
    resumed = main(["fit", *args(tiny_corpus_dir, runs, steps=6, every=4), *accumulate, "--ckpt_path", "last"])
    assert resumed.trainer.global_step == 6
    # the resumed run's checkpoints replace last.ckpt (no last-v1.ckpt beside a stale one)
    assert sorted(os.listdir(checkpoints(runs, "cable"))) == ["last.ckpt", "step0000004.ckpt"]
    resumed_rows = [json.loads(line) for line in open(os.path.join(resumed.trainer.log_dir, "length_eval.jsonl"))]
    assert resumed.trainer.log_dir.endswith("version_1") and {r["step"] for r in resumed_rows} == {6}
    for (name, p), q in zip(straight.model.named_parameters(), resumed.model.parameters()):
        torch.testing.assert_close(p, q, atol=1e-6, rtol=0, msg=name)


def test_ctrl_c_saves_last_and_exits_130(tiny_corpus_dir, tmp_path):
    done = sigterm_run(tiny_corpus_dir, str(tmp_path), [], sigterm_args=["--trainer.callbacks.signame=SIGINT"])
    assert done.returncode == 130, done.stderr[-2000:]
    assert done.stderr.strip().splitlines()[-1].startswith("error: stopped by SIGINT; saved ")
    assert torch.load(os.path.join(checkpoints(str(tmp_path), "cable"), "last.ckpt"),
                      weights_only=True)["global_step"] == 5


def test_sigterm_to_rank_0_of_a_ddp_run_stops_every_rank_with_a_checkpoint(tiny_corpus_dir, tmp_path):
    runs = str(tmp_path)
    done = sigterm_run(tiny_corpus_dir, runs, ["--trainer.devices", "2", "--trainer.strategy", "ddp"],
                       sigterm_args=["--trainer.callbacks.rank=0"])
    assert done.returncode == 143, done.stderr[-2000:]
    assert torch.load(os.path.join(checkpoints(runs, "cable"), "last.ckpt"), weights_only=True)["global_step"] == 5


# --- one-line user errors -------------------------------------------------------------------------------------------

@pytest.mark.parametrize("extra,message", [
    (["--model.init_args.backbone.pos_encoding", "fourier"],
     "unknown positional encoding 'fourier'; valid names: alibi"),
    (["--model.init_args.backbone.preset", "gpt5"], "unknown backbone preset 'gpt5'"),
    (["--model.init_args.backbone.n_embd", "33"], "n_embd=33 is not divisible by n_head=2"),
    (["--data.micro_batch_size", "-1"], "micro_batch_size must be an integer >= 1, got -1"),
    (["--data.eval_lengths", "[0]"], "data.eval_lengths: 0 is not a length >= 1, a range START..STOP"),
    (["--data.eval_lengths", "32...64"], "data.eval_lengths: '32...64' is not a length >= 1, a range START..STOP"),
    (["--data.path", "/nonexistent/data"], "no prepared data at /nonexistent/data"),
    (["--global_batch_tokens", "1000"], "global_batch_tokens=1000 is not a multiple of"),
    (["--trainer.max_stepz", "3"], "unrecognized arguments: --trainer.max_stepz 3"),
    (["--trainer.devices", "0,1"], "the trainer settings are not valid here: `devices` selected with `CPUAccelerator`"),
])
def test_user_errors_are_one_line_with_exit_status_2(tiny_corpus_dir, tmp_path, capsys, extra, message):
    line = user_error_line(capsys, ["fit", *args(tiny_corpus_dir, str(tmp_path), steps=1), *extra])
    assert message in line


def test_token_ids_beyond_the_vocabulary_are_named(tiny_corpus_dir, tmp_path):
    data = tmp_path / "data"
    shutil.copytree(tiny_corpus_dir, data)
    manifest = json.loads((data / "manifest.json").read_text())
    manifest["vocab_size"] = 100  # as if the folder said another (smaller) tokenizer made it
    (data / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ConfigError, match=r"token id \d+ in (training batch 0|the val split) of .* is outside the "
                                          r"model's vocabulary of 100 ids"):
        main(["fit", *args(str(data), str(tmp_path / "runs"), steps=1)])


def test_every_training_batch_is_checked_not_only_the_first(tiny_corpus_dir):
    """A chunk corrupted deep in the stream is named when its batch is read, on the host, before it reaches the
    embedding (an IndexError there, or a device-side assert on CUDA)."""
    from types import SimpleNamespace

    from cable_lightning.data.datamodule import TokenDataModule

    dm = TokenDataModule(path=tiny_corpus_dir, block_size=32, micro_batch_size=2)
    vocab = dm.describe().vocab_size
    progress = SimpleNamespace(total=SimpleNamespace(ready=0))
    dm.trainer = SimpleNamespace(training=True, global_rank=0,
                                 fit_loop=SimpleNamespace(epoch_loop=SimpleNamespace(batch_progress=progress)))
    good = torch.randint(0, vocab, (2, 33))
    for batch_number in range(3):
        progress.total.ready = batch_number
        assert torch.equal(dm.on_before_batch_transfer(good, 0), good)
    progress.total.ready = 4711
    bad = good.clone()
    bad[1, 20] = vocab
    with pytest.raises(ConfigError, match=rf"token id {vocab} in training batch 4711 of .* is outside the model's "
                                          rf"vocabulary of {vocab} ids"):
        dm.on_before_batch_transfer(bad, 0)


def test_a_resumed_schedule_follows_the_configured_learning_rate():
    """Resuming with a lower lr (what the divergence message advises) gives the new recipe's rate from the first
    resumed step; the checkpoint carries only the step."""
    from cable_lightning.lit.optim import OptimizerRecipe, build_optimizer, warmup_cosine

    model = torch.nn.Linear(4, 4)
    first = build_optimizer(model, OptimizerRecipe(1e-3, 1e-4, 2, (0.9, 0.95), 1e-8, 0.1), 10)
    for _ in range(5):
        first["optimizer"].step()
        first["lr_scheduler"]["scheduler"].step()
    resumed = build_optimizer(model, OptimizerRecipe(1e-4, 1e-5, 2, (0.9, 0.95), 1e-8, 0.1), 20)
    resumed["optimizer"].load_state_dict(first["optimizer"].state_dict())
    resumed["lr_scheduler"]["scheduler"].load_state_dict(first["lr_scheduler"]["scheduler"].state_dict())
    expected = warmup_cosine(5, 2, 20, 1e-4, 1e-5)
    assert [g["lr"] for g in resumed["optimizer"].param_groups] == [expected, expected]
    resumed["optimizer"].step()
    resumed["lr_scheduler"]["scheduler"].step()
    assert resumed["optimizer"].param_groups[0]["lr"] == warmup_cosine(6, 2, 20, 1e-4, 1e-5)
