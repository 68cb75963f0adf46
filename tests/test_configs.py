"""Every file under configs/ parses as the command in its header composes it (and every base with every strategy
preset and an encoding); the paper's global batch turns into the paper's micro-batches without remainder; length
settings take ranges."""

import contextlib
import functools
import glob
import io
import os
import shlex

import pytest
import torch
import yaml

from cable_lightning import sweep
from cable_lightning.cli import main
from cable_lightning.data.lengths import length_list
from cable_lightning.errors import ConfigError
from cable_lightning.models import BackboneConfig
from cable_lightning.run_setup import accumulation_steps
from cable_lightning.tasks.generation import TaskMix

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


# --- every file under configs/, as its header composes it ------------------------------------------------------------

CONFIGS = sorted(os.path.relpath(path, ROOT) for path in glob.glob(os.path.join(ROOT, "configs", "**", "*.yaml"),
                                                                    recursive=True))


def header_commands(path: str) -> list[list[str]]:
    """The ``python -m cable_lightning fit|sweep`` commands of a config's header comment (continuations joined), as
    their arguments from the verb on."""
    lines = []
    with open(os.path.join(ROOT, path), encoding="utf-8") as f:
        for line in f:
            if not line.startswith("#"):
                break
            lines.append(line[1:].strip())
    commands = [shlex.split(line) for line in "\n".join(lines).replace("\\\n", " ").splitlines()
                if line.startswith("python -m cable_lightning ")]
    return [argv[3:] for argv in commands if argv[3] in ("fit", "sweep")]


def read_by(path: str) -> list[str]:
    """The configs that read ``path`` through a ``config:`` key of their own."""
    readers = []
    for other in CONFIGS:
        with open(os.path.join(ROOT, other), encoding="utf-8") as f:
            included = (yaml.safe_load(f) or {}).get("config")
        if included and os.path.normpath(os.path.join(os.path.dirname(other), included)) == os.path.normpath(path):
            readers.append(other)
    return readers


@functools.lru_cache(maxsize=None)
def printed(fit: tuple[str, ...]) -> dict:
    """The config ``fit`` resolves to, by the fit's own parser in this process (nothing built, no data prepared)."""
    out = io.StringIO()
    with contextlib.chdir(ROOT), contextlib.redirect_stdout(out), pytest.raises(SystemExit) as done:
        main([*fit, "--print_config"])
    assert done.value.code in (None, 0), fit
    return yaml.safe_load(out.getvalue())


def fits_of(argv: list[str]) -> list[tuple[str, ...]]:
    """The fit a header command runs: itself, or a sweep's first fit (the sweep's own flags, a --retrieval_config
    file's included, parsed and checked on the way; a retrieval stage's fits are the pre-training it reads)."""
    if argv[0] == "fit":
        return [tuple(argv)]
    given = argv[1:]
    if "--stage" in given:
        given[given.index("--stage") + 1] = "fit"
    with contextlib.chdir(ROOT):
        first = sweep.commands(sweep.parse_args(given))[0][1]
    return [tuple(first[first.index("fit"):])]


@pytest.mark.parametrize("path", CONFIGS)
def test_every_config_parses_as_its_header_composes_it(path):
    """Each file states in its header the command that uses it (with the files it composes after), or is read by a
    config's ``config:`` key; that command resolves, and what it resolves builds a backbone and its length settings
    and tasks read."""
    commands = [argv for argv in header_commands(path) if path in argv]
    assert commands or read_by(path), (f"{path}: its header names no fit or sweep command that uses it (--config "
                                       f"{path}, after the files it composes after), and no config reads it")
    for argv in commands:
        for fit in fits_of(argv):
            config = printed(fit)
            backbone = BackboneConfig.from_dict(config["model"]["init_args"]["backbone"])
            assert backbone.n_embd % backbone.n_head == 0
            data, task_eval = config.get("data") or {}, config.get("task_eval") or {}
            for given, setting in ((data.get("eval_lengths"), "data.eval_lengths"),
                                   (task_eval.get("lengths"), "task_eval.lengths")):
                if given is not None:
                    assert length_list(given, setting)
            if data.get("tasks"):
                TaskMix(data["tasks"])


def test_the_small_model_is_one_file_that_four_configs_read():
    assert sorted(read_by("configs/model/small4x256.yaml")) == [
        "configs/code_long.yaml", "configs/encoder/mlm_code.yaml", "configs/encoder/mlm_pydocs.yaml",
        "configs/quickstart.yaml"]
    for path in read_by("configs/model/small4x256.yaml"):
        backbone = printed(("fit", "--config", path))["model"]["init_args"]["backbone"]
        assert (backbone["n_layer"], backbone["n_head"], backbone["n_embd"]) == (4, 4, 256), path


# --- length settings ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("given, lengths", [
    ([128, 256], [128, 256]), (512, [512]), ("1..5", [1, 2, 3, 4, 5]), ("1 .. 3", [1, 2, 3]),
    ("60..100 step 20", [60, 80, 100]), ([10, 20, "41..43"], [10, 20, 41, 42, 43]), ("7", [7]),
])
def test_a_length_setting_takes_lengths_and_ranges(given, lengths):
    assert length_list(given, "task_eval.lengths") == lengths


@pytest.mark.parametrize("given, bad", [("1...500", "'1...500'"), ("500..1", "'500..1'"), ([0], "0"),
                                        ("1..5 step 0", "'1..5 step 0'"), (True, "True"), ([12.5], "12.5")])
def test_a_bad_length_is_one_line_naming_it_and_the_forms(given, bad):
    with pytest.raises(ConfigError) as refused:
        length_list(given, "task_eval.lengths")
    assert str(refused.value) == (f"task_eval.lengths: {bad} is not a length >= 1, a range START..STOP (both "
                                  "included; START..STOP step N: every Nth), or a list of them (e.g. 1..500 or "
                                  "[10, 20, 41..500])")
    with pytest.raises(ConfigError, match=r"^data.eval_lengths is empty; give a length >= 1"):
        length_list([], "data.eval_lengths")


def test_the_gpu_protocol_evaluates_every_length_from_1_to_500():
    config = printed(("fit", "--config", "configs/chomsky/base.yaml", "--config", "configs/chomsky/reverse_string.yaml",
                      "--config", "configs/chomsky/gpu.yaml"))
    assert length_list(config["task_eval"]["lengths"], "task_eval.lengths") == list(range(1, 501))
