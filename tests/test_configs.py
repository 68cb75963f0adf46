"""Every shipped config composes and parses (base + PE override + strategy preset); the paper's
global batch turns into the paper's micro-batches without remainder."""

import glob
import os

import pytest
import yaml

from cable_lightning.cli import accumulation_steps, main
from cable_lightning.positional import available

ROOT = os.path.join(os.path.dirname(__file__), "..")
BASES = (sorted(glob.glob(os.path.join(ROOT, "configs", "paper", "*.yaml")))
         + [os.path.join(ROOT, "configs", "quickstart.yaml")])
TRAINERS = sorted(glob.glob(os.path.join(ROOT, "configs", "trainer", "*.yaml")))


def test_one_pe_override_per_encoding_and_the_dape_overlay():
    names = sorted(os.path.basename(p)[:-5] for p in glob.glob(os.path.join(ROOT, "configs", "pe", "*.yaml")))
    assert names == sorted(available() + ["dape_v2"])


def test_the_dape_overlay_composes_with_the_pe_before_it(capsys):
    pe = os.path.join(ROOT, "configs", "pe", "kerple_log.yaml")
    dape = os.path.join(ROOT, "configs", "pe", "dape_v2.yaml")
    with pytest.raises(SystemExit):
        main(["fit", "--config", os.path.join(ROOT, "configs", "quickstart.yaml"), "--config", pe, "--config", dape,
              "--print_config"])
    backbone = yaml.safe_load(capsys.readouterr().out)["model"]["init_args"]["backbone"]
    assert (backbone["pos_encoding"], backbone["dape"], backbone["dape_width"]) == ("kerple_log", "v2", 32)


@pytest.mark.parametrize("base", BASES, ids=os.path.basename)
@pytest.mark.parametrize("trainer", TRAINERS, ids=os.path.basename)
def test_configs_compose_and_parse(base, trainer, capsys):
    pe = os.path.join(ROOT, "configs", "pe", "alibi.yaml")
    with pytest.raises(SystemExit) as done:
        main(["fit", "--config", base, "--config", pe, "--config", trainer, "--print_config"])
    assert done.value.code in (None, 0)
    config = yaml.safe_load(capsys.readouterr().out)
    assert config["model"]["init_args"]["backbone"]["pos_encoding"] == "alibi"
    assert config["trainer"]["devices"] == yaml.safe_load(open(trainer))["trainer"]["devices"]


@pytest.mark.parametrize("name,micro,accumulate", [("gpt2_tiny_fineweb", 64, 1), ("gpt2_small_fineweb", 32, 2),
                                                   ("gpt2_medium_fineweb", 16, 4), ("gpt2_small_fineweb_dape", 16, 8)])
def test_paper_global_batch_on_eight_gpus(name, micro, accumulate):
    config = yaml.safe_load(open(os.path.join(ROOT, "configs", "paper", f"{name}.yaml")))
    assert config["data"]["micro_batch_size"] == micro
    assert accumulation_steps(config["global_batch_tokens"], micro, config["data"]["block_size"], 8) == accumulate
