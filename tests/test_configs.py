"""Every shipped config composes and parses (base + strategy preset + an encoding); the paper's
global batch turns into the paper's micro-batches without remainder."""

import glob
import os

import pytest
import yaml

from cable_lightning.cli import accumulation_steps, main

ROOT = os.path.join(os.path.dirname(__file__), "..")
BASES = (sorted(glob.glob(os.path.join(ROOT, "configs", "paper", "*.yaml")))
         + [os.path.join(ROOT, "configs", "quickstart.yaml")])
TRAINERS = sorted(glob.glob(os.path.join(ROOT, "configs", "trainer", "*.yaml")))


@pytest.mark.parametrize("base", BASES, ids=os.path.basename)
@pytest.mark.parametrize("trainer", TRAINERS, ids=os.path.basename)
def test_configs_compose_and_parse(base, trainer, capsys):
    with pytest.raises(SystemExit) as done:
        main(["fit", "--config", base, "--config", trainer, "--model.init_args.backbone.pos_encoding", "alibi",
              "--print_config"])
    assert done.value.code in (None, 0)
    config = yaml.safe_load(capsys.readouterr().out)
    assert config["model"]["init_args"]["backbone"]["pos_encoding"]["class_path"].rpartition(".")[2] == "alibi"
    assert config["trainer"]["devices"] == yaml.safe_load(open(trainer))["trainer"]["devices"]


@pytest.mark.parametrize("name,micro,accumulate", [("gpt2_tiny_fineweb", 64, 1), ("gpt2_small_fineweb", 32, 2),
                                                   ("gpt2_medium_fineweb", 16, 4), ("gpt2_small_fineweb_dape", 16, 8)])
def test_paper_global_batch_on_eight_gpus(name, micro, accumulate):
    config = yaml.safe_load(open(os.path.join(ROOT, "configs", "paper", f"{name}.yaml")))
    assert config["data"]["micro_batch_size"] == micro
    assert accumulation_steps(config["global_batch_tokens"], micro, config["data"]["block_size"], 8) == accumulate
