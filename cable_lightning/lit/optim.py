"""The GPT-2 optimisation recipe: AdamW with decay on matrices only, linear warm-up, cosine decay."""

from __future__ import annotations

import math

import torch
from torch import nn

from ..errors import ConfigError


def adamw_param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Weight decay on parameters of 2+ dimensions (matmul weights, embeddings); none on biases,
    LayerNorm gains or per-head scalars."""
    decay, no_decay = [], []
    for p in model.parameters():
        if p.requires_grad:
            (decay if p.dim() >= 2 else no_decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def warmup_cosine(step: int, warmup_steps: int, max_steps: int, lr: float, min_lr: float) -> float:
    """Learning rate at ``step``: linear from lr/warmup to lr, then cosine down to ``min_lr`` at ``max_steps``."""
    if step < warmup_steps:
        return lr * (step + 1) / warmup_steps
    if step >= max_steps:
        return min_lr
    progress = (step - warmup_steps) / max(1, max_steps - warmup_steps)
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (lr - min_lr)


def build_optimizer(model, lr, min_lr, warmup_steps, max_steps, betas, eps, weight_decay):
    if max_steps is None or max_steps <= 0:
        raise ConfigError(f"the learning-rate schedule needs trainer.max_steps > 0, got {max_steps}; set --trainer.max_steps")
    optimizer = torch.optim.AdamW(adamw_param_groups(model, weight_decay), lr=lr, betas=tuple(betas), eps=eps)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: warmup_cosine(step, warmup_steps, max_steps, lr, min_lr) / lr
    )
    return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}
