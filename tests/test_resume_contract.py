"""The long run's resume contract (cable_lightning/lit/resume.py): a checkpoint is never rewritten with another
state, a requeue after a kill mid-accumulation trains the uninterrupted run bitwise, the last step of every fit is
saved, and a resume of a finished run does nothing. (World-size changes: tests/test_fsdp.py.)"""

import hashlib
import json
import os
import shutil
import subprocess
import sys

import pytest
import recorders
import torch
from conftest import ROOT, TESTS, args, checkpoints, jsonl_rows, user_error_line

from cable_lightning.cli import main, run
from cable_lightning.errors import ConfigError
from cable_lightning.lit.resume import carry_accumulation

ACCUMULATE = ["--global_batch_tokens", "256"]  # 2 micro-batches of 4 x 32 tokens per optimizer step
RECORD = ["--trainer.callbacks+=recorders.RecordBatches", "--diagnostics.enabled", "false",
          "--length_eval.figure", "false"]


def digests(folder) -> dict[str, str]:
    return {name: hashlib.sha256(open(os.path.join(folder, name), "rb").read()).hexdigest()
            for name in sorted(os.listdir(folder)) if name.endswith(".ckpt")}


def fit(data, runs, *extra, steps=4):
    recorders.BATCHES.clear(), recorders.LOSSES.clear()
    cli = main(["fit", *args(data, runs, steps=steps, every=2), *ACCUMULATE, *RECORD, *extra])
    return cli, list(recorders.BATCHES), list(recorders.LOSSES)


def test_a_requeue_after_a_kill_mid_accumulation_trains_the_uninterrupted_run_and_keeps_the_saved_files(
        tiny_corpus_dir, tmp_path):
    """A run stopped at step 2 is resumed; the resumed process is killed (SIGKILL) as its second micro-batch starts,
    inside the first accumulation, before any save of its own; a requeue with --ckpt_path last then ends as the run
    that was never stopped, bitwise, and the files the first run saved are byte for byte what it wrote (the resumed
    run's first micro-batch, still at step 2, used to save step 2 again, one micro-batch on and its gradient gone)."""
    straight, straight_batches, straight_losses = fit(tiny_corpus_dir, str(tmp_path / "straight"))
    runs = str(tmp_path / "stopped")
    fit(tiny_corpus_dir, runs, "--trainer.callbacks+=recorders.StopAt", "--trainer.callbacks.step=2")
    folder = checkpoints(runs, "cable")
    saved = digests(folder)
    assert sorted(saved) == ["last.ckpt", "step0000002.ckpt"]

    env = {**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, TESTS]), "OMP_NUM_THREADS": "1"}
    killed = subprocess.run([sys.executable, "-m", "cable_lightning", "fit", *args(tiny_corpus_dir, runs, steps=4,
                                                                                    every=2),
                             *ACCUMULATE, *RECORD[1:], "--ckpt_path", "last",
                             "--trainer.callbacks+=recorders.KillAt", "--trainer.callbacks.batch=2"],
                            env=env, capture_output=True, text=True, timeout=300)
    assert killed.returncode == -9, killed.stderr[-2000:]
    assert digests(folder) == saved, "the resumed run rewrote a checkpoint it had not trained"

    requeued, batches, losses = fit(tiny_corpus_dir, runs, "--ckpt_path", "last")
    assert requeued.trainer.global_step == 4
    assert batches == straight_batches[4:] and losses == straight_losses[4:]  # steps 3 and 4: 2 micro-batches each
    for (name, p), q in zip(straight.model.named_parameters(), requeued.model.parameters()):
        torch.testing.assert_close(p, q, atol=0, rtol=0, msg=name)
    assert digests(folder)["step0000002.ckpt"] == saved["step0000002.ckpt"]


