"""The GPT-2 optimisation recipe: AdamW with decay on matrices only, linear warm-up, cosine decay."""

from __future__ import annotations

import dataclasses
import math
from typing import Optional

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


@dataclasses.dataclass(frozen=True)
class OptimizerRecipe:
    """A fit's AdamW and learning-rate schedule, one object built from the module's hyperparameters
    (:meth:`from_hparams`) so the fit, the bare step beside it, the records and the resume check read one set of
    numbers. ``min_lr`` None: no decay, the rate stays at ``lr`` after warm-up. The schedule's length is the trainer's
    ``max_steps``, not the recipe's."""

    lr: float
    min_lr: Optional[float]
    warmup_steps: int
    betas: tuple[float, float]
    eps: float
    weight_decay: float

    def __post_init__(self):
        object.__setattr__(self, "betas", tuple(self.betas))  # a config file's list

    @classmethod
    def names(cls) -> tuple[str, ...]:
        """The hyperparameters a recipe is made of."""
        return tuple(field.name for field in dataclasses.fields(cls))

    @classmethod
    def from_hparams(cls, hparams) -> "OptimizerRecipe":
        return cls(**{name: hparams[name] for name in cls.names()})

    @property
    def floor(self) -> float:
        """The rate the cosine ends at."""
        return self.lr if self.min_lr is None else self.min_lr


class WarmupCosine(torch.optim.lr_scheduler.LRScheduler):
    """:func:`warmup_cosine` as a scheduler whose checkpointed state is the step alone: a resumed run takes lr,
    min_lr, warm-up and max_steps from its configuration (a lower lr after a divergence, more steps), from its first
    step. (LambdaLR would restore the old base lr and scale it by the new recipe.)"""

    def __init__(self, optimizer, recipe: OptimizerRecipe, max_steps: int):
        self.recipe = dict(warmup_steps=recipe.warmup_steps, max_steps=max_steps, lr=recipe.lr, min_lr=recipe.floor)
        super().__init__(optimizer)

    def get_lr(self) -> list[float]:
        return [warmup_cosine(self.last_epoch, **self.recipe)] * len(self.optimizer.param_groups)

    def state_dict(self) -> dict:
        return {"last_epoch": self.last_epoch, "_step_count": self._step_count}

    def load_state_dict(self, state_dict: dict) -> None:
        self.last_epoch, self._step_count = state_dict["last_epoch"], state_dict["_step_count"]
        self._last_lr = self.get_lr()
        for group, lr in zip(self.optimizer.param_groups, self._last_lr):
            group["lr"] = lr  # the optimizer state restored before this carries the old recipe's rate


def keep_implementation(optimizer: torch.optim.Optimizer) -> None:
    """After a checkpoint's optimizer state is loaded: how the step runs (``fused``, ``foreach``) is this run's again.
    torch's loader takes every param_group setting from the checkpoint, so a run resumed from one written unfused
    (an older run, or fp16's grad scaler) stepped unfused. Step counts go where the fused kernel reads them (the
    parameter's device, fp32), as the loader puts a fused checkpoint's."""
    for group in optimizer.param_groups:
        group.update({key: optimizer.defaults[key] for key in ("fused", "foreach")})
        for p in group["params"] if group["fused"] else ():
            state = optimizer.state.get(p, {})
            if "step" in state:
                state["step"] = state["step"].to(dtype=torch.float32, device=p.device)


def build_optimizer(model, recipe: OptimizerRecipe, max_steps: Optional[int], fused: bool = True) -> dict:
    """``recipe``'s AdamW over ``model``'s parameters and its warm-up and cosine over ``max_steps``, as Lightning's
    ``configure_optimizers`` returns them."""
    if max_steps is None or max_steps <= 0:
        raise ConfigError(f"the learning-rate schedule needs trainer.max_steps > 0, got {max_steps}; "
                          "set --trainer.max_steps")
    # fused: one kernel for every parameter's update (on CUDA and CPU alike), instead of a few per parameter group.
    optimizer = torch.optim.AdamW(adamw_param_groups(model, recipe.weight_decay), lr=recipe.lr, betas=recipe.betas,
                                  eps=recipe.eps, fused=fused)
    optimizer.register_load_state_dict_post_hook(keep_implementation)
    schedule = WarmupCosine(optimizer, recipe, max_steps)
    return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}
