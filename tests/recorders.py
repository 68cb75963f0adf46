"""Test-only callbacks the CLI loads by class path (this folder is on sys.path under pytest)."""

import hashlib

import lightning as L

BATCHES: list[str] = []
LOSSES: list[float] = []


class RecordBatches(L.Callback):
    """Appends a digest of every training batch (with task rows: its tokens and loss weights) to ``BATCHES`` and its
    loss to ``LOSSES``."""

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        parts = [batch["tokens"], batch["loss_weight"]] if isinstance(batch, dict) else [batch]
        BATCHES.append(hashlib.sha1(b"".join(p.cpu().numpy().tobytes() for p in parts)).hexdigest())

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        LOSSES.append(float(outputs["loss"]))


class StopAt(L.Callback):
    """Ends fit after ``step`` optimizer steps without touching max_steps (so the LR schedule is unchanged)."""

    def __init__(self, step: int):
        self.step = step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step >= self.step:
            trainer.should_stop = True


class SigtermAt(L.Callback):
    """Sends ``signame`` (SIGTERM, or SIGINT as Ctrl-C would) to this process as the batch after optimizer step
    ``step`` starts (mid-accumulation when accumulating), as a cluster's preemption would; only on ``rank`` when
    given."""

    def __init__(self, step: int, rank: int | None = None, signame: str = "SIGTERM"):
        self.step, self.rank, self.signame, self.sent = step, rank, signame, False

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step == self.step and not self.sent and self.rank in (None, trainer.global_rank):
            import os
            import signal

            self.sent = True
            os.kill(os.getpid(), getattr(signal, self.signame))


class SignalSweepAt(L.Callback):
    """Signals the sweep that started this fit as the batch after optimizer step ``step`` starts: ``group``, its
    process group, as a Ctrl-C at the terminal signals the foreground group; else its pid alone, as ``kill`` does."""

    def __init__(self, step: int, signame: str = "SIGINT", group: bool = True):
        self.step, self.signame, self.group, self.sent = step, signame, group, False

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step == self.step and not self.sent:
            import os
            import signal

            self.sent = True
            signum = getattr(signal, self.signame)
            if self.group:
                os.killpg(os.getpgid(os.getppid()), signum)
            else:
                os.kill(os.getppid(), signum)


class NanGradientsAt(L.Callback):
    """Makes the gradients of optimizer step ``step`` NaN, as a diverging update would."""

    def __init__(self, step: int):
        self.step = step

    def on_after_backward(self, trainer, pl_module):
        if trainer.global_step == self.step:
            next(pl_module.parameters()).grad.fill_(float("nan"))


class StateAtStepEnd(L.Callback):
    """The weights and the optimizer's step counts at each training batch's end, by global step, in ``seen`` (a
    class attribute: the CLI builds the instance). Runs before the checkpoint callback, which Lightning puts last."""

    seen: dict = {}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        counts = [float(state["step"]) for state in trainer.optimizers[0].state.values() if "step" in state]
        weights = {name: value.detach().clone() for name, value in pl_module.state_dict().items()}
        StateAtStepEnd.seen[trainer.global_step] = (weights, counts)


class Warns(L.Callback):
    """Warns once at the start of training, as a user's own code might: the console must still show it."""

    def on_train_start(self, trainer, pl_module):
        import warnings

        warnings.warn("a warning from the run's own code (tests/recorders.Warns)", UserWarning, stacklevel=1)


class KillAt(L.Callback):
    """SIGKILLs this process (no handler runs, nothing is saved) as its ``batch``-th micro-batch starts (1-based,
    counted in this process): a node lost mid-accumulation."""

    def __init__(self, batch: int):
        self.batch, self.seen = batch, 0

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.seen += 1
        if self.seen == self.batch:
            import os
            import signal

            os.kill(os.getpid(), signal.SIGKILL)


class PeerLostAt(L.Callback):
    """Fails the backward of optimizer step ``step`` as DDP's gradient all-reduce over gloo fails when another
    process of the run was killed (its node lost): the RuntimeError and message gloo raises."""

    def __init__(self, step: int):
        self.step = step

    def on_after_backward(self, trainer, pl_module):
        if trainer.global_step == self.step:
            raise RuntimeError("[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection "
                               "closed by peer [127.0.0.1]:17053. This is typically caused by a remote worker "
                               "crashing. Check the logs of the remote worker before reporting an error. GLHF!")