def test_the_last_step_of_a_fit_is_saved_and_a_finished_run_resumes_to_nothing(tiny_corpus_dir, tmp_path, capsys):
    """max_steps 5 with a checkpoint every 2 steps: last.ckpt holds step 5, the weights the run ended with (before,
    step 4: step 5 was saved nowhere while the records said 5). Resumed again, the finished run says so in one line,
    exits 0, and writes nothing: no new version folder, no record, last.ckpt unchanged."""
    runs = str(tmp_path)
    done, _, _ = fit(tiny_corpus_dir, runs, steps=5)
    folder = checkpoints(runs, "cable")
    last = torch.load(os.path.join(folder, "last.ckpt"), weights_only=True)
    assert last["global_step"] == 5 and sorted(os.listdir(folder)) == ["last.ckpt", "step0000002.ckpt",
                                                                        "step0000004.ckpt"]
    for name, p in done.model.state_dict().items():
        assert torch.equal(last["state_dict"][name], p), name
    assert max(r["step"] for r in jsonl_rows(runs, "cable")) == 5

    saved, versions, rows = digests(folder), sorted(os.listdir(os.path.join(runs, "test", "cable"))), jsonl_rows(
        runs, "cable")
    capsys.readouterr()
    run(["fit", *args(tiny_corpus_dir, runs, steps=5, every=2), *ACCUMULATE, "--ckpt_path", "last"])
    out = capsys.readouterr().out.strip().splitlines()
    assert out[-1] == (f"the run is finished: {os.path.join(folder, 'last.ckpt')} is at step 5 and trainer.max_steps "
                       "is 5; nothing to train (raise --trainer.max_steps to train on, or validate it with the "
                       "validate verb)")
    assert digests(folder) == saved and jsonl_rows(runs, "cable") == rows
    assert sorted(os.listdir(os.path.join(runs, "test", "cable"))) == versions


def progress(ready: int, completed: int) -> dict:
    counts = dict(ready=ready, started=ready, processed=ready, completed=completed)
    return {"total": dict(counts), "current": dict(counts), "is_last_batch": False}


def batch(world: int, micro: int, accumulate: int) -> dict:
    return dict(tokens=world * micro * 32 * accumulate, world_size=world, micro_batch_size=micro, block_size=32,
                accumulate_grad_batches=accumulate)


def test_loop_counters_are_carried_to_another_accumulation_or_the_resume_is_refused():
    """Saved at step 3's last micro-batch by 2 processes without accumulation (completed trails by one, as Lightning
    counts it after the callbacks): on one process with accumulation 2 the same point is micro-batch 6. A count that
    is not a whole number of steps (an epoch that ended inside an accumulation) has no such point: refused, naming
    the layout that resumes it."""
    checkpoint = {"global_step": 3, "global_batch": batch(2, 8, 1),
                  "loops": {"fit_loop": {"epoch_loop.batch_progress": progress(3, 2)}}}
    line = carry_accumulation(checkpoint, batch(1, 8, 2), "ckpt")
    assert line.startswith("resuming step 3 of a run trained with 512 tokens (2 processes x 8 x 32 tokens x "
                           "accumulation 1) as 512 tokens (1 process x 8 x 32 tokens x accumulation 2)")
    assert checkpoint["loops"]["fit_loop"]["epoch_loop.batch_progress"] == progress(6, 5)
    back = carry_accumulation(checkpoint | {"global_batch": batch(1, 8, 2)}, batch(2, 8, 1), "ckpt")
    assert back and checkpoint["loops"]["fit_loop"]["epoch_loop.batch_progress"] == progress(3, 2)

    ragged = {"global_step": 2, "global_batch": batch(1, 8, 2),
              "loops": {"fit_loop": {"epoch_loop.batch_progress": progress(3, 2)}}}
    with pytest.raises(ConfigError, match=r"checkpoint ckpt stands at micro-batch 3, not a whole number of its "
                                          r"optimizer steps of accumulation 2 .* run on 1 process with "
                                          r"--data.micro_batch_size 8"):
        carry_accumulation(ragged, batch(2, 8, 1), "ckpt")
    same = {"global_step": 2, "global_batch": batch(1, 8, 2)}
    assert carry_accumulation(same, batch(1, 8, 2), "ckpt") is None


