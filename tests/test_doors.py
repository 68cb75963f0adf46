"""Every door answers a mistake in one line with exit status 2 (1 for a run that failed), never a traceback or the
usage text; and no old module entry point exits 0 having done nothing (docs/faults.md)."""

import json
import os
import re
import runpy
import subprocess
import sys
import warnings

import pytest
from conftest import ROOT, ROW, args, one_error_line, only_line, tool, user_error_line

from cable_lightning.__main__ import COMMANDS
from cable_lightning.__main__ import main as verbs
from cable_lightning.cli import main as fit

# --- argparse verbs ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("seed", ["one", "-1"])
def test_a_bad_sweep_seed_is_one_line_before_anything_runs(capsys, seed):
    assert only_line(capsys, ["sweep", "--config", "c.yaml", "--pes", "cable", "--seeds", "0", seed]) == (
        f"error: argument --seeds: a seed is an integer from 0 to 4294967295, got {seed!r} (python -m cable_lightning "
        "sweep --help lists the settings)")


@pytest.mark.parametrize("argv, given, spelt", [
    (["sweep", "--config", "c.yaml", "--runs-dir", "X", "--pes", "cable", "--print_only"], "--runs-dir", "--runs_dir"),
    (["export", "--ckpt-path=missing.ckpt", "--out", "x"], "--ckpt-path", "--ckpt_path"),
], ids=["sweep", "export"])
def test_an_option_spelt_with_dashes_is_taken_with_a_note_naming_its_underscores(capsys, argv, given, spelt):
    """Every verb spells its options as fit does (``--runs_dir``); sweep's earlier ``--runs-dir`` still works and says
    the spelling. Unknown, it had sweep's remainder take the rest of the line, and --pes was reported missing."""
    try:
        verbs(argv)
    except SystemExit:  # export goes on to refuse the missing checkpoint, named by the path it was given
        pass
    out, err = capsys.readouterr()
    assert err.splitlines()[0] == f"note: {given} is spelt {spelt}; the dashed spelling still works", err
    assert ("--runs_dir X " in out) if argv[0] == "sweep" else ("missing.ckpt does not exist" in err)


@pytest.mark.parametrize("workers", ["0", "-1"])
def test_prepare_refuses_a_number_of_workers_below_one_before_any_work(tmp_path, capsys, workers):
    """0 silently meant all cores and -1 silently meant one worker."""
    (tmp_path / "doc.txt").write_text("a document")
    out = tmp_path / "out"
    assert only_line(capsys, ["prepare", "--source", str(tmp_path / "doc.txt"), "--out", str(out), "--num_workers",
                              workers]) == (
        f"error: --num_workers must be a positive number of tokenizing processes, got {workers}; leave it out to use "
        "every core")
    assert not out.exists()


@pytest.mark.parametrize("verb, default", [("prepare", "python-docs corpus"), ("bench", "full benchmark")])
def test_help_says_what_a_verb_without_arguments_does(capsys, verb, default):
    with pytest.raises(SystemExit):
        verbs([verb, "--help"])
    out = " ".join(capsys.readouterr().out.split())  # help text is wrapped to the terminal
    assert "With no arguments it" in out and default in out, out


