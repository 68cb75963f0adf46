"""litdata's ``optimize`` with its worker processes supervised: prepare's tokenizing pass, and the only code that
knows litdata's processes.

litdata 0.2.76 does not notice a worker that dies without raising (killed for memory, say): it finishes without that
worker's share of the data, or waits for it. Here a watchdog thread ends the run on such a death, every process the
run started (litdata's children included) is ended when it stops, and litdata's own SIGINT handler, which would end
the process with status 0 mid-run, is kept out of the way.
"""

from __future__ import annotations

import ctypes
import functools
import itertools
import multiprocessing
import multiprocessing.resource_tracker
import os
import signal
import sys
import threading
from typing import Any

WATCH_SECONDS = 0.05  # how often the watchdog looks at litdata's workers


def supervised_optimize(out: str, out_dir: str, work: list, fn: Any, chunk_size: int, num_workers: int,
                        start_method: str | None, verbose: bool) -> None:
    """litdata's ``optimize`` of ``work`` through ``fn`` into ``out_dir`` (token chunks of ``chunk_size``) under a
    :class:`Watchdog`; any failure is one line that names its cause and ``out``, the folder being prepared."""
    from litdata import TokensLoader, optimize
    from litdata.processing.data_processor import DataProcessor

    from ..console import LITDATA_VERBOSE  # litdata's own output is off (see console.py)

    watchdog, sigint, error = Watchdog(), signal.getsignal(signal.SIGINT), None
    # litdata 0.2.76 installs a SIGINT handler that ends the process with status 0 in the middle of the run, leaving
    # its workers and a partial folder; while it runs, a Ctrl-C goes to prepare's own handler instead (as SIGTERM).
    litdata_handler = DataProcessor._signal_handler
    DataProcessor._signal_handler = lambda processor, signum, frame: (
        sigint if callable(sigint) else functools.partial(litdata_handler, processor))(signum, frame)
    watchdog.start()
    try:  # keep_data_ordered: worker k writes the k-th contiguous slice, so the stream keeps source order
        optimize(fn=fn, inputs=work, output_dir=out_dir, chunk_size=chunk_size, item_loader=TokensLoader(),
                 num_workers=num_workers, keep_data_ordered=True, reorder_files=False, start_method=start_method,
                 verbose=verbose and LITDATA_VERBOSE)
    except Exception as exc:  # noqa: BLE001 - kept to be raised below, after a watchdog's cause
        error = exc
    except BaseException:  # PrepareStopped (SIGTERM, Ctrl-C): every process the run started must end
        watchdog.stopping = True
        raise
    finally:
        watchdog.finish()
        DataProcessor._signal_handler = litdata_handler
        if sigint is not None:  # litdata leaves its SIGINT handler behind: a later Ctrl-C would exit with status 0
            signal.signal(signal.SIGINT, sigint)
    if isinstance(error, RuntimeError) and "Traceback" in str(error):  # a worker raised: litdata passes on its text
        cause = f"failed in a worker: {_exception_line(str(error))}; nothing was written to {out}"
    elif watchdog.cause:
        cause = f"failed: {watchdog.cause}; nothing was written to {out}; run the same command again"
    elif error:
        raise error
    else:
        return
    raise RuntimeError(f"tokenizing into {out} {cause}") from None


def _exception_line(text: str) -> str:
    """The first ``Type: message`` line (one that follows a frame's indented lines) of a traceback's text: the root
    cause, as chained tracebacks print it first (litdata wraps a worker's error in its own RuntimeError)."""
    lines = [line for line in text.splitlines() if line.strip() not in ("", ".")]
    found = [line for prev, line in itertools.pairwise(lines) if prev.startswith(" ") and not line.startswith(" ")]
    return (found or lines[-1:] or [text])[0].strip()


