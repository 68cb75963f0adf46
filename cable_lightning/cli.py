"""``python -m cable_lightning {fit,validate,test}``: LightningCLI wired for length-extrapolation runs.

What it adds to the stock CLI:
- ``--global_batch_tokens``: the global batch in tokens (the paper's 524288), turned into gradient
  accumulation from micro-batch x block x the built Trainer's world size; an error when it does not divide.
- runs laid out as ``<runs_dir>/<experiment>/<pe>/version_N`` (TensorBoard) with checkpoints in
  ``<runs_dir>/<experiment>/<pe>/checkpoints`` (``last.ckpt`` plus every N steps), so
  ``--ckpt_path last`` finds the previous run's last checkpoint.
- the data's description (vocabulary, ids, tokenizer identity, training and evaluation lengths) flows from
  the data to the model, set once in the data section; the data is prepared first when it asks for that.
- validation every checkpoint interval at every evaluation length (and window mode), recorded by
  :class:`LengthEvalRecorder`; a last one at the end of fit.
"""

from __future__ import annotations

from typing import Optional

from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.cli import LightningCLI

from .callbacks import BiasPictures, LengthEvalRecorder, TokenThroughput
from .data.datamodule import TokenDataModule
from .lit import LanguageModel


def describe_prepared(data: TokenDataModule) -> dict:
    """The data's description for the model, preparing the data first when the data section asks for it: the
    model's vocabulary comes from the data, so this runs before the model exists (prepare's lock keeps ranks that
    start together safe; a finished folder is a no-op)."""
    data.prepare_data()
    return data.describe().as_dict()


def accumulation_steps(global_batch_tokens: int, micro_batch: int, block_size: int, ranks: int) -> int:
    per_step = micro_batch * block_size * ranks
    if global_batch_tokens % per_step:
        raise ValueError(
            f"global_batch_tokens={global_batch_tokens} is not a multiple of micro_batch_size x block_size x world_size "
            f"= {micro_batch} x {block_size} x {ranks} = {per_step}; pick a multiple of {per_step} or change the micro-batch"
        )
    return global_batch_tokens // per_step


def apply_global_batch(trainer, global_batch_tokens: Optional[int], micro_batch: int, block_size: int,
                       validate_every_n_steps: Optional[int]) -> None:
    """Gradient accumulation from the global batch, and the validation interval in batches, from the world size
    of the Trainer Lightning built (so devices as an int, a list, "0,1" or "auto", times num_nodes, all count)."""
    if global_batch_tokens is not None:
        trainer.accumulate_grad_batches = accumulation_steps(global_batch_tokens, micro_batch, block_size, trainer.world_size)
    if validate_every_n_steps:
        trainer.val_check_interval = validate_every_n_steps * trainer.accumulate_grad_batches


class CableCLI(LightningCLI):
    def add_arguments_to_parser(self, parser):
        parser.add_argument("--experiment", type=str, default="default", help="runs/<experiment>/<pe>/...")
        parser.add_argument("--runs_dir", type=str, default="runs")
        parser.add_argument("--global_batch_tokens", type=Optional[int], default=None,
                            help="global batch in tokens; sets trainer.accumulate_grad_batches")
        parser.add_lightning_class_args(ModelCheckpoint, "checkpoint")
        parser.add_lightning_class_args(LengthEvalRecorder, "length_eval")
        parser.add_lightning_class_args(BiasPictures, "bias_pictures")
        parser.add_lightning_class_args(TokenThroughput, "throughput")
        parser.set_defaults({
            "checkpoint.save_last": True,
            "checkpoint.save_top_k": -1,
            "checkpoint.every_n_train_steps": 1000,
            "checkpoint.filename": "step{step:07d}",
            "checkpoint.auto_insert_metric_name": False,
            "trainer.gradient_clip_val": 1.0,
        })
        parser.link_arguments("data", "model.init_args.data", compute_fn=describe_prepared, apply_on="instantiate")

    def before_instantiate_classes(self):
        config = self.config[self.subcommand] if self.subcommand else self.config
        backbone = config.model.init_args.backbone
        pe = backbone.pos_encoding if backbone is not None else "cable"
        run_dir = f"{config.runs_dir}/{config.experiment}/{pe}"
        if config.trainer.logger in (None, True):
            config.trainer.logger = {
                "class_path": "lightning.pytorch.loggers.TensorBoardLogger",
                "init_args": {"save_dir": config.runs_dir, "name": f"{config.experiment}/{pe}"},
            }
        if config.checkpoint.dirpath is None:
            config.checkpoint.dirpath = f"{run_dir}/checkpoints"
        self._validate_every_checkpoint = config.trainer.val_check_interval is None and bool(config.checkpoint.every_n_train_steps)
        if self._validate_every_checkpoint:  # in batches, across epochs; scaled by accumulation in before_fit
            config.trainer.val_check_interval = config.checkpoint.every_n_train_steps
            config.trainer.check_val_every_n_epoch = None

    def before_fit(self):
        config = self.config["fit"]
        apply_global_batch(self.trainer, config.global_batch_tokens, self.datamodule.micro_batch_size, self.datamodule.block_size,
                           config.checkpoint.every_n_train_steps if self._validate_every_checkpoint else None)

    def after_fit(self):
        # Every run ends with a perplexity-vs-length record of its final weights (unless the last
        # checkpoint's evaluation already was at the final step).
        results = self.model.length_results
        if not results or results[0]["step"] != self.trainer.global_step:
            self.trainer.validate(self.model, datamodule=self.datamodule, verbose=False)


def main(args: list[str] | None = None) -> CableCLI:
    """Entry point; ``args`` (for tests and scripts) replaces ``sys.argv[1:]``."""
    return CableCLI(LanguageModel, TokenDataModule, subclass_mode_model=True, args=args, save_config_kwargs={"overwrite": True})