def closed_pipe(monkeypatch) -> None:
    """stdout is a pipe whose reader went away (``... | true``), buffered as Python buffers a pipe."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    monkeypatch.setattr(sys, "stdout", open(write_end, "w"))


def test_a_reader_that_goes_away_ends_report_quietly(tmp_path, monkeypatch, capsys):
    """``report ... | true``: the pipe is closed before report writes its table."""
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "length_eval.jsonl").write_text(json.dumps(ROW) + "\n")
    closed_pipe(monkeypatch)
    with pytest.raises(SystemExit) as stop:
        verbs(["report", str(tmp_path / "run"), "--out", str(tmp_path / "report")])
    assert stop.value.code == 128 + 13 and capsys.readouterr().err == ""  # 128 + SIGPIPE, as a shell reports it


@pytest.mark.parametrize("argv", [["--help"], ["gpu-check", "--help"]], ids=["verbs", "a-verb"])
def test_a_reader_that_goes_away_ends_help_quietly_too(monkeypatch, capsys, argv):
    """``python -m cable_lightning --help | true`` was a BrokenPipeError traceback (exit 1); a verb's ``--help`` exited
    0 having lost its text (argparse drops the write's error)."""
    closed_pipe(monkeypatch)
    with pytest.raises(SystemExit) as stop:
        verbs(argv)
    assert stop.value.code == 128 + 13 and capsys.readouterr().err == ""


@pytest.mark.parametrize("door", ["unknown-flag", "unwritable-out", "missing-data"])
def test_gpu_check_answers_a_bad_flag_out_or_data_path_in_one_line_before_any_work(tmp_path, capsys, door):
    """The last argparse verb with the usage text; an --out that cannot be made was an 18-line traceback, and a
    missing --data_path ran the bench, then failed every fit with a cut-off line."""
    missing, out = str(tmp_path / "nosuch"), str(tmp_path / "gc.md")
    argv, expected = {
        "unknown-flag": (["--bogus"], re.escape("error: unrecognized arguments: --bogus (python -m cable_lightning "
                                                "gpu-check --help lists the settings)")),
        "unwritable-out": (["--out", "/proc/x/gc.md"],
                           r"error: --out /proc/x/gc\.md cannot be written \(\w+Error: .+\); choose another --out"),
        "missing-data": (["--data_path", missing, "--out", out], re.escape(
            f"error: --data_path {missing}: no prepared data at {missing}; run python -m cable_lightning prepare "
            f"--source <source> --tokenizer <tokenizer> --out {missing} --overwrite")),
    }[door]
    line = only_line(capsys, ["gpu-check", "--rehearse_on_cpu", *argv])
    assert re.fullmatch(expected, line), line
    assert not os.path.exists(out)


def test_a_missing_retrieval_set_source_is_one_line(tiny_corpus_dir, tmp_path, capsys):
    missing = str(tmp_path / "nosuch.jsonl")
    assert only_line(capsys, ["retrieval-set", "--source", missing, "--tokenizer",
                              os.path.join(tiny_corpus_dir, "tokenizer.json"), "--out", str(tmp_path / "set")]) == (
        f"error: --source {missing}: no .txt/.jsonl/.parquet files match {missing!r}; valid sources: python-docs, "
        "python-code[:dist,...], fineweb-edu[:config], wikitext-103, or a path/dir/glob of .txt/.jsonl/.parquet files")


def test_retrieval_refuses_a_missing_model_or_an_export_without_its_code(tmp_path, capsys):
    assert only_line(capsys, ["retrieval", "finetune", "--model", str(tmp_path / "nope"), "--triples", "t.jsonl",
                              "--out", str(tmp_path / "out")]) == (
        f"error: --model {tmp_path / 'nope'} is not a folder; give an encoder folder written by `python -m "
        "cable_lightning export`")
    export = tmp_path / "export"  # an export whose cable_core/ was deleted
    export.mkdir()
    (export / "config.json").write_text(json.dumps({"core_files": ["__init__.py"], "backbone": {}}))
    assert only_line(capsys, ["retrieval", "evaluate", "--models", f"a={export}", "--lengths", "8", "--mldr", "--out",
                              str(tmp_path / "out"), "--trust_remote_code"]) == (
        f"error: {export} is not a complete export: its cable_core/ folder (the model's code) is missing; export the "
        "checkpoint again")


def test_a_torn_row_in_a_local_lm_eval_task_is_named_before_the_model_loads(tmp_path, capsys):
    pytest.importorskip("lm_eval")
    from conftest import write_task

    write_task(tmp_path)
    rows = (tmp_path / "docs.jsonl").read_text().splitlines()
    (tmp_path / "docs.jsonl").write_text("\n".join([rows[0], rows[1][:25], rows[2]]) + "\n")  # a torn second row
    line = only_line(capsys, ["lm-eval", "--model", str(tmp_path / "never-loaded"), "--tasks", "tiny_mc",
                              "--include_path", str(tmp_path), "--only_include_path", "--out", str(tmp_path / "out")])
    assert line.startswith(f"error: {tmp_path / 'docs.jsonl'}:2: not a JSON row (Unterminated string"), line
    assert line.endswith("task tiny_mc cannot read its data: fix or remove that line"), line


def test_a_local_lm_eval_row_without_its_label_is_named_before_the_model_loads(tmp_path, capsys):
    """The harness scored it (the target rendered as None), its warning among its log lines."""
    pytest.importorskip("lm_eval")
    from conftest import DOCS, write_task

    write_task(tmp_path)
    rows = [{key: value for key, value in doc.items() if key != "label" or i != 1} for i, doc in enumerate(DOCS)]
    (tmp_path / "docs.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    line = only_line(capsys, ["lm-eval", "--model", str(tmp_path / "never-loaded"), "--tasks", "tiny_mc",
                              "--include_path", str(tmp_path), "--only_include_path", "--out", str(tmp_path / "out")])
    assert line == (f"error: {tmp_path / 'docs.jsonl'}:2: the row has no 'label'; task tiny_mc reads its label from it "
                    "(doc_to_target '{{label}}'), and the harness would score the row without one: give the row its "
                    "label or remove that line")