def test_dropout_draws_depend_on_the_micro_batch_alone_not_on_evaluations_or_a_resume(tiny_corpus_dir, tmp_path):
    """With dropout, a run validated at every checkpoint (steps 2, 4, 6) trains the run validated only at its end,
    and a run resumed at step 4 trains the uninterrupted one, bitwise. Dropout drew from the global generator: an
    evaluation's loader took a draw from it for its workers' seed (so an evaluation schedule changed the training
    run) and a resume reseeded it."""
    dropout = ["--model.init_args.backbone.dropout", "0.1", *RECORD]
    often = main(["fit", *args(tiny_corpus_dir, str(tmp_path / "often"), steps=6, every=2), *dropout])
    once = main(["fit", *args(tiny_corpus_dir, str(tmp_path / "once"), steps=6, every=6), *dropout])
    runs = str(tmp_path / "resumed")
    main(["fit", *args(tiny_corpus_dir, runs, steps=6, every=2), *dropout,  # stopped at 4, the schedule of 6
          "--trainer.callbacks+=recorders.StopAt", "--trainer.callbacks.step=4"])
    resumed = main(["fit", *args(tiny_corpus_dir, runs, steps=6, every=2), *dropout, "--ckpt_path", "last"])
    assert resumed.trainer.global_step == 6
    for (name, p), q, r in zip(often.model.named_parameters(), once.model.parameters(), resumed.model.parameters()):
        torch.testing.assert_close(q, p, atol=0, rtol=0, msg=f"validated once: {name}")
        torch.testing.assert_close(r, p, atol=0, rtol=0, msg=f"resumed: {name}")


# --- a resume is the same experiment: its data folder, corpus and tasks -----------------------------------------------

def with_corpus_hash(source: str, folder, corpus: str) -> str:
    """A copy of the prepared ``source`` whose manifest names ``corpus`` as its content hash."""
    shutil.copytree(source, folder)
    manifest = json.loads((folder / "manifest.json").read_text())
    manifest["source"]["corpus_hash"] = corpus
    (folder / "manifest.json").write_text(json.dumps(manifest))
    return str(folder)


@pytest.fixture
def stopped_run(tiny_corpus_dir, tmp_path):
    """One step of a run on its own copy of the tiny corpus (corpus hash a...), the folder holding the run's files
    listed."""
    data = with_corpus_hash(tiny_corpus_dir, tmp_path / "data", "a" * 64)
    runs = str(tmp_path / "runs")
    main(["fit", *args(data, runs, steps=1, every=1), *RECORD])
    run = os.path.join(runs, "test", "cable")
    return data, runs, run, sorted(os.listdir(run))


def test_the_checkpoint_keeps_its_data_folder_corpus_and_tasks(stopped_run):
    data, _, run, _ = stopped_run
    saved = torch.load(os.path.join(run, "checkpoints", "last.ckpt"), weights_only=True)
    assert saved["run_data"] == {"path": os.path.abspath(data), "corpus_hash": "a" * 64, "tasks": None}


def test_a_resume_on_another_data_folder_is_one_line_before_anything_is_built(stopped_run, tiny_corpus_dir, tmp_path,
                                                                              capsys):
    """It was litdata's 99-line ValueError, after TensorBoard had made a stray version folder."""
    data, runs, run, listed = stopped_run
    other = with_corpus_hash(tiny_corpus_dir, tmp_path / "other", "a" * 64)
    ckpt = os.path.join(run, "checkpoints", "last.ckpt")
    line = user_error_line(capsys, ["fit", *args(other, runs, steps=2, every=1), "--ckpt_path", "last"])
    assert line == (f"error: {ckpt} was trained on data.path {os.path.abspath(data)} and this resume reads {other}: a "
                    "resume continues its run on the same data (its stream position is that folder's); resume with "
                    f"--data.path {os.path.abspath(data)}, or start a new run from its weights "
                    f"(--model.init_args.init_weights {ckpt}, another --experiment)")
    assert sorted(os.listdir(run)) == listed


