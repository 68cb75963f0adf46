"""Save on preemption: clusters stop jobs with SIGTERM (and people with Ctrl-C); this saves ``last.ckpt`` at the
next optimizer step and stops the run with ``SIGTERMException``, so that the command line exits with status 143
(130 for Ctrl-C), not 0, and the requeued job continues with ``--ckpt_path last``."""

from __future__ import annotations

import os
import signal

import lightning as L
from lightning.pytorch.utilities.exceptions import SIGTERMException


class PreemptionCheckpoint(L.Callback):
    """Replaces Lightning's SIGTERM handler for fit. Lightning's handler runs a ``broadcast`` inside the signal
    handler, which deadlocks DDP when a rank is signalled twice (by the scheduler and by rank 0's forwarding) or in
    the middle of another collective. Here the handler only sets a flag; at the end of each optimizer step the ranks
    agree on it with one small all-reduce (nothing on a single device), all save ``<dirpath>/last.ckpt`` together,
    and fit stops. Waiting for the optimizer step keeps a gradient accumulation whole, so the resumed run is the
    run that was not interrupted. A SIGTERM during validation takes effect after it. The first Ctrl-C does the same;
    a second one interrupts at once (Lightning's KeyboardInterrupt shutdown, no save)."""

    def __init__(self, dirpath: str):
        self.path = os.path.join(dirpath, "last.ckpt")
        self.requested: int | None = None  # the signal received

    def on_train_start(self, trainer, pl_module):
        signal.signal(signal.SIGTERM, self._request)  # Lightning restores the original handlers at teardown
        signal.signal(signal.SIGINT, self._request)

    def _request(self, signum, frame):
        self.requested = signum
        if signum == signal.SIGINT:
            signal.signal(signal.SIGINT, signal.default_int_handler)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if (batch_idx + 1) % trainer.accumulate_grad_batches:
            return  # mid-accumulation: wait for the optimizer step
        if trainer.strategy.reduce_boolean_decision(self.requested is not None, all=False):
            trainer.save_checkpoint(self.path, weights_only=False)
            stop = SIGTERMException()
            stop.saved_checkpoint = os.path.abspath(self.path)  # for the command line's last word
            stop.signum = self.requested or signal.SIGTERM  # a rank told by the others has none of its own
            raise stop