@pytest.mark.parametrize("label", [9, -1])
def test_a_local_lm_eval_row_whose_label_is_outside_its_choices_is_named_before_the_model_loads(tmp_path, capsys,
                                                                                               label):
    """A label of 9 among 3 choices was scored, the harness's warning buried among its log lines."""
    pytest.importorskip("lm_eval")
    from conftest import DOCS, write_task

    write_task(tmp_path)
    rows = [{**doc, "label": label} if i == 2 else doc for i, doc in enumerate(DOCS)]
    (tmp_path / "docs.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    line = only_line(capsys, ["lm-eval", "--model", str(tmp_path / "never-loaded"), "--tasks", "tiny_mc",
                              "--include_path", str(tmp_path), "--only_include_path", "--out", str(tmp_path / "out")])
    shown = repr(label) if label >= 0 else repr(str(label))  # "-1" is not a digit: the harness reads it as text
    assert line == (f"error: {tmp_path / 'docs.jsonl'}:3: label {shown} is not one of the row's 2 choices (an index "
                    "from 0 to 1 or a choice's text); task tiny_mc would score the row against no answer: fix its "
                    "label or remove that line")


def test_a_missing_lm_eval_task_file_is_named_before_the_model_loads(tmp_path, capsys):
    """The harness's own report was a 57-line traceback from datasets, after the model had loaded."""
    pytest.importorskip("lm_eval")
    from conftest import write_task

    write_task(tmp_path)
    (tmp_path / "docs.jsonl").unlink()
    line = only_line(capsys, ["lm-eval", "--model", str(tmp_path / "never-loaded"), "--tasks", "tiny_mc",
                              "--include_path", str(tmp_path), "--only_include_path", "--out", str(tmp_path / "out")])
    assert line == (
        f"error: {tmp_path / 'docs.jsonl'} is not a file; task tiny_mc reads its data from it (its YAML's "
        "dataset_kwargs.data_files): restore the file or fix the path")


@pytest.mark.parametrize("flag, values, repeated", [("--seeds", ["1", "1"], "1"), ("--pes", ["cable", "rope", "cable"],
                                                                                      "cable")])
def test_a_sweep_refuses_a_run_given_twice(capsys, flag, values, repeated):
    """``--seeds 1 1`` planned the same fit twice (the second continuing the first's folder)."""
    argv = ["sweep", "--config", "c.yaml", "--pes", "cable", "--print_only", flag, *values]
    assert only_line(capsys, argv) == f"error: {flag} names {repeated} twice: each is one run; give it once"


def test_a_lock_with_a_bad_line_is_named_with_its_line(tmp_path):
    lock = tmp_path / "bad.lock"
    lock.write_text("# a lock\nabsl-py==2.5.1\naccelerate=1.15.0\n")  # pip could not read the third line
    done = subprocess.run(["bash", os.path.join(ROOT, "tools", "install.sh")], capture_output=True, text=True,
                          env={**os.environ, "CABLE_LOCK": str(lock)})
    assert done.returncode == 2 and done.stdout == "", done.stdout
    assert done.stderr.splitlines() == [f"error: {lock}:3: accelerate=1.15.0 is not a pin (name==version); fix that "
                                        "line, or write the lock again with bash tools/lock.sh update"]


