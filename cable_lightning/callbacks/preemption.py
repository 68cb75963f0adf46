"""Save on preemption: clusters stop jobs with SIGTERM (and people with Ctrl-C), and SLURM warns a job before its time
limit with the signal of ``#SBATCH --signal=SIGUSR1@90``; this saves ``last.ckpt`` one optimizer step later and
stops the run with ``SIGTERMException``, so that the command line exits with status 143 (130 for Ctrl-C, 138 for
SIGUSR1), not 0, and the requeued job continues with ``--ckpt_path last``. After SLURM's signal, rank 0 also requeues
the job (``scontrol requeue``)."""

from __future__ import annotations

import os
import re
import signal
import subprocess

import lightning as L
import torch
from lightning.fabric.plugins.environments import SLURMEnvironment
from lightning.pytorch.utilities.exceptions import SIGTERMException

from ..eval.work import ReadLater


class PreemptionCheckpoint(L.Callback):
    """Replaces Lightning's SIGTERM handler for fit. Lightning's handler runs a ``broadcast`` inside the signal
    handler, which deadlocks DDP when a rank is signalled twice (by the scheduler and by rank 0's forwarding) or in
    the middle of another collective. Here the handler only sets a flag; at the end of each optimizer step the ranks
    agree on it with one small all-reduce on the device, read back at the end of the next optimizer step (read at
    once, it made every step of a DDP run wait for the device: :class:`eval.work.ReadLater`); then all save
    ``<dirpath>/last.ckpt`` together, and fit stops. So a signal takes effect at the end of the optimizer step after
    the one it arrives in (or at the end of training). Waiting for optimizer steps keeps a gradient accumulation
    whole, so the resumed run is the run that was not interrupted. A SIGTERM during validation takes effect after
    it. The first Ctrl-C does the same; a second one interrupts at once (Lightning's KeyboardInterrupt shutdown, no
    save).

    Under SLURM (Lightning's SLURMEnvironment, i.e. tasks started by ``srun``) its requeue signal (SIGUSR1) is handled
    the same way, and then rank 0 runs ``scontrol requeue``. Lightning's own SIGUSR1 handler is turned off: it saves
    ``hpc_ckpt_N.ckpt`` inside the signal handler, mid-accumulation as likely as not."""

    def __init__(self, dirpath: str):
        self.path = os.path.join(dirpath, "last.ckpt")
        self.requested: int | None = None  # the signal received
        self.requeue_signal: int | None = None  # SLURM's, when the run is under SLURM with requeueing on
        self.requeue = False  # it was received
        self.agreed = ReadLater()  # every rank's flags after an optimizer step, all-reduced, read a step later
        self._flags: torch.Tensor | None = None

    def setup(self, trainer, pl_module, stage):
        environment = trainer._accelerator_connector.cluster_environment  # what Lightning's signal connector reads
        if isinstance(environment, SLURMEnvironment) and environment.auto_requeue:
            self.requeue_signal, environment.auto_requeue = environment.requeue_signal, False

    def on_train_start(self, trainer, pl_module):
        signal.signal(signal.SIGTERM, self._request)  # Lightning restores the original handlers at teardown
        signal.signal(signal.SIGINT, self._request)
        if self.requeue_signal is not None:
            signal.signal(self.requeue_signal, self._request)

    def _request(self, signum, frame):
        self.requested = signum
        self.requeue = self.requeue or signum == self.requeue_signal
        if signum == signal.SIGINT:
            signal.signal(signal.SIGINT, signal.default_int_handler)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if (batch_idx + 1) % trainer.accumulate_grad_batches:
            return  # mid-accumulation: wait for the optimizer step
        agreed = self.agreed.take()  # the ranks' word on the previous optimizer step: done by now
        flags = self.flags(pl_module.device)
        flags[0].fill_(float(self.requested is not None))  # a kernel's argument: nothing uploaded, nothing waits
        flags[1].fill_(float(self.requeue))
        self.agreed.put(trainer.strategy.reduce(flags.clone(), reduce_op="max"))  # any rank's signal, every rank
        if agreed is not None:
            self.stop_if_signalled(trainer, agreed[0], step_end=True)

    def on_train_end(self, trainer, pl_module):
        agreed = self.agreed.take()  # the last optimizer step's word
        if agreed is not None:
            self.stop_if_signalled(trainer, agreed[0])

    def flags(self, device) -> torch.Tensor:
        """(signal received, requeue signal received) on the device, made once."""
        if self._flags is None or self._flags.device != device:
            self._flags = torch.zeros(2, device=device)
        return self._flags

    def stop_if_signalled(self, trainer, agreed: torch.Tensor, step_end: bool = False) -> None:
        """Saves and stops when any rank was signalled. At a step's end (``step_end``), the step's logged metrics go
        to the loggers first: Lightning sends them after the batch-end hooks, which the stop never returns to, so the
        curve lacked the step the checkpoint holds (the loggers are flushed as the stopped fit is torn down)."""
        requested, requeue = (bool(flag) for flag in agreed.tolist())
        if requested:
            requeue = requeue and self.requeue_signal is not None
            if step_end:  # whatever log_every_n_steps says: the saved step ends this run's curve
                connector = trainer._logger_connector
                connector.log_metrics(connector.metrics["log"])
            trainer.save_checkpoint(self.path, weights_only=False)
            stop = SIGTERMException()
            stop.saved_checkpoint = os.path.abspath(self.path)  # for the command line's last word
            # a rank told by the others has no signal of its own
            stop.signum = self.requeue_signal if requeue else self.requested or signal.SIGTERM
            if requeue and trainer.is_global_zero:  # after the save: the requeued job must find it
                stop.requeued = requeue_slurm_job()
            raise stop


def requeue_slurm_job() -> str:
    """``scontrol requeue`` of this job (an array job's task as ``<array job id>_<task id>``, as Lightning names it);
    what happened, in words. A failure is said, not raised: the checkpoint is saved either way."""
    array_job = os.environ.get("SLURM_ARRAY_JOB_ID")
    job = f"{array_job}_{os.environ.get('SLURM_ARRAY_TASK_ID')}" if array_job else os.environ.get("SLURM_JOB_ID", "")
    if not re.fullmatch(r"[0-9_]+", job):
        return f"not requeued: no SLURM job id in the environment ({job!r}); submit the job again"
    try:
        done = subprocess.run(["scontrol", "requeue", job], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"scontrol requeue {job} failed ({type(exc).__name__}: {exc}); requeue or submit the job again"
    if done.returncode:
        said = (done.stderr.strip() or done.stdout.strip() or "no output").splitlines()[-1]
        return f"scontrol requeue {job} failed (exit {done.returncode}: {said}); requeue or submit the job again"
    return f"requeued SLURM job {job}"
