"""LightningModules: causal LM (GPT-2 recipe) and masked LM (BERT recipe) around one backbone."""

from __future__ import annotations

import math
import time
from dataclasses import replace
from typing import Optional

import lightning as L
import torch
from lightning.pytorch.utilities import grad_norm
from torchmetrics.aggregation import MeanMetric

from ..data.masking import mask_tokens
from ..models import BackboneConfig, build_backbone
from ..positional import UnsupportedLengthError
from .optim import build_optimizer


class LanguageModel(L.LightningModule):
    """Shared training/validation logic; subclasses say how a batch becomes (inputs, targets).

    ``vocab_size`` and ``block_size`` override the backbone config: the CLI links them from the data,
    so the tokenizer and the training length are set once, where the data is.
    """

    def __init__(self, backbone: Optional[BackboneConfig] = None, vocab_size: Optional[int] = None,
                 block_size: Optional[int] = None, lr: float = 6e-4, min_lr: float = 6e-5, warmup_steps: int = 750,
                 betas: tuple[float, float] = (0.9, 0.95), eps: float = 1e-8, weight_decay: float = 0.1):
        super().__init__()
        config = backbone or BackboneConfig()
        overrides = {k: v for k, v in dict(vocab_size=vocab_size, block_size=block_size).items() if v is not None}
        self.config = replace(config, **overrides)
        self.save_hyperparameters()
        self.backbone = build_backbone(self.config)
        self.val_nll = torch.nn.ModuleDict()
        self.unsupported_lengths: set[int] = set()
        self._tokens_seen = 0
        self._last_step_time = None

    # --- batches -------------------------------------------------------------------------------
    def split_batch(self, batch: torch.Tensor, train: bool, batch_idx: int = 0):
        raise NotImplementedError

    # --- training ------------------------------------------------------------------------------
    def training_step(self, batch, batch_idx):
        inputs, targets = self.split_batch(batch, train=True)
        loss = self.backbone.loss(inputs, targets)
        tokens = inputs.numel() * self.trainer.world_size
        self._tokens_seen += tokens
        now = time.perf_counter()
        if self._last_step_time is not None:
            self.log("train/tokens_per_sec", tokens / (now - self._last_step_time), prog_bar=True)
        self._last_step_time = now
        self.log("train/loss", loss, prog_bar=True)
        self.log("train/tokens_seen", float(self._tokens_seen))
        self.log("train/lr", self.trainer.optimizers[0].param_groups[0]["lr"])
        return loss

    def on_before_optimizer_step(self, optimizer):
        norms = grad_norm(self.backbone, norm_type=2)
        self.log("train/grad_norm", norms["grad_2.0_norm_total"])

    def configure_optimizers(self):
        h = self.hparams
        return build_optimizer(self.backbone, h.lr, h.min_lr, h.warmup_steps, self.trainer.max_steps, h.betas, h.eps, h.weight_decay)

    # --- validation at one or several lengths --------------------------------------------------
    def eval_lengths(self) -> list[int]:
        datamodule = getattr(self.trainer, "datamodule", None)
        return list(getattr(datamodule, "eval_lengths_resolved", None) or [self.config.block_size])

    def on_validation_epoch_start(self):
        for length in self.eval_lengths():
            if str(length) not in self.val_nll:
                self.val_nll[str(length)] = MeanMetric().to(self.device)

    def validation_step(self, batch, batch_idx, dataloader_idx=0):
        length = self.eval_lengths()[dataloader_idx]
        if length in self.unsupported_lengths:
            return None
        inputs, targets = self.split_batch(batch, train=False, batch_idx=batch_idx)
        try:
            nll = self.backbone.token_nll(inputs, targets)
        except UnsupportedLengthError as err:
            self.unsupported_lengths.add(length)
            self.print(f"length {length}: unsupported ({err})")
            return None
        count = (targets != -100).sum()
        self.val_nll[str(length)].update(nll.sum() / count.clamp(min=1), weight=count)
        return None

    def on_validation_epoch_end(self):
        for length in self.eval_lengths():
            metric = self.val_nll[str(length)]
            if length in self.unsupported_lengths or metric.update_count == 0:
                continue
            loss = metric.compute()
            self.log(f"val_loss/len_{length}", loss, add_dataloader_idx=False, sync_dist=False)
            self.log(f"val_ppl/len_{length}", torch.exp(loss), add_dataloader_idx=False, sync_dist=False)
            if length == self.config.block_size:
                self.log("val/loss", loss, prog_bar=True, add_dataloader_idx=False)
                self.log("val/ppl", torch.exp(loss), add_dataloader_idx=False)
            metric.reset()

    # --- checkpoints carry the tokenizer identity ----------------------------------------------
    def on_save_checkpoint(self, checkpoint):
        datamodule = getattr(self.trainer, "datamodule", None)
        if datamodule is not None and hasattr(datamodule, "tokenizer_identity"):
            checkpoint["tokenizer_identity"] = datamodule.tokenizer_identity

    def on_load_checkpoint(self, checkpoint):
        datamodule = getattr(self._trainer, "datamodule", None) if self._trainer is not None else None
        identity = checkpoint.get("tokenizer_identity")
        if identity is not None and datamodule is not None and hasattr(datamodule, "check_tokenizer"):
            datamodule.check_tokenizer(identity)


class CausalLM(LanguageModel):
    """Next-token prediction; a batch is (B, block + 1) tokens. Default recipe: the paper's GPT-2 one."""

    def split_batch(self, batch, train, batch_idx=0):
        return batch[:, :-1], batch[:, 1:]


class MaskedLM(LanguageModel):
    """BERT-style masked LM: 15% of tokens chosen, 80/10/10 mask/random/keep, loss on chosen tokens.

    Defaults follow the paper's BERT setting (Adam, lr 1e-4); validation masks with a fixed seed
    per batch so losses are comparable across checkpoints.
    """

    def __init__(self, backbone: Optional[BackboneConfig] = None, vocab_size: Optional[int] = None,
                 block_size: Optional[int] = None, lr: float = 1e-4, min_lr: float = 1e-5, warmup_steps: int = 750,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.01,
                 mask_probability: float = 0.15, mask_id: Optional[int] = None, special_ids: tuple[int, ...] = ()):
        backbone = backbone or BackboneConfig(preset="bert-base")
        super().__init__(backbone, vocab_size, block_size, lr, min_lr, warmup_steps, betas, eps, weight_decay)
        if self.config.causal:
            raise ValueError(f"MaskedLM needs a bidirectional backbone; preset {self.config.preset!r} is causal (set backbone.causal: false)")
        if mask_id is None:
            raise ValueError("MaskedLM needs mask_id, the tokenizer's mask token (the CLI links it from the data manifest)")

    def split_batch(self, batch, train, batch_idx=0):
        ids = batch[:, :-1]
        generator = None
        if not train:
            generator = torch.Generator(device=ids.device).manual_seed(1_000_003 + batch_idx)
        return mask_tokens(ids, self.hparams.mask_id, self.config.vocab_size, self.hparams.mask_probability,
                           generator=generator, special_ids=tuple(self.hparams.special_ids))