# --- fit, validate, test ----------------------------------------------------------------------------------------------

def test_a_config_file_that_is_not_yaml_is_named_with_its_line(tmp_path, capsys):
    """YAML's own report, over four lines, named ``"<unicode string>", line 5``: not which of the --config files."""
    good, bad = tmp_path / "good.yaml", tmp_path / "bad.yaml"
    good.write_text("experiment: fine\n")
    bad.write_text("data:\n  block_size: 32\n  micro_batch_size: 4\ntrainer:\n  max_steps: [1, 2\n")
    line = user_error_line(capsys, ["fit", "--config", str(good), "--config", str(bad), "--config", str(good)])
    assert line == (f"error: {bad}:6: not valid YAML: did not find expected ',' or ']' (while parsing a flow sequence "
                    "at line 5, column 14)")


def test_a_misspelt_precision_is_one_line_and_lightning_is_not_given_argv_twice(monkeypatch, capsys):
    """From the command line, LightningCLI reads sys.argv itself: given it as ``args`` too, it warns on every run."""
    monkeypatch.setattr(sys, "argv", ["cable_lightning", "fit", "--trainer.precision", "bf16-mixd"])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        line = one_error_line(capsys, verbs)
    assert line == ("error: unknown value 'bf16-mixd' for trainer.precision; choose one of 64, 32, 16, "
                    "transformer-engine, transformer-engine-float16, 16-true, 16-mixed, bf16-true, bf16-mixed, "
                    "32-true, 64-true, bf16")
    assert not [w for w in caught if "args parameter" in str(w.message)]


@pytest.mark.parametrize("setting, value, expected", [
    ("--seed_everything", "-1", "error: seed_everything -1 is out of range: a seed is an integer from 0 to 4294967295 "
                                "(true: a random one, false: none)"),
    ("--seed_everything", "one", "error: invalid value 'one' for seed_everything; expected bool or int"),
    ("--data.tasks", '{"needle": 3}', "error: task needle: settings must be a mapping ({setting: value}), got 3; its "
                                      "settings: keys, value_tokens"),
    ("--data.tasks", "[1,2]", "error: invalid value '[1, 2]' for data.tasks; expected a mapping or null"),
    ("--throughput.warmup", "one", "error: invalid value 'one' for throughput.warmup; expected int"),
], ids=["negative-seed", "word-seed", "task-settings", "tasks-not-a-mapping", "word-for-an-int"])
def test_a_bad_seed_or_task_setting_is_one_line_before_anything_runs(tiny_corpus_dir, tmp_path, capsys, setting, value,
                                                                      expected):
    assert user_error_line(capsys, ["fit", *args(tiny_corpus_dir, str(tmp_path)), setting, value]) == expected
    assert not os.path.exists(tmp_path / "test")  # no run folder: nothing ran


@pytest.mark.parametrize("setting, value, expected", [
    ("--model.init_args.backbone.causal", "true",
     "error: MaskedLM needs a bidirectional backbone; backbone.causal is set to true over preset 'bert-base', which is "
     "bidirectional (drop it or set backbone.causal: false)"),
    ("--data.tasks", '{"passkey": null}',
     "error: task passkey is written in text and needs a prepared corpus's tokenizer, but data.path is null (the "
     "tasks' own vocabulary has no text); point data.path at a prepared corpus, or leave passkey out of data.tasks"),
], ids=["causal-set", "passkey-without-corpus"])
def test_the_encoder_task_config_names_the_setting_at_fault(tmp_path, capsys, setting, value, expected):
    """With configs/tasks/encoder.yaml, these blamed the preset ("preset 'bert-base' is causal") and data.block_size
    (for a missing corpus)."""
    configs = [arg for name in ("base", "encoder") for arg in ("--config", os.path.join(ROOT, "configs", "tasks",
                                                                                          f"{name}.yaml"))]
    argv = ["fit", *configs, "--data.tasks", '{"needle": {}}', "--runs_dir", str(tmp_path), setting, value]
    assert user_error_line(capsys, argv) == expected
    assert os.listdir(tmp_path) == []


