"""``python -m cable_lightning {fit,validate,test}``: LightningCLI wired for length-extrapolation runs.

What it adds to the stock CLI:
- ``--global_batch_tokens``: the global batch in tokens (the paper's 524288), turned into gradient
  accumulation from micro-batch x block x the built Trainer's world size; an error when it does not divide.
- runs laid out as ``<runs_dir>/<experiment>/<pe>/version_N`` (TensorBoard) with checkpoints in
  ``<runs_dir>/<experiment>/<pe>/checkpoints`` (``last.ckpt`` plus every N steps), so
  ``--ckpt_path last`` finds the previous run's last checkpoint; with ``--folder_per_seed true``, one more level,
  ``seed<N>`` (the run's seed_everything), so that seeds of one encoding are separate runs.
- the data's description (vocabulary, ids, tokenizer identity, training and evaluation lengths) flows from
  the data to the model, set once in the data section; the data is prepared first when it asks for that.
- validation every checkpoint interval at every evaluation length (and window mode), recorded by
  :class:`LengthEvalRecorder` (perplexity and loss by position) and :class:`AttentionDiagnostics` (attention per
  layer and head, and the tokens that need the long context, at the first and last validations and others within
  ``--diagnostics.budget`` of the evaluation's time; ``--diagnostics.enabled false`` turns them off); a last
  one at the end of fit; with ``--data.tasks``
  (the passkey among them), exact-match accuracy on the tasks after each (:class:`TaskAccuracy`).
- checkpoints that survive kills and full disks (:class:`AtomicCheckpointIO`), ``last.ckpt`` saved on SIGTERM
  (and on SLURM's SIGUSR1, then the job requeued), ``--ckpt_path last`` (the newest readable checkpoint, or an
  error) and ``auto`` (resume if there is one).
- ``--ckpt_path FILE``: the checkpoint's model settings fill in what the command line does not set; what it does
  set wins, and a setting that defines the weights must match the checkpoint (checked before loading); a resumed
  fit also keeps the checkpoint's data.layout, global batch and data.seed (one line naming the flag otherwise), and
  validate/test evaluate at its data.layout and, for weights trained on tasks alone, on those tasks only.
- user errors as one line ``error: ...`` with exit status 2 (1 for a diverged or failed run or a lost peer process
  (another node killed), 143 after SIGTERM,
  130 after Ctrl-C, 138 after SLURM's SIGUSR1, the job requeued);
  ``CABLE_LIGHTNING_DEBUG=1`` shows the traceback.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import os
import random
import re
import shutil
import signal
import sys
import threading
from typing import Optional

import numpy as np
import torch
import yaml
from jsonargparse import Namespace
from lightning.fabric.utilities.seed import max_seed_value, min_seed_value
from lightning.pytorch.callbacks import ModelSummary, ProgressBar, RichModelSummary
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI, SaveConfigCallback
from lightning.pytorch.loggers import TensorBoardLogger
from lightning.pytorch.plugins.io import TorchCheckpointIO
from lightning.pytorch.utilities.exceptions import MisconfigurationException, SIGTERMException

from .callbacks import AttentionDiagnostics, BiasPictures, LengthEvalRecorder, TaskAccuracy, TokenThroughput
from .callbacks.hparams import RunHParams
from .callbacks.preemption import PreemptionCheckpoint
from .checkpoints import (
    AtomicCheckpointIO,
    checkpoint_step,
    claim_checkpoint_folder,
    read_checkpoint,
    resolve_ckpt_path,
    run_configs,
    shown_name,
)
from .console import LoggingStepBar, ParameterSummary, quiet_library_chatter
from .data.datamodule import TokenDataModule
from .data.layouts import check_configured_layout, configured_layout
from .errors import (
    DEBUG_VARIABLE,
    ConfigError,
    KeepsWriteErrors,
    RunFailedError,
    error_boundary,
    full_disk,
    space_left,
    user_error,
)
from .lit import LanguageModel
from .lit.checkpoint_format import checkpoint_settings
from .lit.resume import (
    RunCheckpoint,
    check_before_building,
    evaluated_as_trained,
    finished_run,
    unkeepable_batch,
)
from .models.config import BackboneConfig, moved_setting
from .positional import available, encoding_class
from .tasks.generation import TaskMix


def prepare_first(data: TokenDataModule) -> None:
    """Prepare the data section's ``path`` from its ``source`` and ``tokenizer`` when it names them (a no-op on a
    folder prepared for that request, an error on one prepared from something else). Every rank calls it: prepare's
    lock keeps ranks that start together safe."""
    if data.source is None:
        return
    from .data import prepare  # the offline builder, imported only when a run asks for it

    # litdata's optimize reseeds Python, NumPy and torch to 42; the run's seed_everything must still hold.
    python_state, numpy_state = random.getstate(), np.random.get_state()
    with torch.random.fork_rng(devices=[]):
        try:
            prepare.prepare(source=data.source, tokenizer=data.tokenizer_spec, out=data.path,
                            endpoint_url=data.endpoint_url)
        except prepare.PrepareStopped as stop:  # as prepare alone: one line, 128 + the signal (see run)
            stopped = SIGTERMException(f"the workers were stopped and nothing was written to {data.path}; run the "
                                       "same command again")
            stopped.signum = stop.signum
            raise stopped from None
        except ConfigError:
            raise
        except (ValueError, OSError) as exc:  # prepare's own one-line errors (bad source, conflicting folder)
            raise ConfigError(f"preparing {data.path}: {exc}") from exc
        except RuntimeError as exc:
            raise RunFailedError(f"preparing {data.path}: {exc}") from exc
    random.setstate(python_state)
    np.random.set_state(numpy_state)


def describe_prepared(data: TokenDataModule) -> dict:
    """The data's description for the model, the data prepared first when the data section asks for it: the
    model's vocabulary comes from the data, so this runs before the model exists."""
    prepare_first(data)
    return data.describe().as_dict()


