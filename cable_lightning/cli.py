"""``python -m cable_lightning {fit,validate,test}``: LightningCLI wired for length-extrapolation runs.

This module is the wiring; each job has its own room: :mod:`.run_setup` (the data prepared first, every setting
checked before anything is built, the run folder, the global batch), :mod:`.argument_errors` (jsonargparse's reports
in one line) and :mod:`.run_failures` (a failed or stopped run in one line). What it adds to the stock CLI:
- ``--global_batch_tokens``: the global batch in tokens, turned into gradient accumulation for the built Trainer;
- runs in ``<runs_dir>/<experiment>/<pe>[/seed<N>]`` (TensorBoard versions and ``checkpoints/``), so
  ``--ckpt_path last`` finds the previous run's last checkpoint and ``auto`` resumes if there is one;
- the data's description flows from the data section to the model;
- validation every checkpoint interval at every evaluation length, recorded by the callbacks (perplexity and loss by
  position, attention diagnostics, task accuracy), and a last one at the end of fit;
- checkpoints that survive kills and full disks, ``last.ckpt`` saved on SIGTERM and SLURM's SIGUSR1;
- ``--ckpt_path FILE``: the checkpoint's model settings fill in what the command line does not set
  (:mod:`.lit.resume` says what a resume may change);
- user errors as one line ``error: ...``, with the exit statuses of :mod:`.errors`; ``CABLE_LIGHTNING_DEBUG=1``
  shows the traceback.
docs/training.md and docs/faults.md tell the whole story.
"""

from __future__ import annotations

import os
import sys
import threading
from typing import Optional

import yaml
from jsonargparse import Namespace
from lightning.fabric.utilities.rank_zero import rank_zero_warn
from lightning.fabric.utilities.seed import max_seed_value, min_seed_value
from lightning.pytorch.callbacks import ModelSummary, ProgressBar, RichModelSummary
from lightning.pytorch.cli import LightningCLI
from lightning.pytorch.plugins.io import TorchCheckpointIO
from lightning.pytorch.utilities.exceptions import MisconfigurationException, SIGTERMException

from . import hardware
from .argument_errors import TerseParser
from .callbacks import AttentionDiagnostics, BiasPictures, LengthEvalRecorder, TaskAccuracy, TokenThroughput
from .callbacks.hparams import RunHParams
from .callbacks.preemption import PreemptionCheckpoint
from .checkpoints import AtomicCheckpointIO, claim_checkpoint_folder, read_checkpoint, resolve_ckpt_path, shown_name
from .console import LoggingStepBar, ParameterSummary, quiet_library_chatter
from .data.datamodule import TokenDataModule
from .data.layouts import check_configured_layout, configured_layout
from .errors import ConfigError, error_boundary
from .lit import LanguageModel
from .lit.checkpoint_format import checkpoint_settings
from .lit.resume import (
    RunCheckpoint,
    check_before_building,
    check_same_recipe,
    evaluated_as_trained,
    finished_run,
    unkeepable_batch,
)
from .run_failures import SavedConfig, failed_run, quiet_writer_thread, stopped
from .run_setup import (
    apply_global_batch,
    carried_settings,
    check_task_rows,
    checkpoint_folder,
    configured_backbone,
    describe_prepared,
    run_folder,
)


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
            named = (any(arg.partition("=")[0].startswith("--data.layout") for arg in given)
                     or any("layout" in (read_config(path).get("data") or {}) for path in config_files(given)))
            layout = evaluated_as_trained(trained, configured_layout(config.data.get("layout")),
                                          config.data.get("tasks"), subcommand, shown_name(path), named)
            config.data.layout = Namespace(**layout.as_dict())
        if model is not None:  # the same model, length, data and recipe, before anything is built or prepared
            checkpoint = read_checkpoint(path, mmap=True)
            check_before_building(checkpoint, configured_backbone(config), config.get("data"), subcommand,
                                  shown_name(path))
            if subcommand == "fit":
                check_same_recipe(checkpoint, config, shown_name(path))
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
        # probed on rank zero only: every rank of a CPU run shares its CPU model
        if trainer.is_global_zero and (slow := hardware.slow_cpu_bf16(trainer.precision, trainer.strategy.root_device)):
            rank_zero_warn(slow)
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
        except Exception as exc:
            failed = failed_run(exc, self.trainer, subcommand)
            if failed is None:
                raise
            raise failed from exc
        finally:  # the checkpoint folder's lock ends with the run, also when it fails
            if getattr(self, "_folder_lock", None) is not None:
                self._folder_lock.close()

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


def config_files(given: list[str]) -> list[str]:
    """The ``--config`` files a command line names (``--config FILE`` or ``--config=FILE``)."""
    files = [arg.partition("=")[2] for arg in given if arg.startswith("--config=")]
    return files + [given[i + 1] for i, arg in enumerate(given[:-1]) if arg == "--config"]


def read_config(path: str) -> dict:
    """A config file as the mapping it holds (what the parser read from it already, so it exists and parses)."""
    with open(path, encoding="utf-8") as f:
        return yaml.safe_load(f) or {}


def main(args: list[str] | None = None, extra_callbacks: tuple = ()) -> CableCLI:
    """The CLI as a library call; ``args`` (for tests and scripts) replaces ``sys.argv[1:]``; ``extra_callbacks`` join
    the Trainer's, after its own. Errors propagate."""
    return CableCLI(LanguageModel, TokenDataModule, subclass_mode_model=True, args=args,
                    extra_callbacks=extra_callbacks, save_config_callback=SavedConfig,
                    save_config_kwargs={"overwrite": True}, parser_class=TerseParser,
                    parser_kwargs={"prog": "python -m cable_lightning"})


def run(args: list[str] | None = None) -> None:
    """``python -m cable_lightning``: :func:`main` with user errors as one line and an exit status for schedulers
    (:data:`.errors.EXIT_STATUSES`). Bugs keep their traceback."""
    quiet_library_chatter()  # other libraries' notes that say nothing about this run (see console.py)
    threading.excepthook = quiet_writer_thread
    with error_boundary():
        try:
            main(args)
        except SIGTERMException as exc:  # also a first Ctrl-C (SIGINT) during fit; see PreemptionCheckpoint
            stopped(exc)
        else:
            release_process_group()


def release_process_group() -> None:
    """Destroys a finished run's process group while the interpreter is whole: left to interpreter shutdown, Gloo's
    worker threads can abort a rank that finished well (SIGABRT, "terminate called without an active exception"; seen
    once in the two-process DDP test). Only after success: after an error another rank may still wait in a
    collective."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()

if __name__ == "__main__":  # an entry point once: say which verb replaced it, never exit 0 having done nothing
    from cable_lightning.verbs import replaced_entry_point

    replaced_entry_point(__spec__.name)
