"""Save on preemption: clusters stop jobs with SIGTERM, and Lightning turns it into ``SIGTERMException`` at the
next batch boundary; this saves ``last.ckpt`` there so that the requeued job continues with ``--ckpt_path last``
(the command line then exits with status 143, not 0)."""

from __future__ import annotations

import os

import lightning as L
from lightning.pytorch.utilities.exceptions import SIGTERMException


class PreemptionCheckpoint(L.Callback):
    """Writes ``<dirpath>/last.ckpt`` when fit stops on SIGTERM, and only then: any other exception (a divergence, a
    bug) must not replace the last good checkpoint. (Lightning's OnExceptionCheckpoint saves on every exception and
    deletes its file at teardown, so it cannot be the file a requeued job resumes from.)

    With gradient accumulation, a SIGTERM between micro-batches saves mid-accumulation: the resumed run makes that
    one optimizer step from the remaining micro-batches only.
    """

    def __init__(self, dirpath: str):
        self.path = os.path.join(dirpath, "last.ckpt")

    def on_exception(self, trainer, pl_module, exception):
        if isinstance(exception, SIGTERMException) and trainer.state.fn == "fit":
            trainer.save_checkpoint(self.path, weights_only=False)
            exception.saved_checkpoint = os.path.abspath(self.path)  # for the command line's last word