def test_a_refused_resume_leaves_no_version_folder(tiny_corpus_dir, tmp_path, capsys):
    """Refused in the checkpoint's restore, after TensorBoard made ``version_1`` and wrote the config into it."""
    fit(["fit", *args(tiny_corpus_dir, str(tmp_path), steps=1, every=1)])
    line = user_error_line(capsys, ["fit", *args(tiny_corpus_dir, str(tmp_path), steps=2, every=1), "--ckpt_path",
                                    "last", "--data.micro_batch_size", "2"])
    assert "resume with --global_batch_tokens 128" in line
    assert sorted(os.listdir(tmp_path / "test" / "cable")) == ["checkpoints", "checkpoints.lock", "version_0"]


def test_a_full_disk_under_tensorboard_is_one_line(tiny_corpus_dir, tmp_path, capsys, monkeypatch):
    """TensorBoard writes its events in a thread: the thread's traceback came first, then the run's own."""
    from tensorboard.summary.writer.record_writer import RecordWriter

    def disk_full(self, data):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(RecordWriter, "write", disk_full)
    line = user_error_line(capsys, ["fit", *args(tiny_corpus_dir, str(tmp_path), steps=2, every=2)], status=1)
    assert line.startswith(f"error: could not write the logs in {tmp_path / 'test' / 'cable' / 'version_0'} (OSError: "
                           "[Errno 28] No space left on device; "), line
    assert line.endswith("the checkpoints written before it are intact"), line


CHOMSKY = [*(arg for name in ("base", "reverse_string") for arg in ("--config", os.path.join(ROOT, "configs", "chomsky",
                                                                                           f"{name}.yaml"))),
           "--model.init_args.backbone.pos_encoding", "rope", "--model.init_args.backbone.n_layer", "1",
           "--data.micro_batch_size", "2", "--data.eval_tokens", "64", "--task_eval.lengths", "[5]",
           "--task_eval.trials", "1", "--diagnostics.enabled", "false", "--trainer.enable_progress_bar", "false",
           "--trainer.enable_model_summary", "false"]


@pytest.fixture(scope="module")
def reverse_string_run(tmp_path_factory) -> str:
    """One step of a one-layer reverse-string encoder (tasks alone, contiguous positions)."""
    runs = str(tmp_path_factory.mktemp("chomsky"))
    fit(["fit", *CHOMSKY, "--runs_dir", runs, "--trainer.max_steps", "1", "--checkpoint.every_n_train_steps", "1"])
    return runs


@pytest.mark.parametrize("asked, expected", [
    (["--data.layout.positions", "randomized", "--data.layout.position_range", "256"],
     "was trained with data.layout the default (packed blocks, contiguous positions) and validate asks another: "
     "data.layout.positions (checkpoint 'contiguous', configured 'randomized'), data.layout.position_range (checkpoint "
     "None, configured 256); validate evaluates weights at the layout they were trained with (its records name that "
     "one): drop the --data.layout flags or give the checkpoint's (--data.layout.positions contiguous "
     "--data.layout.position_range null)"),
    (["--data.tasks", '{"duplicate_string": {}}'],
     'was trained on tasks alone, {"reverse_string": {}}, and validate asks data.tasks {"duplicate_string": {}}: '
     "weights trained on tasks alone are scored only on those (a score on another would be recorded as that task's); "
     """give --data.tasks '{"reverse_string": {}}' (the run's configs)"""),
], ids=["randomized-positions", "another-task"])
def test_validate_refuses_another_layout_or_task_than_the_checkpoint_was_trained_with(reverse_string_run, capsys,
                                                                                      asked, expected):
    """Both were accepted: randomized positions asked of contiguous weights changed nothing (evaluation reads the
    trained layout), and the reverse-string weights were recorded as a duplicate-string score."""
    run_folder = os.path.join(reverse_string_run, "chomsky-reverse_string", "rope")
    ckpt, folders = os.path.join(run_folder, "checkpoints", "last.ckpt"), sorted(os.listdir(run_folder))
    line = user_error_line(capsys, ["validate", *CHOMSKY, "--runs_dir", reverse_string_run, "--ckpt_path", ckpt,
                                    *asked])
    assert line == f"error: {ckpt} {expected}"
    assert sorted(os.listdir(run_folder)) == folders  # refused before anything was built: no version folder