def test_a_resume_on_a_folder_prepared_again_from_another_corpus_is_refused(stopped_run, capsys):
    """The same path, prepared again: it trained on the new text from the old stream position and recorded the new
    corpus hash for the whole run."""
    data, runs, run, listed = stopped_run
    manifest = json.loads(open(os.path.join(data, "manifest.json")).read())
    manifest["source"]["corpus_hash"] = "b" * 64
    open(os.path.join(data, "manifest.json"), "w").write(json.dumps(manifest))
    ckpt = os.path.join(run, "checkpoints", "last.ckpt")
    line = user_error_line(capsys, ["fit", *args(data, runs, steps=2, every=1), "--ckpt_path", "last"])
    assert line == (f"error: {ckpt} was trained on corpus aaaaaaaaaaaa and {os.path.abspath(data)} holds corpus "
                    "bbbbbbbbbbbb (prepared again from another source?); resume on the corpus it was trained on, or "
                    f"start a new run from its weights (--model.init_args.init_weights {ckpt}, another --experiment)")
    assert sorted(os.listdir(run)) == listed
    line = user_error_line(capsys, ["validate", *args(data, runs), "--ckpt_path", "last"])
    assert "validate measures weights on the corpus they were trained on" in line
    assert sorted(os.listdir(run)) == listed


def test_a_resume_under_another_task_is_refused_before_anything_is_built(stopped_run, capsys):
    """A reverse-string run resumed with duplicate string trained on without a word, and rewrote last.ckpt to say it
    was trained on duplicate string alone; so does a corpus run resumed with a task added."""
    data, runs, run, listed = stopped_run
    ckpt = os.path.join(run, "checkpoints", "last.ckpt")
    line = user_error_line(capsys, ["fit", *args(data, runs, steps=2, every=1), "--ckpt_path", "last",
                                    "--data.tasks", '{"passkey": {}}', "--data.task_fraction", "0.25"])
    assert line.startswith(f"error: {ckpt} was trained on no tasks and this resume asks data.tasks "
                           '{"passkey": {')
    assert line.endswith("a resume continues its run on the same tasks (a score on another would be recorded as that "
                         "task's); resume with no --data.tasks (the run's configs), or start a new run from its "
                         f"weights (--model.init_args.init_weights {ckpt}, another --experiment)")
    assert sorted(os.listdir(run)) == listed


@pytest.mark.parametrize("change, named", [
    (["--model.init_args.lr", "1e-3"], "model.init_args.lr (checkpoint 0.0006, configured 0.001)"),
    (["--model.init_args.warmup_steps", "5"], "model.init_args.warmup_steps (checkpoint 2, configured 5)"),
    (["--trainer.precision", "bf16-mixed"], "trainer.precision (checkpoint '32-true', configured 'bf16-mixed')"),
])
def test_a_resume_that_changes_the_recipe_is_refused_before_anything_is_built(stopped_run, capsys, change, named):
    """A run resumed with another learning rate trained on without a word, and report then showed `cable lr=0.001`
    beside `cable lr=0.0006` with a paired test between one run's later evaluation and its own earlier one; a
    precision change did the same. A longer max_steps is how a run trains on: it resumes."""
    data, runs, run, listed = stopped_run
    ckpt = os.path.join(run, "checkpoints", "last.ckpt")
    line = user_error_line(capsys, ["fit", *args(data, runs, steps=2, every=1), "--ckpt_path", "last", *change])
    assert line.startswith(f"error: {ckpt} was trained by another recipe than this resume gives: {named}; "), line
    assert line.endswith(f"(--model.init_args.init_weights {ckpt}, another --experiment)")
    assert sorted(os.listdir(run)) == listed
    resumed = main(["fit", *args(data, runs, steps=2, every=1), "--ckpt_path", "last", "--trainer.precision", "32"])
    assert resumed.trainer.global_step == 2  # "32" is the checkpoint's 32-true


