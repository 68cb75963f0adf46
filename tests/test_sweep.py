"""The sweep verb (sweep.py): one command per encoding, seed, length and learning rate, printed or run."""

import argparse
import os
import subprocess
import sys

import pytest
import torch
import yaml
from conftest import ROOT, TESTS, args, checkpoints

from cable_lightning import sweep
from cable_lightning.cli import main
from cable_lightning.positional.registry import available, encoding_from, from_label


@pytest.mark.parametrize("pe", available())
def test_every_encodings_sweep_command_parses_to_that_encoding(pe, capsys):
    """The sweep's --model.init_args.backbone.pos_encoding argument, read back by the CLI, is the encoding itself
    (an unset setting once reached it as the string 'None')."""
    (_, cmd), = sweep.commands(argparse.Namespace(config=["configs/quickstart.yaml"], pes=[pe], seeds=None,
                                                  train_lengths=None, lrs=None, experiment="x", runs_dir="runs",
                                                  extra=[],
                                                  stage="fit"))
    with pytest.raises(SystemExit):
        main(cmd[cmd.index("fit"):] + ["--print_config"])
    printed = yaml.safe_load(capsys.readouterr().out)["model"]["init_args"]["backbone"]["pos_encoding"]
    assert encoding_from(printed) == from_label(pe)


def test_sweep_prints_one_command_per_encoding_and_seed(capsys):
    sweep.main(["--config", "c.yaml", "--pes", "cable", "alibi", "--seeds", "0", "1", "2", "--print_only"])
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 6
    assert sum("--seed_everything 2 --folder_per_seed true" in line for line in lines) == 2
    # seed-major: a sweep stopped after its first two runs has both encodings at seed 0
    assert all("--seed_everything 0 " in line for line in lines[:2]) and "alibi" in lines[1]


def test_seed_in_an_override_is_each_runs_seed(capsys):
    """A stage that starts from each seed's earlier run names its weights once: {seed} becomes the run's seed."""
    sweep.main(["--config", "c.yaml", "--pes", "rope", "--seeds", "0", "2", "--print_only", "--",
                "--model.init_args.init_weights", "runs/e/rope/seed{seed}/checkpoints/last.ckpt"])
    lines = capsys.readouterr().out.splitlines()
    assert [line.endswith(f"--model.init_args.init_weights runs/e/rope/seed{n}/checkpoints/last.ckpt")
            for line, n in zip(lines, (0, 2))] == [True, True]


def test_the_retrieval_stage_needs_a_retrieval_set(capsys, tmp_path):
    with pytest.raises(SystemExit):
        sweep.main(["--config", "c.yaml", "--pes", "cable", "--stage", "retrieval", "--retrieval_set", str(tmp_path),
                    "--retrieval_lengths", "64", "--print_only"])
    assert f"--stage retrieval needs --retrieval_set, a folder from python -m cable_lightning retrieval-set; " \
           f"got '{tmp_path}'" in capsys.readouterr().err


def test_the_retrieval_settings_read_from_a_file_are_the_flags_and_flags_override_them(tmp_path, capsys):
    """A --retrieval_config file's keys are the flags' names; its settings go through the sweep's own parser (and its
    checks), and a flag on the command line wins over the file."""
    retrieval_set = tmp_path / "set"
    retrieval_set.mkdir()
    (retrieval_set / "train_pairs.jsonl").write_text("")
    settings = tmp_path / "retrieval.yaml"
    settings.write_text(yaml.safe_dump({"retrieval_set": str(retrieval_set), "retrieval_lengths": [64, 128],
                                        "finetune_steps": 800, "finetune_lr": 5e-4, "finetune_mini_batch": None}))
    base = ["--config", "c.yaml", "--pes", "cable", "--stage", "retrieval", "--print_only"]
    flags = ["--retrieval_set", str(retrieval_set), "--retrieval_lengths", "64", "128", "--finetune_steps", "800",
             "--finetune_lr", "5e-4"]
    assert sweep.commands(sweep.parse_args([*base, "--retrieval_config", str(settings)])) == \
        sweep.commands(sweep.parse_args([*base, *flags]))
    overridden = sweep.parse_args([*base, "--retrieval_config", str(settings), "--finetune_steps", "5",
                                   "--retrieval_lengths", "32"])
    assert (overridden.finetune_steps, overridden.retrieval_lengths, overridden.finetune_lr) == (5, [32], 5e-4)
    for text, said in [("finetune_stepz: 3\n", f"--retrieval_config {settings}: unknown setting 'finetune_stepz'; "
                                                "valid: retrieval_set, retrieval_lengths, finetune_steps, "
                                                "finetune_batch, finetune_lr, finetune_mini_batch"),
                       ("finetune_steps: many\n", "argument --finetune_steps: invalid int value: 'many'"),
                       ("[1, 2]\n", f"--retrieval_config {settings} holds [1, 2], not a mapping of retrieval "
                                    "settings")]:
        settings.write_text(text)
        with pytest.raises(SystemExit):
            sweep.parse_args([*base, "--retrieval_config", str(settings)])
        err = capsys.readouterr().err
        assert err.startswith(f"error: {said}") and err.count("\n") == 1, err


@pytest.mark.parametrize("signame, group, status", [("SIGINT", True, 130), ("SIGTERM", False, 143)])
def test_a_stopped_sweep_saves_its_fits_step_and_the_same_sweep_continues(tiny_corpus_dir, tmp_path, signame, group,
                                                                         status):
    """A Ctrl-C at the terminal (SIGINT to the sweep's process group) or a SIGTERM to the sweep's pid alone reaches the
    running fit once: it saves last.ckpt one step after the signal (no periodic checkpoint before the end), the sweep
    exits with the fit's status and one line, and the same sweep again finishes the run (checked after Ctrl-C)."""
    base = tmp_path / "base.yaml"
    base.write_text("trainer:\n  accelerator: cpu\n")
    runs = str(tmp_path / "runs")
    sweep = [sys.executable, "-m", "cable_lightning", "sweep", "--config", str(base), "--pes", "cable",
             "--experiment", "test", "--runs_dir", runs, "--",
             *args(tiny_corpus_dir, runs, steps=8, every=100)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, TESTS]), "OMP_NUM_THREADS": "1"}
    signalled = ["--trainer.callbacks+=recorders.SignalSweepAt", "--trainer.callbacks.step=3",
                 f"--trainer.callbacks.signame={signame}", f"--trainer.callbacks.group={str(group).lower()}"]
    done = subprocess.run(sweep + signalled, env=env, capture_output=True, text=True, timeout=300,
                          start_new_session=True)  # its own process group, as a terminal's foreground job
    assert done.returncode == status, done.stderr[-3000:]
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith(f"error: the sweep was stopped by {signame}, and so was its run "), last
    assert f"(exit status {status}," in last and "Traceback" not in done.stderr
    saved = os.path.join(checkpoints(runs, "cable"), "last.ckpt")
    # the signal arrives in step 4; the fit saves at the end of the step after it (PreemptionCheckpoint)
    assert torch.load(saved, weights_only=True)["global_step"] == 5
    if signame == "SIGTERM":
        return  # continuing is the same after either signal: once is enough
    again = subprocess.run(sweep, env=env, capture_output=True, text=True, timeout=300, start_new_session=True)
    assert again.returncode == 0, again.stderr[-3000:]
    assert torch.load(saved, weights_only=True)["global_step"] == 8