def configured_backbone(config) -> BackboneConfig:
    """The model section's backbone, built (and so checked: shape, encoding and its settings, attention backend)
    from the parsed config, before any class is instantiated or any data is prepared."""
    backbone = config.model.init_args.get("backbone") if config.model is not None else None
    return BackboneConfig.from_dict(backbone.as_dict() if backbone is not None else {})


def check_task_rows(config, backbone: BackboneConfig) -> None:
    """An algorithmic task's training rows (its longest input, data.block_size symbols, and one token per answer
    symbol) must fit the encoding's table, before anything is built: a learnable table of the block size held the
    inputs but not the rows, and training died in a traceback at the first long batch. Evaluation lengths it cannot
    hold are recorded as unsupported, not refused."""
    data = config.get("data")
    if data is None or not data.get("tasks"):
        return
    mix = TaskMix(data.tasks.as_dict() if hasattr(data.tasks, "as_dict") else data.tasks)
    table = backbone.pos_encoding.longest_length(data.block_size)
    if table is None or not mix.algorithmic:
        return
    task = mix.tasks[0]
    row = max(task.tokens_read(length) for length in range(1, data.block_size + 1))
    if row <= table:
        return
    lengths = (config.get("task_eval") or {}).get("lengths") or data.get("eval_lengths") or [data.block_size]
    evaluated = task.tokens_read(max(lengths))
    raise ConfigError(
        f"task {task.name} trains on rows of up to {row} tokens (inputs of up to data.block_size {data.block_size} "
        f"symbols and their answers), more than the {backbone.pos_encoding.label()} encoding's table of {table} "
        f"positions; set learnable's max_positions to at least {row} "
        f"(--model.init_args.backbone.pos_encoding.max_positions {row}); evaluation lengths whose rows it does not "
        f"hold (the longest, {max(lengths)} symbols, reads {evaluated} tokens) are recorded as unsupported")


SWITCH = "--model.init_args.backbone.pos_encoding"


def carried_settings(args: list[str], encoding) -> Optional[str]:
    """One line naming the settings of ``encoding`` (the parsed one) that a switch of ``pos_encoding`` on the command
    line ``args`` carried over from an earlier config (jsonargparse keeps the earlier class's settings the new class
    also has: a base config's ``bias_activation`` survives a switch to a CABLE variant): those that differ from the
    new encoding's defaults and that the command line does not set itself. None without a switch or with nothing
    carried."""
    switched, given = None, set()
    for i, arg in enumerate(args):
        key, _, value = arg.partition("=")
        if key == SWITCH:
            switched, given = value or (args[i + 1] if i + 1 < len(args) else None), set()
        elif key.startswith(SWITCH + ".") and switched is not None:
            given.add(key[len(SWITCH) + 1 :])
    if switched is None or switched.rpartition(".")[2] != encoding.name:
        return None
    defaults = type(encoding)()
    carried = [f"{f.name}={getattr(encoding, f.name)!r} (its default: {getattr(defaults, f.name)!r})"
               for f in dataclasses.fields(encoding)
               if f.name not in given and getattr(encoding, f.name) != getattr(defaults, f.name)]
    if not carried:
        return None
    return (f"pos_encoding {encoding.name} (set on the command line) keeps settings of the earlier config: "
            f"{', '.join(carried)}; set them after it ({SWITCH}.NAME VALUE) to change them")