def test_validate_under_other_model_settings_is_refused_before_its_corpus_is_prepared(stopped_run, tiny_corpus_docs,
                                                                                      tmp_path, capsys):
    """It prepared a whole corpus first, then refused, and left an empty run folder."""
    _, runs, run, listed = stopped_run
    fresh = str(tmp_path / "fresh")
    line = user_error_line(capsys, ["validate", *args(fresh, runs), "--data.source", tiny_corpus_docs[0],
                                    "--data.tokenizer", "bpe:512", "--model.init_args.backbone.n_layer", "3",
                                    "--ckpt_path", "last"])
    assert line == ("error: the checkpoint's model differs from the configured one in settings that define the "
                    "weights: n_layer (checkpoint 2, configured 3); remove them from the command line and the config "
                    "files to use the checkpoint's")
    assert not os.path.exists(fresh) and sorted(os.listdir(run)) == listed


def test_validate_refuses_an_explicit_contiguous_layout_for_randomized_weights(tiny_corpus_dir, tmp_path, capsys):
    """--data.layout.positions contiguous, given for weights trained at randomized positions, was dropped without a
    word (the default layout stands for the trained one; named on the command line, it is a request)."""
    runs = str(tmp_path)
    randomized = ["--model.init_args.backbone.pos_encoding", "rope", "--data.layout.positions", "randomized",
                  "--data.layout.position_range", "256"]
    main(["fit", *args(tiny_corpus_dir, runs, steps=1, every=1), *RECORD, *randomized])
    ckpt = os.path.join(runs, "test", "rope", "checkpoints", "last.ckpt")
    listed = sorted(os.listdir(os.path.join(runs, "test", "rope")))
    refused = (f"error: {ckpt} was trained with data.layout randomized256 and validate asks another: "
               "data.layout.positions (checkpoint 'randomized', configured 'contiguous'), "
               "data.layout.position_range (checkpoint 256, configured None); validate evaluates weights at the "
               "layout they were trained with (its records name that one): drop the --data.layout flags or give "
               "the checkpoint's (--data.layout.positions randomized --data.layout.position_range 256)")
    line = user_error_line(capsys, ["validate", *args(tiny_corpus_dir, runs, pe="rope"), "--ckpt_path", ckpt,
                                    "--data.layout.positions", "contiguous"])
    assert line == refused
    config = tmp_path / "contiguous.yaml"  # the same request from a config file, refused as the flag is
    config.write_text("data:\n  layout:\n    positions: contiguous\n")
    line = user_error_line(capsys, ["validate", "--config", str(config), *args(tiny_corpus_dir, runs, pe="rope"),
                                    "--ckpt_path", ckpt])
    assert line == refused
    assert sorted(os.listdir(os.path.join(runs, "test", "rope"))) == listed


def test_what_a_resume_and_an_evaluation_compare_of_the_data():
    """A resume keeps the folder, corpus and tasks; an evaluation only the corpus (the same corpus from another
    folder, another machine's copy, is fine); a corpus hash unknown on either side and a checkpoint written before
    the data was recorded are not compared."""
    from cable_lightning.lit.resume import check_same_data, data_folder

    saved = {"path": "/data/a", "corpus_hash": "a" * 64, "tasks": None}
    elsewhere = {"path": "/data/b", "corpus_hash": "a" * 64, "tasks": None}
    check_same_data(saved, elsewhere, "validate", "ckpt")
    with pytest.raises(ConfigError, match="was trained on data.path /data/a and this resume reads /data/b"):
        check_same_data(saved, elsewhere, "fit", "ckpt")
    check_same_data(saved, {"path": "/data/a", "corpus_hash": None, "tasks": None}, "fit", "ckpt")
    check_same_data({**saved, "corpus_hash": None}, {"path": "/data/a", "corpus_hash": "b" * 64, "tasks": None},
                    "fit", "ckpt")
    check_same_data(None, {"path": "/other", "corpus_hash": "b" * 64, "tasks": {"passkey": {}}}, "fit", "ckpt")
    with pytest.raises(ConfigError, match="was trained on corpus aaaaaaaaaaaa and /data/b holds corpus bbbbbbbbbbbb"):
        check_same_data(saved, {**elsewhere, "corpus_hash": "b" * 64}, "test", "ckpt")
    assert data_folder("s3://bucket/prefix") == "s3://bucket/prefix" and data_folder(None) is None
