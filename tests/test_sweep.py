"""The sweep verb (sweep.py): one command per encoding, seed, length and learning rate, printed or run."""

import argparse

import pytest
import yaml

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


def test_the_retrieval_stage_needs_a_retrieval_set(capsys, tmp_path):
    with pytest.raises(SystemExit):
        sweep.main(["--config", "c.yaml", "--pes", "cable", "--stage", "retrieval", "--retrieval_set", str(tmp_path),
                    "--retrieval_lengths", "64", "--print_only"])
    assert f"--stage retrieval needs --retrieval_set, a folder from python -m cable_lightning retrieval-set; " \
           f"got '{tmp_path}'" in capsys.readouterr().err