def run_folder(config) -> str:
    """``<runs_dir>/<experiment>/<encoding>``, and ``.../<encoding>/seed<N>`` with ``--folder_per_seed true`` (what
    ``sweep --seeds`` passes): TensorBoard versions and the checkpoints folder live under it. Named by the
    encoding's weight-defining label, so a run evaluated with RoPE scaling is still found (``rope``)."""
    folder = f"{config.runs_dir}/{config.experiment}/{configured_backbone(config).pos_encoding.label(runtime=False)}"
    if not config.get("folder_per_seed"):
        return folder
    seed = config.get("seed_everything")
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ConfigError(f"--folder_per_seed true names the run folder by the seed, but seed_everything is {seed}; "
                          "give the run its seed (--seed_everything N)")
    return f"{folder}/seed{seed}"


def checkpoint_folder(config) -> str:
    return config.checkpoint.dirpath or f"{run_folder(config)}/checkpoints"


def accumulation_steps(global_batch_tokens: int, micro_batch: int, block_size: int, ranks: int) -> int:
    per_step = micro_batch * block_size * ranks
    if global_batch_tokens % per_step:
        raise ConfigError(
            f"global_batch_tokens={global_batch_tokens} is not a multiple of micro_batch_size x block_size x "
            f"world_size = {micro_batch} x {block_size} x {ranks} = {per_step}; pick a multiple of {per_step} "
            "or change the micro-batch"
        )
    return global_batch_tokens // per_step


def apply_global_batch(trainer, global_batch_tokens: Optional[int], micro_batch: int, block_size: int,
                       validate_every_n_steps: Optional[int]) -> None:
    """Gradient accumulation from the global batch, and the validation interval in batches, from the world size
    of the Trainer Lightning built (so devices as an int, a list, "0,1" or "auto", times num_nodes, all count)."""
    if global_batch_tokens is not None:
        trainer.accumulate_grad_batches = accumulation_steps(global_batch_tokens, micro_batch, block_size,
                                                             trainer.world_size)
    if validate_every_n_steps:
        trainer.val_check_interval = validate_every_n_steps * trainer.accumulate_grad_batches


SETTING_ERRORS = re.compile(r"(unknown positional encoding |positional encoding |unknown \w+ setting |unknown value )")


def setting_error(message: str) -> Optional[str]:
    """jsonargparse's nested report of a bad encoding name, an unknown setting (of an encoding, the backbone or the
    model) or a value outside a setting's fixed choices, as one line; None for any other error. Nested parsers report
    into their parents' messages: the innermost names the class and the setting."""
    known = [line.strip() for line in message.splitlines() if SETTING_ERRORS.match(line.strip())]
    if known:
        return known[0]
    unknown = re.search(r'"pos_encoding":\s.*?Expected a dot import path string: (\S+)', message, flags=re.S)
    if unknown:
        return f"unknown positional encoding {unknown.group(1)!r}; valid names: {', '.join(available())}"
    choice = re.findall(r'Parser key "([\w.]+)":\s+Expected a typing\.Literal\[(.*?)\]\. Got value: (.*)', message)
    if choice:  # a fixed-choice setting (attention_backend chunkd): the innermost report names it
        key, choices, value = choice[-1]
        return f"unknown value {value.strip()!r} for {key}; choose one of {choices}"
    union = union_error(message)
    if union:
        return union
    simple = re.findall(r'Parser key "([\w.]+)":\s+Expected a <class \'(\w+)\'>\. Got value: (.*)', message)
    if simple and simple[-1][1] in SIMPLE_TYPES:  # a word for a number (--throughput.warmup one)
        key, kind, value = simple[-1]
        return f"invalid value {value.strip()!r} for {key}; expected {SIMPLE_TYPES[kind]}"
    setting = re.search(r"Problem with given class_path '([\w.]+)':\s+Option '(\w+)' is not accepted", message)
    if not setting:
        return None
    class_path, option = setting.groups()
    name = class_path.rpartition(".")[2]
    if name in available():
        settings = ", ".join(f.name for f in dataclasses.fields(encoding_class(name))) or "none"
        return (f"positional encoding {name!r} has no setting {option!r} (its settings: {settings}); name the encoding "
                "before its settings (--model.init_args.backbone.pos_encoding NAME), also with --ckpt_path")
    module, _, attribute = class_path.rpartition(".")
    try:
        cls = getattr(importlib.import_module(module), attribute)
    except (ImportError, AttributeError, ValueError):
        return None
    backbone = issubclass(cls, BackboneConfig)
    moved = moved_setting(option) if backbone else None
    if moved:
        return f"unknown backbone setting {option!r}; {moved}"
    settings = ", ".join(p for p, v in inspect.signature(cls).parameters.items() if v.kind is v.POSITIONAL_OR_KEYWORD)
    return f"unknown {'backbone' if backbone else name} setting {option!r}; its settings: {settings}"


