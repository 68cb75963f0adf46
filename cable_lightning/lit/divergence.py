"""The LightningModules' guard against divergence: a non-finite loss or gradient never reaches the weights, the run
stops at the next step, checkpoint or its end with a line naming the step and the checkpoint to resume from, and no
checkpoint holds non-finite weights."""

from __future__ import annotations

from typing import Optional

import torch
from torch.distributed.tensor import DTensor

from ..errors import RunFailedError
from ..eval.work import ReadLater


class DivergenceGuard:
    """Mixed into :class:`lit.modules.LanguageModel`, which sets ``_last_loss`` at each training step, calls
    :meth:`hold_back_if_diverged` before each optimizer step and :meth:`check_savable` before each checkpoint; it
    reads the module's ``backbone``, ``trainer`` and ``global_step``."""

    def init_divergence_guard(self) -> None:
        self._last_loss: Optional[torch.Tensor] = None
        self._verdict = ReadLater()  # the last optimizer step's "loss or gradient not finite", read a step late

    def hold_back_if_diverged(self, optimizer, norm: torch.Tensor) -> None:
        """A non-finite loss or gradient never reaches the weights: the fused optimizer is told so on the device
        (``found_inf``, as a grad scaler tells it: the weights and its state stay as they were) and the run stops at
        the next step, its next checkpoint or its end (:meth:`stop_if_diverged`), without waiting for the device at
        this one (:class:`eval.work.ReadLater`: the wait cost 4.4 ms of a 33.4 ms step on an H100). An optimizer that
        cannot be told (not fused: under fp16's grad scaler, which skips inf gradients itself, so only the loss counts
        there) is stopped here, waiting. All ranks decide together."""
        loss = self._last_loss if self._last_loss is not None else torch.zeros(())
        scaler = getattr(self.trainer.precision_plugin, "scaler", None)
        finite = torch.isfinite(loss) & (torch.isfinite(norm.to(loss.device)) if scaler is None else True)
        bad = self.trainer.strategy.reduce((~finite).float(), reduce_op="max")  # on the device: no rank waits
        optimizer = getattr(optimizer, "optimizer", optimizer)  # Lightning's wrapper, or torch's own
        self._verdict.put(bad, self.global_step, loss, norm)
        if all(group.get("fused") for group in optimizer.param_groups):
            optimizer.found_inf = bad
        else:
            self.stop_if_diverged()

    def stop_if_diverged(self) -> None:
        """Stops the run if the last optimizer step's loss or gradient was non-finite (:meth:`hold_back_if_diverged`
        kept it from the weights, and no checkpoint is written after it)."""
        taken = self._verdict.take()
        if taken is None or not bool(taken[0]):
            return
        step, loss, norm = taken[1]
        saved = getattr(self.trainer.checkpoint_callback, "last_model_path", "") or None
        raise RunFailedError(
            f"training diverged at step {step}: loss {loss.item():.4g}, gradient norm {norm.item():.4g}; "
            "the update was not applied and no checkpoint was written from it; "
            + (f"the last checkpoint is {saved}: resume from it" if saved
               else "no checkpoint was written before it: restart")
            + " with a lower model.lr or longer model.warmup_steps")

    def on_train_end(self):
        self.stop_if_diverged()  # the last step's verdict

    def check_savable(self) -> None:
        """Refuses a checkpoint of a step whose update was held back, or of weights that are not finite (a finite
        but huge update can overflow them); sharded (FSDP2), each rank checks its shard and all decide together."""
        self.stop_if_diverged()  # never a checkpoint of a step whose update was held back
        bad = [name for name, p in self.backbone.named_parameters()
               if not torch.isfinite(p.to_local() if isinstance(p, DTensor) else p).all()]
        if self.trainer.strategy.reduce_boolean_decision(bool(bad), all=False):
            where = f"{bad[0]} and {len(bad) - 1} more" if bad else "on another rank"
            raise RunFailedError(f"weights at step {self.global_step} are not finite ({where}); "
                                 "not saving them; the checkpoints already written are finite")
