"""The project's clocks (cable_lightning/timing.py): the bare step takes its clipping, accumulation, precision and
optimizer from the fit's trainer and module, and its periods are taken as a fit's steps are."""

import lightning as L
import pytest
import torch

from cable_lightning import timing
from cable_lightning.lit import CausalLM
from cable_lightning.lit.optim import OptimizerRecipe
from cable_lightning.models import BackboneConfig


def attached(**trainer_settings) -> tuple[CausalLM, L.Trainer]:
    torch.manual_seed(0)
    model = CausalLM(BackboneConfig(preset="gpt2-tiny", n_layer=1, n_head=2, n_embd=32, vocab_size=256, block_size=16),
                     lr=3e-3, betas=(0.85, 0.9), eps=1e-7, weight_decay=0.2)
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=10, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, **trainer_settings)
    model.trainer = trainer
    return model, trainer


@pytest.mark.parametrize("clip, algorithm", [(None, None), (0.25, "value"), (0.5, "norm")])
def test_the_bare_step_clips_accumulates_and_casts_as_its_trainer_says(clip, algorithm, monkeypatch):
    """Accumulating 2 batches under bf16-mixed: every call runs the loss under bf16 autocast, every second one clips
    by the trainer's value and algorithm (none with clipping off) and steps the optimizer."""
    model, trainer = attached(gradient_clip_val=clip, gradient_clip_algorithm=algorithm, accumulate_grad_batches=2,
                              precision="bf16-mixed")
    clipped, casts = [], []
    for name in ("clip_grad_value_", "clip_grads_with_norm_"):
        real = getattr(torch.nn.utils, name)
        monkeypatch.setattr(torch.nn.utils, name, lambda params, value, *args, real=real, name=name: (
            clipped.append((name, value)), real(params, value, *args))[1])
    loss = model.batch_loss
    monkeypatch.setattr(model, "batch_loss", lambda batch: casts.append(
        torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu")) or loss(batch))
    step = timing.BareStep(model, trainer, rows=2, length=16)
    stepped = []
    optimizer_step = step.optimizer.step
    step.optimizer.step = lambda: stepped.append(len(casts)) or optimizer_step()
    for _ in range(4):
        step()
    assert casts == [torch.bfloat16] * 4 and stepped == [2, 4]
    name = {"value": "clip_grad_value_", "norm": "clip_grads_with_norm_"}.get(algorithm)
    assert clipped == ([] if clip is None else [(name, clip)] * 2)


def test_the_bare_steps_optimizer_is_the_modules_recipe():
    model, trainer = attached()
    assert model.optimizer_recipe == OptimizerRecipe(lr=3e-3, min_lr=6e-5, warmup_steps=750, betas=(0.85, 0.9),
                                                     eps=1e-7, weight_decay=0.2)
    groups = timing.BareStep(model, trainer, rows=2, length=16).optimizer.param_groups
    assert [(g["initial_lr"], g["betas"], g["eps"], g["weight_decay"]) for g in groups] == [
        (3e-3, (0.85, 0.9), 1e-7, 0.2), (3e-3, (0.85, 0.9), 1e-7, 0.0)]


class HandClock:
    """timing's ``time``, moved by the steps themselves."""

    def __init__(self):
        self.now = 0.0

    def perf_counter(self) -> float:
        return self.now


def test_step_periods_time_each_step_from_its_start_to_the_next_after_the_warm_up(monkeypatch):
    """Step k takes k seconds on a stubbed clock: the two warm-up steps are left out, and each timed period is its own
    step's."""
    clock = HandClock()
    monkeypatch.setattr(timing, "time", clock)
    calls = []

    def step():
        calls.append(1)
        clock.now += len(calls)

    assert timing.step_periods(step, warmup=2, steps=3, device=torch.device("cpu")) == [3.0, 4.0, 5.0]
    assert len(calls) == 5