SIMPLE_TYPES = {"bool": "bool", "int": "int", "float": "float", "str": "str", "NoneType": "null"}
CONTAINERS = {"dict": "a mapping", "list": "a list"}  # jsonargparse writes them as dict[str, typing.Any], list[int]


def top_level(text: str) -> list[str]:
    """``text`` split at its commas outside brackets: ``"dict[str, int], <class 'NoneType'>"`` -> two types."""
    parts, depth, start = [], 0, 0
    for i, char in enumerate(text):
        depth += (char == "[") - (char == "]")
        if char == "," and depth == 0:
            parts.append(text[start:i].strip())
            start = i + 1
    return parts + [text[start:].strip()]


def union_error(message: str) -> Optional[str]:
    """jsonargparse's report of a value that fits none of a setting's types, when those are fixed choices, simple
    types, mappings and lists (``--trainer.precision bf16-mixd``, ``--seed_everything one``, ``--data.tasks '[1,2]'``),
    as one line naming the choices or types; None for any other report."""
    union = re.search(r'Parser key "([\w.]+)":\s+Does not validate against any of the Union subtypes\s+Subtypes: '
                     r'\[(.*)\]$', message, flags=re.M)
    given = re.search(r"^  Given value: (.*)$", message, flags=re.M)  # the outermost union's (nested ones indent more)
    if not union or not given:
        return None
    key, subtypes = union.groups()
    choices, kinds = [], []
    for subtype in top_level(subtypes):
        literal = re.fullmatch(r"typing\.Literal\[(.*)\]", subtype)
        simple = re.fullmatch(r"<class '(\w+)'>", subtype)
        container = re.fullmatch(r"(?:typing\.)?(\w+)\[.*\]", subtype)
        if literal:
            choices += [item.strip().strip("'\"") for item in literal.group(1).split(",")]
        elif simple and simple.group(1) in SIMPLE_TYPES:
            kinds.append(SIMPLE_TYPES[simple.group(1)])
        elif container and container.group(1).lower() in CONTAINERS:
            kinds.append(CONTAINERS[container.group(1).lower()])
        else:
            return None  # a type with settings of its own: jsonargparse's report says which one failed
    value = given.group(1).strip()
    if choices:
        return f"unknown value {value!r} for {key}; choose one of {', '.join(dict.fromkeys(choices))}"
    return f"invalid value {value!r} for {key}; expected {' or '.join(kinds)}"


def yaml_error(path: Optional[str], exc: Optional[BaseException]) -> Optional[str]:
    """A config file that is not valid YAML as one line naming the file and line (jsonargparse reads the file into a
    string, so YAML's own report, over four lines, names ``"<unicode string>"``); None for any other error."""
    while exc is not None and not isinstance(exc, yaml.MarkedYAMLError):
        exc = exc.__cause__ or exc.__context__
    if exc is None or path is None:
        return None
    mark, context = exc.problem_mark or exc.context_mark, ""
    if exc.context and exc.context_mark:
        context = f" ({exc.context} at line {exc.context_mark.line + 1}, column {exc.context_mark.column + 1})"
    return f"{path}{f':{mark.line + 1}' if mark else ''}: not valid YAML: {exc.problem or exc.context}{context}"


def missing_model(message: str, given: list[str]) -> Optional[str]:
    """``validate.model is required`` (validate or test given ``--ckpt_path`` alone), as one line saying that the run's
    configs are needed too, naming the ``config.yaml`` the run saved when the checkpoint is in its run folder; None
    for any other error."""
    missing = re.search(r"arguments are required: (validate|test)\.model\b", message)
    if not missing:
        return None
    verb = missing.group(1)
    ckpt = next((arg.partition("=")[2] or (given[i + 1] if i + 1 < len(given) else "") for i, arg in enumerate(given)
                 if arg.partition("=")[0] == "--ckpt_path"), "")
    saved = run_configs(ckpt)[-1:] if os.path.isfile(ckpt) else []
    advice = (f"the run saved its config in {saved[0]}: python -m cable_lightning {verb} --config {saved[0]} "
              f"--ckpt_path {ckpt}" if saved else
              f"give them as it was trained: python -m cable_lightning {verb} --config <the run's configs> "
              f"--ckpt_path {ckpt or '<its checkpoint>'}")
    return (f"{verb} needs the run's configs as well as --ckpt_path (the checkpoint holds the model's settings, not "
            f"the data section or the trainer's); {advice}")


