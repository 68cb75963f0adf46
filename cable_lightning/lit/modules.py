"""LightningModules: causal LM (GPT-2 recipe) and masked LM (BERT recipe) around one backbone."""

from __future__ import annotations

import time
from dataclasses import replace
from functools import cached_property
from typing import Callable, Optional

import lightning as L
import torch
from lightning.pytorch.strategies import ModelParallelStrategy
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from ..checkpoints import read_checkpoint, shown_name
from ..data.layouts import TrainingLayout, check_encoding, layout_generator, micro_batch_seed, randomized_positions
from ..data.manifest import DataInfo
from ..errors import ConfigError
from ..hardware import device_name
from ..models import BackboneConfig, build_backbone
from ..positional.layout import Layout
from ..records.schema import RunContext
from ..tasks.scoring import Predict, argmax_predictions, decoder_inputs, masked_inputs, masked_predictions
from .checkpoint_format import saved_weights
from .divergence import DivergenceGuard
from .length_eval import LengthEvaluation
from .masking import IGNORE_INDEX, mask_tokens, position_draws
from .optim import OptimizerRecipe, build_optimizer
from .resume import (
    SAME_MODEL,
    carry_accumulation,
    check_lineage,
    check_same_data,
    check_same_length,
    check_same_model,
    check_same_training,
    global_batch,
    record_run,
    run_data,
)