def test_a_resume_under_another_task_is_refused_before_anything_is_built(reverse_string_run, capsys):
    """A reverse-string run at step 1 resumed with duplicate string trained steps 2-3 on it without a word, recorded
    a duplicate-string score for weights trained on reverse string and rewrote last.ckpt to say so."""
    run_folder = os.path.join(reverse_string_run, "chomsky-reverse_string", "rope")
    ckpt, folders = os.path.join(run_folder, "checkpoints", "last.ckpt"), sorted(os.listdir(run_folder))
    line = user_error_line(capsys, ["fit", *CHOMSKY, "--runs_dir", reverse_string_run, "--trainer.max_steps", "3",
                                    "--checkpoint.every_n_train_steps", "1", "--ckpt_path", "last",
                                    "--data.tasks", '{"duplicate_string": {}}'])
    assert line.startswith(f'error: {ckpt} was trained on {{"reverse_string": {{')
    assert 'this resume asks data.tasks {"duplicate_string": {' in line
    assert line.endswith("""resume with --data.tasks '{"reverse_string": {}}' (the run's configs), or start a new """
                         f"run from its weights (--model.init_args.init_weights {ckpt}, another --experiment)")
    assert sorted(os.listdir(run_folder)) == folders


def test_validate_with_a_checkpoint_alone_names_the_config_the_run_saved(reverse_string_run, capsys):
    """It said ``validate.model`` was required, with no word of the run's configs; the advice given works."""
    run_folder = os.path.join(reverse_string_run, "chomsky-reverse_string", "rope")
    ckpt, saved = (os.path.join(run_folder, *parts) for parts in (("checkpoints", "last.ckpt"),
                                                                   ("version_0", "config.yaml")))
    assert user_error_line(capsys, ["validate", "--ckpt_path", ckpt]) == (
        "error: validate needs the run's configs as well as --ckpt_path (the checkpoint holds the model's settings, "
        f"not the data section or the trainer's); the run saved its config in {saved}: python -m cable_lightning "
        f"validate --config {saved} --ckpt_path {ckpt}")
    fit(["validate", "--config", saved, "--ckpt_path", ckpt])
    assert os.path.isfile(os.path.join(run_folder, "version_1", "task_accuracy.jsonl"))


# --- old module entry points ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("module", sorted({module for module, _ in COMMANDS.values()}))
def test_a_verbs_module_run_as_a_program_names_the_verb_that_replaced_it(module, capsys):
    with warnings.catch_warnings(), pytest.raises(SystemExit) as stop:
        warnings.simplefilter("ignore", RuntimeWarning)  # runpy's: the module is imported already, in this process
        runpy.run_module(module, run_name="__main__")
    verbs_of = [f"'python -m cable_lightning {verb}'" for verb, (name, _) in COMMANDS.items() if name == module]
    assert stop.value.code == 2
    assert capsys.readouterr().err == f"error: python -m {module} was replaced by {' or '.join(verbs_of)}\n"


def test_an_old_entry_point_run_by_python_fails_in_one_line(tmp_path):
    """As a script or job array runs it (the command an error line of the last release advised)."""
    out = tmp_path / "prepared"
    done = tool("-m", "cable_lightning.data.prepare", "--source", "python-docs", "--tokenizer", "bpe:4096", "--out",
                str(out))
    assert done.returncode == 2 and not out.exists()
    assert done.stderr == ("error: python -m cable_lightning.data.prepare was replaced by 'python -m cable_lightning "
                           "prepare'\n")
    # runpy warns first when the package imported the module it runs: the hf package must not import export itself
    loaded = tool("-c", "import sys, cable_lightning.hf; print('cable_lightning.hf.export' in sys.modules)")
    assert loaded.stdout == "False\n", loaded.stderr
