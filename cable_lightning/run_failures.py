"""How a run that fails says so: a lost peer process, a full disk where a logger writes, a config file that could not
be written, a stop signal; each in one line naming what was kept. A refused run removes the empty log folder it made."""

from __future__ import annotations

import os
import re
import shutil
import signal
import sys
import threading
from typing import Optional

import torch
from lightning.pytorch.cli import SaveConfigCallback
from lightning.pytorch.loggers import TensorBoardLogger
from lightning.pytorch.utilities.exceptions import SIGTERMException

from .checkpoints import checkpoint_step
from .errors import DEBUG_VARIABLE, ConfigError, RunFailedError, full_disk, space_left, user_error


class SavedConfig(SaveConfigCallback):
    """Lightning's writer of the run's ``config.yaml``; a failed write (a full logs folder) is one line naming the
    file."""

    def setup(self, trainer, pl_module, stage: str) -> None:
        try:
            super().setup(trainer, pl_module, stage)
        except OSError as exc:
            path = os.path.join(trainer.log_dir or ".", self.config_filename)
            raise RunFailedError(f"could not write {path} ({type(exc).__name__}: {exc}; {space_left(path)}); "
                                 "nothing was trained") from exc


# gloo's transport, which names itself in every error (a peer's connection closed or reset, a receive timed out); NCCL's
# errors are DistBackendError. A "Connection reset by peer" of anything else (an object store's) is not a lost peer.
PEER_LOST = re.compile(r"/gloo/transport/")


def lost_peer(exc: BaseException) -> Optional[BaseException]:
    """The collective's error behind ``exc`` when another process of the run went away (torch.distributed's own
    errors, or gloo's RuntimeError naming its transport), or None."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, torch.distributed.DistError) or (isinstance(exc, RuntimeError)
                                                             and PEER_LOST.search(str(exc))):
            return exc
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__
    return None


def lost_peer_line(trainer, subcommand: str, lost: BaseException) -> str:
    """What a process says when another of its run went away (a node killed or lost): its collective fails, and
    the last checkpoint stands. Its own words first, as gloo's are a wall of text."""
    said = re.sub(r"^\[[^\]]*\]\s*", "", str(lost).strip()).split(". ")[0]  # without gloo's source-file prefix
    processes, nodes = trainer.world_size, trainer.num_nodes
    where = (f"{subcommand} lost another process of this run ({processes} process{'es' * (processes > 1)} on "
             f"{nodes} node{'s' * (nodes > 1)}; this is rank {trainer.global_rank}) "
             f"at step {trainer.global_step}: {type(lost).__name__}: {said}; its own log says why it stopped")
    if subcommand != "fit":
        return f"{where}; nothing was recorded from this {subcommand}: run it again"
    saved = getattr(trainer.checkpoint_callback, "last_model_path", "") or trainer.ckpt_path
    if not (saved and os.path.isfile(saved)):
        return f"{where}; no checkpoint was written before it: start every node again"
    return (f"{where}; the last checkpoint, {os.path.abspath(saved)} (step {checkpoint_step(saved)}), is kept: "
            "start every node again with --ckpt_path last (--ckpt_path auto in a job script) to continue from it")


def drop_unused_logs(trainer) -> None:
    """A run refused before its first step (a resume with another global batch) removes the TensorBoard folder it
    made, which holds only what setup writes (the config and this process's event file): it would stand as a
    ``version_N`` of no run beside the refused one's."""
    logger = trainer.logger
    if not isinstance(logger, TensorBoardLogger) or not trainer.is_global_zero or trainer.global_step:
        return
    folder = logger.log_dir
    if os.path.isdir(folder) and all(name in ("config.yaml", "hparams.yaml") or (
            name.startswith("events.out.tfevents.") and name.split(".")[-2] == str(os.getpid()))
            for name in os.listdir(folder)):
        shutil.rmtree(folder, ignore_errors=True)


def failed_run(exc: BaseException, trainer, subcommand: str) -> Optional[RunFailedError]:
    """The one-line error a verb's failure ``exc`` becomes, or None to raise it as it is: a lost peer process, or a
    full disk where a logger writes (TensorBoard's events), like every other write. A user error first removes the
    log folder of a run that never started."""
    if isinstance(user_error(exc), ConfigError):
        drop_unused_logs(trainer)
    lost = lost_peer(exc) if user_error(exc) is None else None
    if lost is not None:
        return RunFailedError(lost_peer_line(trainer, subcommand, lost))
    full = full_disk(exc)
    if full is None or user_error(exc) is not None:
        return None
    where = full.filename or f"the logs in {trainer.log_dir or '.'}"
    return RunFailedError(f"could not write {where} ({type(full).__name__}: {full}; "
                          f"{space_left(trainer.log_dir or '.')}); the checkpoints written before it are intact")


def quiet_writer_thread(args, report=threading.__excepthook__) -> None:
    """TensorBoard's event writer thread that meets a full disk keeps the error and raises it again at the run's
    next write or flush, which ends the run in one line (:func:`failed_run`): its own traceback would come first.
    Every other thread's error keeps its report."""
    if (full_disk(args.exc_value) is None or not type(args.thread).__module__.startswith("tensorboard.")
            or os.environ.get(DEBUG_VARIABLE)):
        report(args)


def stopped(exc: SIGTERMException) -> None:
    """A run stopped by a signal (SIGTERM, a first Ctrl-C during fit, SLURM's SIGUSR1; see PreemptionCheckpoint): one
    line naming the signal and the checkpoint saved, then exit with 128 + the signal's number."""
    signum = getattr(exc, "signum", signal.SIGTERM)
    saved, requeued = getattr(exc, "saved_checkpoint", None), getattr(exc, "requeued", None)
    print(f"error: stopped by {signal.Signals(signum).name}" + (f"; {exc}" if str(exc) else "")
          + (f"; saved {saved}" if saved else "") + (f"; {requeued}" if requeued else "")
          + ("; continue with --ckpt_path last" if saved else ""),
          file=sys.stderr, flush=True)
    sys.exit(128 + signum)