class TerseParser(KeepsWriteErrors, LightningArgumentParser):
    """A usage error is two lines (what was wrong, how to get help), not the hundred-line usage first; a bad encoding
    name or unknown setting is one line (:func:`setting_error`), not jsonargparse's report of every type it tried, and
    so is a config file that is not valid YAML (:func:`yaml_error`)."""

    reading: Optional[str] = None  # the --config file being parsed
    given: list[str] = []  # the command line being parsed

    def parse_args(self, args=None, *rest, **kwargs):
        self.given = list(sys.argv[1:] if args is None else args)
        return super().parse_args(args, *rest, **kwargs)

    def print_usage(self, file=None):
        pass

    def parse_path(self, path, *args, **kwargs):
        earlier, self.reading = self.reading, str(path)
        try:
            return super().parse_path(path, *args, **kwargs)
        finally:
            self.reading = earlier

    def error(self, message: str, *args, **kwargs):
        cause = args[0] if args else kwargs.get("ex")
        return super().error(yaml_error(self.reading, cause) or missing_model(message, self.given)
                             or setting_error(message) or message, *args, **kwargs)


class SavedConfig(SaveConfigCallback):
    """Lightning's writer of the run's ``config.yaml``; a failed write (a full logs folder) is one line naming the
    file."""

    def setup(self, trainer, pl_module, stage: str) -> None:
        try:
            super().setup(trainer, pl_module, stage)
        except OSError as exc:
            path = os.path.join(trainer.log_dir or ".", self.config_filename)
            raise RunFailedError(f"could not write {path} ({type(exc).__name__}: {exc}; {space_left(path)}); "
                                 "nothing was trained") from exc


# gloo's transport, which names itself in every error (a peer's connection closed or reset, a receive timed out); NCCL's
# errors are DistBackendError. A "Connection reset by peer" of anything else (an object store's) is not a lost peer.
PEER_LOST = re.compile(r"/gloo/transport/")