class LanguageModel(DivergenceGuard, LengthEvaluation, L.LightningModule):
    """Shared training logic, with validation at every length (:class:`LengthEvaluation`) and the guard against
    divergence (:class:`DivergenceGuard`); subclasses say how a batch becomes (inputs, targets).

    ``data`` is the data's description (:class:`DataInfo`, or its ``as_dict()`` as the CLI links it): its
    vocabulary size and training length override the backbone config, its evaluation specs say what
    validation measures, and its tokenizer identity is checked against a checkpoint's on load.

    ``init_weights``: a checkpoint whose weights a new fit starts from (fine-tuning: optimizer, schedule and step
    start afresh, unlike ``--ckpt_path``, which resumes a run); its model must have the same weight-defining
    settings and tokenizer.
    """

    def __init__(self, backbone: Optional[BackboneConfig] = None, data: Optional[dict] = None, lr: float = 6e-4,
                 min_lr: Optional[float] = 6e-5, warmup_steps: int = 750, betas: tuple[float, float] = (0.9, 0.95),
                 eps: float = 1e-8, weight_decay: float = 0.1, compile: bool = False,
                 activation_checkpointing: bool = False, init_weights: Optional[str] = None):
        super().__init__()
        self.save_hyperparameters()
        self.data_info = data if isinstance(data, DataInfo) or data is None else DataInfo.from_dict(data)
        config = backbone or BackboneConfig()
        if self.data_info is not None:
            self.hparams["data"] = self.data_info.as_dict()  # plain values: checkpoints load with weights_only
            config = replace(config, vocab_size=self.data_info.vocab_size, block_size=self.data_info.block_size)
        self.config = config
        self.backbone = build_backbone(self.config)
        self.backbone.activation_checkpointing = activation_checkpointing
        # What training sees of a block (data.layout: documents, positions, length schedule), checked against the
        # encoding before anything runs
        self.layout = TrainingLayout.from_dict(self.data_info.layout if self.data_info is not None else None)
        check_encoding(self.layout, self.backbone.pe)
        self.trained_layout: Optional[TrainingLayout] = None  # a loaded checkpoint's: what its weights were trained on
        if self.config.trained_length and (self.backbone.pe.longest or self.config.block_size) < self.config.block_size:
            raise ConfigError(f"{self.config.pos_encoding.label()} serves {self.backbone.pe.longest} positions (it was "
                              f"trained at {self.config.trained_length}); it cannot be extended to block_size "
                              f"{self.config.block_size}: extend an encoding that serves any length")
        self.init_length_evaluation()  # after the backbone, which the model summary lists first
        self.loaded_step: Optional[int] = None  # global step of the checkpoint loaded for validate/test
        self.trained_recipe: Optional[dict] = None  # a loaded checkpoint's recipe (None: written before recipes)
        self.fit_recipe: Optional[dict] = None  # this process's fit's (see recipe)
        # The run's seed_everything (set by the CLI, kept in checkpoints and taken from a loaded one); in every record
        self.run_seed: Optional[int] = None
        self._last_step_time = None
        self.init_divergence_guard()
        self._grad_norm: Optional[torch.Tensor] = None  # measured before the optimizer step, then clipped by

    @cached_property
    def _flops_per_token(self) -> float:
        return self.backbone.training_flops_per_token(self.config.block_size)

    # --- batches -------------------------------------------------------------------------------
    def split_batch(self, batch: torch.Tensor, train: bool, batch_idx: int = 0, start: Optional[torch.Tensor] = None):
        """(inputs, targets) of a (B, L + 1) batch; ``start``: in evaluation, each window's first stream position."""
        raise NotImplementedError

    def on_fit_start(self) -> None:
        # After Lightning restored a resumed run (trainer.ckpt_path is set then): that run's own checkpoint holds the
        # weights, and init_weights may be gone. Copied in place, so the optimizer keeps its parameters.
        if self.hparams.init_weights and self.trainer.ckpt_path is None:
            self.load_initial_weights(self.hparams.init_weights)

    def load_initial_weights(self, path: str) -> None:
        """The backbone's weights from a checkpoint of the same model (checked first, one line per problem)."""
        checkpoint = read_checkpoint(path, weights_only=True)
        check_same_model(checkpoint, self.config, self.data_info, f"model.init_weights {path} is of another model: ",
                         "; configure the model it was trained with")
        check_lineage(checkpoint, self.config, path)
        prefix = "backbone."
        weights = {k[len(prefix):]: v for k, v in saved_weights(checkpoint).items() if k.startswith(prefix)}
        self.backbone.load_state_dict(weights)
        self.print(f"initial weights from {path} (step {checkpoint.get('global_step')})")

    def configure_model(self):
        # Lightning calls this once per fit/validate: it must be idempotent.
        if self.hparams.compile:
            self.backbone.compile_blocks()
        strategy = self._trainer.strategy if self._trainer is not None else None
        if isinstance(strategy, ModelParallelStrategy) and not isinstance(self.backbone, FSDPModule):
            self.shard(self.device_mesh["data_parallel"], self.trainer.precision)

    def shard(self, mesh, precision: str) -> None:
        """FSDP2 (``fully_shard``): each block is one unit (its parameters gathered for its forward and backward,
        then freed), the rest (embedding, final norm, the encoding's own weights) the root unit. Under
        ``bf16-mixed`` the gathered parameters and the computation are bf16 while the sharded master weights,
        optimizer state and gradient reduction stay fp32 (FSDP2's ``MixedPrecisionPolicy``)."""
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard, register_fsdp_forward_method

        policy = (MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
                  if precision == "bf16-mixed" else MixedPrecisionPolicy())
        for block in self.backbone.blocks:
            fully_shard(block, mesh=mesh, mp_policy=policy)
        fully_shard(self.backbone, mesh=mesh, mp_policy=policy)
        # Training and validation call token_nll (through loss), the task evaluation argmax_tokens, not forward:
        # they must gather the root's parameters. (Neither calls the other: the root would reshard in between.)
        for method in ("token_nll", "argmax_tokens"):
            register_fsdp_forward_method(self.backbone, method)

    # --- training ------------------------------------------------------------------------------
    def batch_layout(self, inputs: torch.Tensor, train: bool, batch_idx: int = 0):
        """The layout (documents, positions, the schedule's window) of a batch's inputs under ``data.layout``; None
        where it is packed, contiguous and full-length (documents end at the end-of-text id, which masking for MLM never
        replaces)."""
        if not self.layout.active:
            return None
        generator = (layout_generator(self.run_seed or 0, self.global_step, batch_idx, self.global_rank)
                     if train and self.layout.reads_positions() else None)
        return self.layout.build(inputs, self.data_info.eot_id, self.global_step, train, generator)

    def layout_label(self) -> Optional[str]:
        """Records' ``layout``: what the weights were trained on (a loaded checkpoint's data.layout, so a validate
        with another command line is still recorded as that run), else this run's."""
        return (self.trained_layout or self.layout).label(self.config.block_size)

    def batch_loss(self, batch, batch_idx: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """(training loss, inputs) of a training batch: the mean NLL of its targets, or for a batch with task rows
        (``TokenDataModule.task_batch``) the mean weighted by each target's ``loss_weight``."""
        if isinstance(batch, dict):
            inputs, targets = self.split_batch(batch["tokens"], train=True, batch_idx=batch_idx)
            nll = self.backbone.token_nll(inputs, targets, layout=self.batch_layout(inputs, True, batch_idx))
            return weighted_loss(nll, batch["loss_weight"]), inputs
        inputs, targets = self.split_batch(batch, train=True, batch_idx=batch_idx)
        return self.backbone.loss(inputs, targets, layout=self.batch_layout(inputs, True, batch_idx)), inputs

    def training_step(self, batch, batch_idx):
        # Dropout draws from the global generator: seeded from this micro-batch alone, the run's draws do not depend
        # on what ran before it (an evaluation's loader takes a draw from it) and are the same after a resume.
        torch.manual_seed(micro_batch_seed(self.run_seed or 0, self.global_step, batch_idx, self.global_rank, 1))
        loss, inputs = self.batch_loss(batch, batch_idx)
        self._last_loss = loss.detach()
        self.flops_per_batch = inputs.numel() * self._flops_per_token  # read by TokenThroughput for MFU
        tokens = inputs.numel() * self.trainer.world_size
        # Derived from the loop's batch count, which a resumed run restores.
        tokens_seen = (self.trainer.fit_loop.epoch_loop.total_batch_idx + 1) * tokens
        now = time.perf_counter()
        if self._last_step_time is not None:
            # Progress bar only (console.LoggingStepBar): TensorBoard gets TokenThroughput's train/device/items_per_sec
            self.log("tokens_per_sec", on_host(tokens / (now - self._last_step_time)), logger=False)
        self._last_step_time = now
        # Not prog_bar=True: Lightning reads every such value back at every batch's end (a host sync on a GPU);
        # the progress bar reads the loss where it refreshes (console.LoggingStepBar)
        self.log("train/loss", loss)
        self.log("train/tokens_seen", on_host(tokens_seen))
        self.log("train/lr", on_host(self.trainer.optimizers[0].param_groups[0]["lr"]))
        if self.layout.schedule != "none":
            self.log("train/window", on_host(self.layout.window(self.global_step, self.config.block_size)))
        return loss

    def on_before_optimizer_step(self, optimizer):
        self.stop_if_diverged()  # the previous step's verdict, done by now: reading it waits for nothing
        norm = self.measure_grad_norm()
        if isinstance(norm, DTensor):  # sharded (FSDP2): the norm of every rank's shard
            norm = norm.full_tensor()
        self.log("train/grad_norm", norm)
        self.hold_back_if_diverged(optimizer, norm)

    def measure_grad_norm(self) -> torch.Tensor:
        """The gradients' total 2-norm, kept for :meth:`configure_gradient_clipping` to clip by (the fit's step and
        the bare step beside it, ``timing.BareStep``, measure it here)."""
        grads = [p.grad for p in self.backbone.parameters() if p.grad is not None]
        self._grad_norm = torch.nn.utils.get_total_norm(grads, 2.0) if grads else torch.zeros(())
        return self._grad_norm

    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None):
        """Clip by the norm :meth:`on_before_optimizer_step` measured (one pass over the gradients, not two), here
        rather than in Lightning's precision plugin, which refuses to clip for a fused optimizer (under a grad scaler
        the optimizer is not fused: its gradients are unscaled before this, as the norm needs)."""
        if not gradient_clip_val:
            return
        params = [p for p in self.backbone.parameters() if p.grad is not None]
        if gradient_clip_algorithm == "value":
            torch.nn.utils.clip_grad_value_(params, gradient_clip_val)
        else:
            torch.nn.utils.clip_grads_with_norm_(params, gradient_clip_val, self._grad_norm)

    def on_save_checkpoint(self, checkpoint):
        self.check_savable()
        record_run(checkpoint, self.run_seed, global_batch(self._trainer, self.config.block_size), self.recipe(),
                   run_data(getattr(self._trainer, "datamodule", None)))

    @cached_property
    def optimizer_recipe(self) -> OptimizerRecipe:
        """The optimizer and schedule settings of the hyperparameters, built once: what the fit's optimizer, the bare
        step beside it and :meth:`recipe` read."""
        return OptimizerRecipe.from_hparams(self.hparams)

    def configure_optimizers(self):
        # fp16's grad scaler unscales the gradients before clipping; a fused optimizer would unscale them itself
        fused = getattr(self.trainer.precision_plugin, "scaler", None) is None
        return build_optimizer(self.backbone, self.optimizer_recipe, self.trainer.max_steps, fused=fused)

    def record_context(self, step: int, checkpoint: Optional[str], recipe: Optional[dict]) -> RunContext:
        """What every record of this run names (:class:`records.schema.Record`): the run (encoding, training layout and
        extension, seed, learning rate, backbone), the step and stage measured, and what lets runs of several
        machines join one table: the corpus measured, the training's recipe and the device."""
        data = getattr(self.trainer, "datamodule", None)
        return RunContext(pe=self.config.label(), train_length=self.config.original_length,
                          extended_to=self.config.block_size if self.config.trained_length else None,
                          layout=self.layout_label(), step=step, stage=self.trainer.state.fn.value,
                          checkpoint=checkpoint, run_seed=self.run_seed, lr=self.hparams.lr, model=self.config.shape(),
                          corpus_hash=data.corpus_hash() if hasattr(data, "corpus_hash") else None, recipe=recipe,
                          machine=device_name(self.device), settings=self.run_settings())

    def run_settings(self) -> dict:
        """The settings a record's run key holds besides the encoding's name (:attr:`records.schema.Record.settings`):
        what defines the weights (the backbone's shape and the encoding's own settings) and dropout."""
        settings = {k: v for k, v in self.config.weight_settings().items() if k != "pos_encoding"}
        return settings | {"dropout": self.config.dropout}

    def recipe(self) -> Optional[dict]:
        """The settings that define this fit's training besides those a record's run key holds (encoding, training
        length, layout, seed, peak learning rate, backbone): the steps, the tokens of an optimizer step, the schedule
        and optimizer, clipping, the precision (bf16-mixed and fp32 runs round differently: two experiments) and the
        tokenizer (its vocabulary's hash). Saved in checkpoints, so a later
        validation records its weights' recipe; outside a fit, the last fit's of this process (None without one)."""
        trainer, optimizer = self.trainer, self.optimizer_recipe
        if trainer.state.fn == "fit":
            batch = global_batch(trainer, self.config.block_size)
            self.fit_recipe = {
                "steps": trainer.max_steps, "batch_tokens": batch["tokens"] if batch else None,
                "warmup_steps": optimizer.warmup_steps, "min_lr": optimizer.min_lr, "betas": list(optimizer.betas),
                "eps": optimizer.eps, "weight_decay": optimizer.weight_decay,
                "gradient_clip": trainer.gradient_clip_val, "precision": str(trainer.precision),
                "tokenizer": self.data_info.tokenizer.get("hash") if self.data_info is not None else None}
        return self.fit_recipe

    def on_load_checkpoint(self, checkpoint):
        """Before the weights are loaded: the checkpoint must be of this model (same shapes, PE family, tokenizer,
        training length), so that a mismatch is one line naming the setting, not a state-dict error."""
        saved_data = (checkpoint.get("hyper_parameters") or {}).get("data") or {}
        check_same_length(checkpoint, self.data_info.block_size if self.data_info is not None else None)
        check_same_model(checkpoint, self.config, self.data_info, "the checkpoint's model differs from the configured "
                         "one in settings that define the weights: ", SAME_MODEL)
        datamodule = getattr(self._trainer, "datamodule", None) if self._trainer is not None else None
        if datamodule is not None and (data := run_data(datamodule)) is not None:  # a corpus this run prepared first
            check_same_data(checkpoint.get("run_data"), data, self._trainer.state.fn.value,
                            shown_name(self._trainer.ckpt_path))
        if "state_dict" in checkpoint:  # FSDP2 (ModelParallelStrategy) has loaded the weights itself and taken them
            checkpoint["state_dict"] = saved_weights(checkpoint)
        self.loaded_step = int(checkpoint.get("global_step", 0))
        if self._trainer is not None and self._trainer.state.fn == "fit":  # a resume, not an evaluation
            path, batch = shown_name(self._trainer.ckpt_path), global_batch(self._trainer, self.config.block_size)
            check_same_training(checkpoint, self.layout, batch, path)
            if (carried := carry_accumulation(checkpoint, batch, path)) is not None:
                self.print(carried)
        if "layout" in saved_data:  # written by a version with data.layout (absent: packed, contiguous)
            self.trained_layout = TrainingLayout.from_dict(saved_data["layout"])
        # The run these weights belong to (None: written before seeds were recorded), not this command's seed.
        self.run_seed = checkpoint.get("run_seed")
        self.trained_recipe = checkpoint.get("recipe")