class Watchdog(threading.Thread):
    """Watches the processes ``optimize`` starts. litdata 0.2.76 does not notice a worker that dies without raising
    (killed for memory, say): it finishes without that worker's share of the data, or waits for it. On such a death
    this thread ends the other workers, so ``optimize`` returns, and keeps the cause. :meth:`finish` also ends the
    workers' own children (litdata's), which a dead worker leaves behind holding our stdout. While it watches,
    this process is the children's subreaper (Linux): a child whose worker exited before a look saw it comes back to
    us instead of to init, and is ended with the rest rather than outliving the run holding our stdout."""

    def __init__(self) -> None:
        super().__init__(name="prepare-watchdog", daemon=True)
        _start_resource_tracker()
        self.before = set(_started_children())
        self.before_pids = set(_children(os.getpid()))
        self.workers: dict[int, Any] = {}  # pid -> Process, every child started while watching
        self.grandchildren: dict[int, str | None] = {}  # pid -> start time of the workers' children
        self.cause: str | None = None
        self.stopping = False  # set when a stop signal ends optimize
        self.done = threading.Event()
        self.was_subreaper = _subreaper(True)

    def run(self) -> None:
        while not self.done.wait(WATCH_SECONDS) and self.look() is None:
            pass
        if self.cause:
            self.end()

    def look(self) -> str | None:
        """Note new workers and their children; the first abnormal exit is the cause."""
        for proc in _started_children():
            if proc not in self.before:
                self.workers.setdefault(proc.pid, proc)
                self.grandchildren.update((pid, _start_time(pid)) for pid in _children(proc.pid)
                                          if pid not in self.grandchildren)
        if self.stopping:  # a worker forked while the stop interrupted start() was never registered: end it too
            forked = set(_children(os.getpid())) - self.before_pids - set(self.workers) - set(self.grandchildren)
            self.grandchildren.update((pid, _start_time(pid)) for pid in forked)
        for pid, proc in self.workers.items():
            if proc.exitcode and self.cause is None:  # None: running, 0: done, < 0: killed by that signal
                self.cause = _death(pid, proc.exitcode)
        return self.cause

    def end(self) -> None:
        for proc in self.workers.values():
            if proc.is_alive():
                proc.terminate()
        for pid, started in self.grandchildren.items():
            if started is not None and _start_time(pid) == started:  # still that process, not a reused pid
                try:
                    os.kill(pid, signal.SIGKILL)
                except OSError:
                    pass
        self.reap_adopted()

    def reap_adopted(self) -> None:
        """End and reap every child of ours that is neither from before nor a worker: an orphan of a worker that the
        subreaper took back (a process, or a killed child's zombie). They are not multiprocessing's to reap."""
        for pid in set(_children(os.getpid())) - self.before_pids - set(self.workers):
            try:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
            except (ProcessLookupError, ChildProcessError):
                pass

    def finish(self) -> None:
        """Stop watching (always: the thread never outlives ``optimize``), then a last look and clean-up: the workers
        are ended and waited for, so what they leave comes back to us and is reaped too."""
        self.done.set()
        self.join()
        self.look()
        self.end()
        for proc in self.workers.values():
            proc.join(timeout=10)
        self.reap_adopted()
        if self.was_subreaper is False:
            _subreaper(False)


def _start_resource_tracker() -> None:
    """multiprocessing's resource tracker is a child of this process too, started on first use. Started before the
    watchdog looks, it is never taken for a worker and ended (a tracker ended mid-run is relaunched without its
    records and prints a traceback for every resource released after). It runs without its warning about the
    semaphores of stopped workers, which it removes: after a stop, the run's last line is its error."""
    flags = list(sys.warnoptions)  # the tracker's interpreter gets this process's -W options
    sys.warnoptions.append("ignore::UserWarning:multiprocessing.resource_tracker")
    try:
        multiprocessing.resource_tracker.ensure_running()
    finally:
        sys.warnoptions[:] = flags


def _subreaper(on: bool) -> bool | None:
    """Make this process the subreaper of its descendants (``on``) or stop being one (Linux ``prctl``); returns whether
    it was one before, None where that cannot be done."""
    if not sys.platform.startswith("linux"):
        return None
    libc, was = ctypes.CDLL(None, use_errno=True), ctypes.c_int(0)
    get, set_ = 37, 36  # PR_GET_CHILD_SUBREAPER, PR_SET_CHILD_SUBREAPER
    if libc.prctl(get, ctypes.byref(was), 0, 0, 0) != 0 or libc.prctl(set_, int(on), 0, 0, 0) != 0:
        return None
    return bool(was.value)


def _started_children() -> list:
    """This process's multiprocessing children, dead ones not yet reaped included: ``active_children()`` reaps and
    drops those, so a worker that died before the watchdog first saw it would go unnoticed."""
    return list(getattr(multiprocessing.process, "_children", None) or multiprocessing.active_children())


def _death(pid: int, code: int) -> str:
    if code > 0:
        return f"worker pid {pid} exited with code {code}"
    name = signal.Signals(-code).name if -code in signal.valid_signals() else "unknown signal"
    hint = "; out of memory?" if -code == signal.SIGKILL else ""
    return f"worker pid {pid} was killed by signal {-code} ({name}{hint})"


def _children(pid: int) -> list[int]:
    """Child pids of ``pid``'s main thread (Linux; none elsewhere)."""
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(child) for child in f.read().split()]
    except OSError:
        return []


def _start_time(pid: int) -> str | None:
    """When ``pid`` started (field 22 of /proc/pid/stat), to tell it from a later process given the same pid."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