def lost_peer(exc: BaseException) -> Optional[BaseException]:
    """The collective's error behind ``exc`` when another process of the run went away (torch.distributed's own
    errors, or gloo's RuntimeError naming its transport), or None."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, torch.distributed.DistError) or (isinstance(exc, RuntimeError)
                                                             and PEER_LOST.search(str(exc))):
            return exc
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__
    return None


class RunFinished(Exception):
    """A fit resumed from a checkpoint at its ``max_steps``: nothing to do (:func:`finished_run`)."""


class CableCLI(LightningCLI):
    def __init__(self, *args, extra_callbacks: tuple = (), **kwargs):
        self.extra_callbacks = list(extra_callbacks)  # appended last (gpu-check's clock): see instantiate_trainer
        self.finished: Optional[str] = None  # the line said when a resumed run had nothing to train
        try:
            super().__init__(*args, **kwargs)
        except RunFinished as done:  # before any class is built: no data prepared, no folder, no record written
            self.finished = str(done)
            print(self.finished, flush=True)

    def parse_arguments(self, parser, args):
        self._args = args  # parsed again over a checkpoint's model settings (see _parse_ckpt_path)
        super().parse_arguments(parser, args)

    def _parse_ckpt_path(self):
        """Resolve ``--ckpt_path`` to a file, then parse the command line again with the checkpoint's model
        settings as defaults: the command line wins (Lightning's default lets the checkpoint win, which drops
        evaluation-time settings such as RoPE scaling), and LanguageModel.on_load_checkpoint refuses settings that
        define the weights when they differ."""
        subcommand = self.config.get("subcommand")
        if subcommand is None:
            return
        config = self.config[subcommand]
        if "ckpt_path" not in config:
            return
        path = resolve_ckpt_path(config.ckpt_path, checkpoint_folder(config), subcommand)
        if path is None and subcommand in ("validate", "test"):
            raise ConfigError(f"{subcommand} needs trained weights: pass --ckpt_path FILE, or last for the newest "
                              f"checkpoint in {checkpoint_folder(config)}")
        if subcommand == "fit" and path is not None and (done := finished_run(path, config.trainer.max_steps)):
            raise RunFinished(done)
        model, trained = checkpoint_settings(path) if path is not None and os.path.isfile(path) else (None, {})
        if model is not None:
            self._subcommand_parsers[subcommand].set_defaults({"model": model})
            super().parse_arguments(self.parser, self._args)
            config = self.config[subcommand]
        if subcommand in ("validate", "test") and config.get("data") is not None:  # as the weights were trained
            given = self._args if self._args is not None else sys.argv[1:]
            named = any(arg.partition("=")[0].startswith("--data.layout") for arg in given)
            layout = evaluated_as_trained(trained, configured_layout(config.data.get("layout")),
                                          config.data.get("tasks"), subcommand, shown_name(path), named)
            config.data.layout = Namespace(**layout.as_dict())
        if model is not None:  # the same model, length and data, before anything is built or prepared
            check_before_building(read_checkpoint(path, mmap=True), configured_backbone(config), config.get("data"),
                                  subcommand, shown_name(path))
        config.ckpt_path = path

    def add_arguments_to_parser(self, parser):
        parser.add_argument("--experiment", type=str, default="default", help="runs/<experiment>/<pe>/...")
        parser.add_argument("--runs_dir", type=str, default="runs")
        parser.add_argument("--folder_per_seed", type=bool, default=False,
                            help="runs/<experiment>/<pe>/seed<seed_everything>/...: one folder per seed")
        parser.add_argument("--global_batch_tokens", type=Optional[int], default=None,
                            help="global batch in tokens; sets trainer.accumulate_grad_batches")
        parser.add_lightning_class_args(RunCheckpoint, "checkpoint")
        parser.add_lightning_class_args(LengthEvalRecorder, "length_eval")
        parser.add_lightning_class_args(AttentionDiagnostics, "diagnostics")
        parser.add_lightning_class_args(TaskAccuracy, "task_eval")
        parser.add_lightning_class_args(BiasPictures, "bias_pictures")
        parser.add_lightning_class_args(TokenThroughput, "throughput")
        parser.set_defaults({
            "checkpoint.save_last": True,
            "checkpoint.save_top_k": -1,
            "checkpoint.every_n_train_steps": 1000,
            "checkpoint.filename": "step{step:07d}",
            "checkpoint.auto_insert_metric_name": False,
            # one run per folder (claim_checkpoint_folder): a resumed run overwrites last.ckpt (atomically) instead of
            # writing last-v1.ckpt beside a stale last.ckpt
            "checkpoint.enable_version_counter": False,
            "trainer.gradient_clip_val": 1.0,
        })
        parser.link_arguments("data", "model.init_args.data", compute_fn=describe_prepared, apply_on="instantiate")

    def before_instantiate_classes(self):
        config = self.config[self.subcommand] if self.subcommand else self.config
        backbone = configured_backbone(config)  # fail fast: every model setting is checked before the data is prepared
        carried = carried_settings(self._args if self._args is not None else sys.argv[1:], backbone.pos_encoding)
        if carried:
            print(carried, flush=True)
        if config.get("data") is not None:  # what training sees of a block, against the encoding (data/layouts.py)
            check_configured_layout(config.data.get("layout"), backbone, config.data.block_size)
        if self.subcommand == "fit":
            check_task_rows(config, backbone)
        if config.trainer.logger in (None, True):
            config.trainer.logger = {
                "class_path": "lightning.pytorch.loggers.TensorBoardLogger",
                "init_args": {"save_dir": config.runs_dir,
                              "name": os.path.relpath(run_folder(config), config.runs_dir),
                              # the HParams tab's metrics are the run's perplexities (callbacks/hparams.py), not
                              # Lightning's placeholder hp_metric = -1
                              "default_hp_metric": False},
            }
        config.checkpoint.dirpath = checkpoint_folder(config)
        self._validate_every_checkpoint = (config.trainer.val_check_interval is None
                                           and bool(config.checkpoint.every_n_train_steps))
        if self._validate_every_checkpoint:  # in batches, across epochs; scaled by accumulation in before_fit
            config.trainer.val_check_interval = config.checkpoint.every_n_train_steps
            config.trainer.check_val_every_n_epoch = None

    def _set_seed(self):
        """A seed seed_everything would refuse with a traceback is one line, before anything runs."""
        seed = self._get(self.config, "seed_everything")
        if type(seed) is int and not min_seed_value <= seed <= max_seed_value:
            raise ConfigError(f"seed_everything {seed} is out of range: a seed is an integer from {min_seed_value} to "
                              f"{max_seed_value} (true: a random one, false: none)")
        super()._set_seed()

    def after_instantiate_classes(self):
        seed = self._get(self.config, "seed_everything")  # an int once _set_seed ran, unless seeding is off
        self.model.run_seed = None if isinstance(seed, bool) else seed

    def instantiate_trainer(self, **kwargs):
        try:
            trainer = super().instantiate_trainer(**kwargs)
        except (MisconfigurationException, TypeError, ValueError) as exc:  # Lightning's word on its own settings
            raise ConfigError(f"the trainer settings are not valid here: {str(exc).strip().splitlines()[0]}") from exc
        if type(trainer.strategy.checkpoint_io) is TorchCheckpointIO:  # a user's own CheckpointIO plugin is kept
            trainer.strategy.checkpoint_io = AtomicCheckpointIO()
        trainer.callbacks.append(PreemptionCheckpoint(self.config[self.subcommand].checkpoint.dirpath))
        trainer.callbacks.append(RunHParams(self.config[self.subcommand].experiment))  # after the evaluations' own
        trainer.callbacks = [ParameterSummary(max_depth=cb._max_depth) if type(cb) in (ModelSummary, RichModelSummary)
                             else cb for cb in trainer.callbacks]  # Lightning's default summary, without FLOPs 0
        configured = self._get(self.config_init, "trainer", default={}).get("callbacks") or []
        configured = configured if isinstance(configured, list) else [configured]
        if not any(isinstance(cb, ProgressBar) for cb in configured):
            # Lightning's default bar (the user configured none), refreshed at logging steps: see LoggingStepBar
            trainer.callbacks = [LoggingStepBar() if isinstance(cb, ProgressBar) else cb for cb in trainer.callbacks]
        trainer.callbacks += self.extra_callbacks  # after every configured callback: their hooks run first
        return trainer

    def before_fit(self):
        config = self.config["fit"]
        if config.ckpt_path is not None and os.path.isfile(config.ckpt_path):  # a resume: can this world keep it?
            saved = read_checkpoint(config.ckpt_path, mmap=True).get("global_batch")
            refusal = unkeepable_batch(saved, self.trainer.world_size, self.datamodule.micro_batch_size,
                                       shown_name(config.ckpt_path))
            if refusal:
                raise ConfigError(refusal)
        apply_global_batch(self.trainer, config.global_batch_tokens, self.datamodule.micro_batch_size,
                           self.datamodule.block_size,
                           config.checkpoint.every_n_train_steps if self._validate_every_checkpoint else None)
        self._folder_lock = claim_checkpoint_folder(config.checkpoint.dirpath, resuming=config.ckpt_path is not None,
                                                    lock=self.trainer.global_rank == 0)

    def _run_subcommand(self, subcommand):
        try:
            super()._run_subcommand(subcommand)
        except Exception as exc:  # a full disk where a logger writes (TensorBoard's events), one line as every write
            if isinstance(user_error(exc), ConfigError):
                self._drop_unused_logs()
            lost = lost_peer(exc) if user_error(exc) is None else None
            if lost is not None:
                raise RunFailedError(self._lost_peer_line(subcommand, lost)) from exc
            full = full_disk(exc)
            if full is None or user_error(exc) is not None:
                raise
            where = full.filename or f"the logs in {self.trainer.log_dir or '.'}"
            raise RunFailedError(f"could not write {where} ({type(full).__name__}: {full}; "
                                 f"{space_left(self.trainer.log_dir or '.')}); the checkpoints written before it are "
                                 "intact") from exc
        finally:  # the checkpoint folder's lock ends with the run, also when it fails
            if getattr(self, "_folder_lock", None) is not None:
                self._folder_lock.close()

    def _lost_peer_line(self, subcommand: str, lost: BaseException) -> str:
        """What a process says when another of its run went away (a node killed or lost): its collective fails, and
        the last checkpoint stands. Its own words first, as gloo's are a wall of text."""
        trainer = self.trainer
        said = re.sub(r"^\[[^\]]*\]\s*", "", str(lost).strip()).split(". ")[0]  # without gloo's source-file prefix
        processes, nodes = trainer.world_size, trainer.num_nodes
        where = (f"{subcommand} lost another process of this run ({processes} process{'es' * (processes > 1)} on "
                 f"{nodes} node{'s' * (nodes > 1)}; this is rank {trainer.global_rank}) "
                 f"at step {trainer.global_step}: {type(lost).__name__}: {said}; its own log says why it stopped")
        if subcommand != "fit":
            return f"{where}; nothing was recorded from this {subcommand}: run it again"
        saved = getattr(trainer.checkpoint_callback, "last_model_path", "") or trainer.ckpt_path
        if not (saved and os.path.isfile(saved)):
            return f"{where}; no checkpoint was written before it: start every node again"
        return (f"{where}; the last checkpoint, {os.path.abspath(saved)} (step {checkpoint_step(saved)}), is kept: "
                "start every node again with --ckpt_path last (--ckpt_path auto in a job script) to continue from it")

    def _drop_unused_logs(self) -> None:
        """A run refused before its first step (a resume with another global batch) removes the TensorBoard folder it
        made, which holds only what setup writes (the config and this process's event file): it would stand as a
        ``version_N`` of no run beside the refused one's."""
        logger, trainer = self.trainer.logger, self.trainer
        if not isinstance(logger, TensorBoardLogger) or not trainer.is_global_zero or trainer.global_step:
            return
        folder = logger.log_dir
        if os.path.isdir(folder) and all(name in ("config.yaml", "hparams.yaml") or (
                name.startswith("events.out.tfevents.") and name.split(".")[-2] == str(os.getpid()))
                for name in os.listdir(folder)):
            shutil.rmtree(folder, ignore_errors=True)

    def after_fit(self):
        # Every run ends with a perplexity-vs-length record of its final weights (unless the last
        # checkpoint's evaluation already was at the final step).
        results = self.model.length_results
        if not results or results[0].step != self.trainer.global_step:
            self.trainer.validate(self.model, datamodule=self.datamodule, verbose=False)
        if self.trainer.is_global_zero:  # the last line of a run: where it went
            logger = self.trainer.logger
            print(f"run written to {logger.log_dir if logger else '(no logger)'}, checkpoints to "
                  f"{self.config['fit'].checkpoint.dirpath}", flush=True)


