"""Every shipped config composes and parses (base + strategy preset + an encoding); the paper's
global batch turns into the paper's micro-batches without remainder."""

import glob
import os

import pytest
import torch
import yaml

from cable_lightning.cli import main
from cable_lightning.run_setup import accumulation_steps

ROOT = os.path.join(os.path.dirname(__file__), "..")
BASES = (sorted(glob.glob(os.path.join(ROOT, "configs", "paper", "*.yaml")))
         + [os.path.join(ROOT, "configs", name) for name in ("quickstart.yaml", "code_long.yaml")])
TRAINERS = sorted(glob.glob(os.path.join(ROOT, "configs", "trainer", "*.yaml")))


@pytest.mark.parametrize("base", BASES, ids=os.path.basename)
@pytest.mark.parametrize("trainer", TRAINERS, ids=os.path.basename)
def test_configs_compose_and_parse(base, trainer, capsys):
    with pytest.raises(SystemExit) as done:
        main(["fit", "--config", base, "--config", trainer, "--model.init_args.backbone.pos_encoding", "alibi",
              "--print_config"])
    assert done.value.code in (None, 0)
    config = yaml.safe_load(capsys.readouterr().out)
    encoding = config["model"]["init_args"]["backbone"]["pos_encoding"]
    assert encoding["class_path"] == "cable_lightning.positional.alibi.Alibi"
    assert config["trainer"]["devices"] == yaml.safe_load(open(trainer))["trainer"]["devices"]


@pytest.mark.parametrize("name,micro,accumulate", [("gpt2_tiny_fineweb", 64, 1), ("gpt2_small_fineweb", 32, 2),
                                                   ("gpt2_medium_fineweb", 16, 4), ("gpt2_small_fineweb_dape", 16, 8)])
def test_paper_global_batch_on_eight_gpus(name, micro, accumulate):
    config = yaml.safe_load(open(os.path.join(ROOT, "configs", "paper", f"{name}.yaml")))
    assert config["data"]["micro_batch_size"] == micro
    assert accumulation_steps(config["global_batch_tokens"], micro, config["data"]["block_size"], 8) == accumulate


@pytest.mark.parametrize("base", [b for b in BASES if "paper" in b], ids=os.path.basename)
@pytest.mark.parametrize("trainer", TRAINERS, ids=os.path.basename)
def test_paper_configs_start_a_fit_on_cpu(base, trainer, tiny_corpus_dir, tmp_path):
    """Every paper config with every trainer preset runs 2 optimizer steps (2 micro-batches each) and a validation,
    with only the model's size, the data, the device and the device count changed: the strategy (DDP or FSDP2 on
    one process), the precision (bf16-mixed where the preset or the config says so), the encoding, the model class and
    its recipe are the config's own (compiling is left off: on a CPU, inductor takes 20 s a model). A config that rots
    fails here."""
    environ = dict(os.environ)  # a one-process DDP or FSDP run sets rank and address variables
    cli = main(["fit", "--config", base, "--config", trainer, "--trainer.accelerator", "cpu", "--trainer.devices", "1",
                "--model.init_args.backbone.n_layer", "1", "--model.init_args.backbone.n_head", "2",
                "--model.init_args.backbone.n_embd", "32", "--data.path", tiny_corpus_dir, "--data.block_size", "32",
                "--data.micro_batch_size", "2", "--data.num_workers", "0", "--data.eval_lengths", "[32]",
                "--data.eval_tokens", "64", "--global_batch_tokens", "128", "--trainer.max_steps", "2",
                "--checkpoint.every_n_train_steps", "2", "--trainer.enable_progress_bar", "false",
                "--model.init_args.compile", "false",
                "--trainer.enable_model_summary", "false", "--runs_dir", str(tmp_path / "runs")])
    try:
        trainer_config = yaml.safe_load(open(trainer))["trainer"]
        assert cli.trainer.global_step == 2 and cli.trainer.accumulate_grad_batches == 2
        own = (yaml.safe_load(open(base)).get("trainer") or {}).get("precision", "32-true")
        assert cli.trainer.precision == trainer_config.get("precision", own)
        strategy = trainer_config["strategy"]
        assert type(cli.trainer.strategy).__name__ == (strategy["class_path"].rpartition(".")[2]
                                                       if isinstance(strategy, dict) else
                                                       {"ddp": "DDPStrategy", "auto": "SingleDeviceStrategy"}[strategy])
        assert [r.length for r in cli.model.length_results] == [32] and cli.model.length_results[0].ppl > 1
    finally:
        if torch.distributed.is_initialized():  # later tests start their own process groups
            torch.distributed.destroy_process_group()
        os.environ.clear()
        os.environ.update(environ)