def on_host(number: float) -> torch.Tensor:
    """A number to ``self.log`` at every step, as a CPU tensor: Lightning copies a Python number to the module's
    device, which on a GPU is a blocking copy (a host sync) per number and step."""
    return torch.tensor(float(number))


def weighted_loss(nll: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The weighted mean of per-target NLLs: targets of weight 0 (a task's non-answer tokens) add nothing."""
    weight = weight.to(nll.dtype)
    return (nll * weight).sum() / weight.sum().clamp(min=torch.finfo(nll.dtype).tiny)


class CausalLM(LanguageModel):
    """Next-token prediction; a batch is (B, block + 1) tokens. Default recipe: the paper's GPT-2 one."""

    def split_batch(self, batch, train, batch_idx=0, start=None):
        return batch[:, :-1], batch[:, 1:]

    def task_predictions(self) -> Predict:
        """How a task example is asked: the answer predicted after the question (:func:`argmax_predictions`)."""
        return argmax_predictions(self.backbone)

    def task_inputs(self, ids: torch.Tensor, answer: torch.Tensor) -> torch.Tensor:
        """What the model reads of task examples ``ids`` (B, L + 1) (:func:`decoder_inputs`)."""
        return decoder_inputs(ids, answer)

    def task_layout(self) -> Callable[[torch.Tensor], Optional[Layout]]:
        """The positions task inputs are read at: 0, 1, 2, ... (None)."""
        return lambda inputs: None


EVAL_MASK_SEED = 1_000_003  # the validation stream's fixed masking (position_draws)
EVAL_POSITIONS_SEED = 1_000_033  # a task evaluation's randomized positions, for weights trained at randomized ones


class MaskedLM(LanguageModel):
    """BERT-style masked LM: 15% of tokens chosen, 80/10/10 mask/random/keep, loss on chosen tokens.

    Defaults follow the paper's BERT setting (Adam, lr 1e-4). ``mask_id`` and ``special_ids`` come
    from the data's description when not given.
    """

    def __init__(self, backbone: Optional[BackboneConfig] = None, data: Optional[dict] = None, lr: float = 1e-4,
                 min_lr: Optional[float] = 1e-5, warmup_steps: int = 750, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.01, compile: bool = False,
                 activation_checkpointing: bool = False, mask_probability: float = 0.15, mask_id: Optional[int] = None,
                 special_ids: tuple[int, ...] = (), init_weights: Optional[str] = None):
        backbone = backbone or BackboneConfig(preset="bert-base")
        super().__init__(backbone, data, lr, min_lr, warmup_steps, betas, eps, weight_decay, compile,
                         activation_checkpointing, init_weights)
        if self.config.causal:  # name what made it causal: the preset, or a backbone.causal set over it
            from ..models.config import PRESETS

            preset = self.config.preset
            raise ConfigError("MaskedLM needs a bidirectional backbone; " + (
                f"preset {preset!r} is causal (set backbone.causal: false)" if PRESETS[preset]["causal"] else
                f"backbone.causal is set to true over preset {preset!r}, which is bidirectional (drop it or set "
                "backbone.causal: false)"))
        info = self.data_info
        self.mask_id = mask_id if mask_id is not None or info is None else info.mask_id
        self.special_ids = tuple(special_ids) or (info.special_ids if info else ())
        if self.mask_id is None:
            name = info.tokenizer["name"] if info else "(no data given)"
            raise ConfigError(f"MaskedLM needs a mask token, and tokenizer {name!r} has none; prepare the data with a "
                              "tokenizer that has [MASK] or <|mask|> (bpe:N, bert-base-uncased, gpt2) "
                              "or pass model.mask_id")

    def split_batch(self, batch, train, batch_idx=0, start=None):
        """Training masks come from a generator seeded by (step, batch, rank): resuming replays the same masks.
        Evaluation masks each token by its position in the validation stream (``start``: each window's first
        position), so every length and checkpoint scores the same masked tokens and MLM perplexities compare."""
        ids = batch[:, :-1]
        if train:
            return self.training_masking(ids, batch_idx)
        positions = start.to(ids.device)[:, None] + torch.arange(ids.shape[1], device=ids.device)
        return mask_tokens(ids, self.mask_id, self.config.vocab_size, self.hparams.mask_probability,
                           special_ids=self.special_ids, draws=position_draws(positions, EVAL_MASK_SEED))

    def training_masking(self, ids: torch.Tensor, batch_idx: int, maskable: Optional[torch.Tensor] = None):
        """The BERT masking of a training batch, drawn from (step, batch, rank)."""
        generator = torch.Generator(ids.device).manual_seed(hash((self.global_step, batch_idx, self.global_rank)))
        draws = torch.rand((3, *ids.shape), generator=generator, device=ids.device)
        return mask_tokens(ids, self.mask_id, self.config.vocab_size, self.hparams.mask_probability,
                           special_ids=self.special_ids, draws=draws, maskable=maskable)

    def batch_loss(self, batch, batch_idx: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """A batch with task rows (``TokenDataModule.task_batch``) is read from its second token on, so that a task's
        answer, which ends its row, is inside. Every answer token is masked, always (never kept or swapped, which
        would show it) and weighs 1. The ordinary masking draws only from the other tokens of rows whose other
        targets weigh something (corpus rows, and task rows under ``data.lm_loss_weight`` > 0): with weight 0 it
        would only blur the task's context."""
        if not isinstance(batch, dict):
            return super().batch_loss(batch, batch_idx)
        ids, answer, weight = batch["tokens"][:, 1:], batch["answer"], batch["loss_weight"]
        inputs, labels = self.training_masking(ids, batch_idx, maskable=~answer & (weight > 0))
        inputs = inputs.masked_fill(answer, self.mask_id)
        labels = torch.where(answer, ids, labels)
        nll = self.backbone.token_nll(inputs, labels, layout=self.batch_layout(inputs, True, batch_idx))
        return weighted_loss(nll, torch.where(labels == IGNORE_INDEX, 0.0, weight)), inputs

    def task_predictions(self) -> Predict:
        """How a task example is asked: every answer token masked and filled in at once (:func:`masked_predictions`),
        at the positions of :meth:`task_layout`."""
        return masked_predictions(self.backbone, self.mask_id, layout=self.task_layout())

    def task_layout(self) -> Callable[[torch.Tensor], Optional[Layout]]:
        """The positions task inputs are read at (inputs -> Layout, None: 0, 1, 2, ...). Weights trained at
        randomized positions read them at randomized positions from the same range, as Ruoss et al. test them: a
        fresh generator from a fixed seed, so every evaluation (and the diagnostics) draws the same."""
        layout = self.trained_layout or self.layout
        if layout.positions != "randomized":
            return lambda inputs: None
        generator = torch.Generator().manual_seed(EVAL_POSITIONS_SEED)

        def positions(inputs):
            contiguous = Layout.build(*inputs.shape, inputs.device)
            drawn = randomized_positions(contiguous, layout.position_range, generator)
            return Layout.build(*inputs.shape, inputs.device, positions=drawn)

        return positions

    def task_inputs(self, ids: torch.Tensor, answer: torch.Tensor) -> torch.Tensor:
        """What the model reads of task examples ``ids`` (B, L + 1) (:func:`masked_inputs`)."""
        return masked_inputs(ids, answer, self.mask_id)
