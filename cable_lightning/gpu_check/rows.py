"""gpu-check's results file, a Markdown row at a time, and its one-line end when a signal stops it."""

from __future__ import annotations

import os
import signal
import sys
from contextlib import contextmanager

from lightning.pytorch.utilities.exceptions import SIGTERMException

from ..errors import ConfigError
from ..eval.tables import markdown_row, markdown_table


class Report:
    """The results file: each line written and flushed as it comes, and echoed. Its first line, the heading, marks it
    as gpu-check's (``owned.FILE_MARKS``): a later run replaces it only with ``--overwrite``. Until its first row it is
    written beside ``path`` (``.<name>.partial``) and then renamed over it, so that an earlier file (a GPU run's rows)
    stays whole when the new run stops before it has a row to show; closed before that, the partial file is removed."""

    def __init__(self, path: str, heading: str):
        folder, name = os.path.split(os.path.abspath(path))
        self.path, self.partial, self.placed = path, os.path.join(folder, f".{name}.partial"), False
        try:
            os.makedirs(folder, exist_ok=True)
            self.file = open(self.partial, "w", encoding="utf-8")
        except OSError as exc:
            raise ConfigError(f"--out {path} cannot be written ({type(exc).__name__}: {exc.strerror}); choose "
                              "another --out") from None
        self.line(heading)

    def close(self) -> None:
        self.file.close()
        if not self.placed:
            os.remove(self.partial)

    def kept(self) -> str:
        """What ``--out`` holds, for the line that ends a stopped run."""
        if self.placed:
            return f"the rows so far are in {self.path}"
        return (f"it had no row yet: the earlier {self.path} is kept as it was" if os.path.exists(self.path) else
                f"it had no row yet: nothing was written to {self.path}")

    def line(self, text: str = "") -> None:
        self.file.write(text + "\n")
        self.file.flush()
        print(f"[gpu-check] {text}", flush=True)

    def row(self, cells: list) -> None:
        """A result (a part's row, skipped or failed too): the first puts the file in ``path``'s place."""
        self.line(markdown_row(cells))
        if not self.placed:
            os.replace(self.partial, self.path)
            self.placed = True

    def table(self, head: list[str]) -> None:
        self.line()
        for line in markdown_table(head, []).splitlines():
            self.line(line)


@contextmanager
def stopped_by_signals(report_of):
    """SIGTERM (a scheduler's stop) and Ctrl-C end gpu-check in one line saying what ``--out`` holds (``report_of()``:
    the Report, None before it exists), with 128 + the signal's number. A stop inside a fit comes as the fit's own
    ``SIGTERMException`` (PreemptionCheckpoint), elsewhere from this handler (by default SIGTERM ended the process
    with nothing said), or the data's preparation's ``PrepareStopped``. The earlier handler is restored."""

    def stop(signum, frame):
        stopped = SIGTERMException()
        stopped.signum = signum
        raise stopped

    earlier = signal.signal(signal.SIGTERM, stop)
    try:
        yield
    except BaseException as exc:  # a stop carries its signal: SIGTERMException, a fit's prepare's PrepareStopped
        signum = getattr(exc, "signum", signal.SIGINT if isinstance(exc, KeyboardInterrupt) else None)
        if signum is None:
            raise
        report = report_of()
        said = report.kept() if report is not None else "nothing was written"
        print(f"error: gpu-check stopped by {signal.Signals(signum).name}; {said}", file=sys.stderr, flush=True)
        sys.exit(128 + signum)
    finally:
        signal.signal(signal.SIGTERM, earlier)


def gib(n: float | None) -> str:
    return "-" if n is None else f"{n / 2**30:.1f}"


def seconds_or_dash(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds:.1f}"