def main(args: list[str] | None = None, extra_callbacks: tuple = ()) -> CableCLI:
    """The CLI as a library call; ``args`` (for tests and scripts) replaces ``sys.argv[1:]``; ``extra_callbacks`` join
    the Trainer's, after its own. Errors propagate."""
    return CableCLI(LanguageModel, TokenDataModule, subclass_mode_model=True, args=args,
                    extra_callbacks=extra_callbacks, save_config_callback=SavedConfig,
                    save_config_kwargs={"overwrite": True}, parser_class=TerseParser,
                    parser_kwargs={"prog": "python -m cable_lightning"})


def quiet_writer_thread(args, report=threading.__excepthook__) -> None:
    """TensorBoard's event writer thread that meets a full disk keeps the error and raises it again at the run's
    next write or flush, which ends the run in one line (CableCLI._run_subcommand): its own traceback would come
    first. Every other thread's error keeps its report."""
    if (full_disk(args.exc_value) is None or not type(args.thread).__module__.startswith("tensorboard.")
            or os.environ.get(DEBUG_VARIABLE)):
        report(args)


def run(args: list[str] | None = None) -> None:
    """``python -m cable_lightning``: :func:`main` with user errors as one line and an exit status for schedulers:
    2 for a bad setting, data or checkpoint, 1 for a run that failed (divergence, a checkpoint not written), 143
    after SIGTERM, 130 after Ctrl-C and 138 after SLURM's SIGUSR1 (``last.ckpt`` saved; continue with ``--ckpt_path
    last``; after SIGUSR1 the job is requeued). Bugs keep their traceback."""
    quiet_library_chatter()  # other libraries' notes that say nothing about this run (see console.py)
    threading.excepthook = quiet_writer_thread
    with error_boundary():
        try:
            main(args)
        except SIGTERMException as exc:  # also a first Ctrl-C (SIGINT) during fit; see PreemptionCheckpoint
            signum = getattr(exc, "signum", signal.SIGTERM)
            saved, requeued = getattr(exc, "saved_checkpoint", None), getattr(exc, "requeued", None)
            print(f"error: stopped by {signal.Signals(signum).name}" + (f"; {exc}" if str(exc) else "")
                  + (f"; saved {saved}" if saved else "") + (f"; {requeued}" if requeued else "")
                  + ("; continue with --ckpt_path last" if saved else ""),
                  file=sys.stderr, flush=True)
            sys.exit(128 + signum)


if __name__ == "__main__":  # an entry point once: say which verb replaced it, never exit 0 having done nothing
    from cable_lightning.verbs import replaced_entry_point

    replaced_entry_point(__spec__.name)
