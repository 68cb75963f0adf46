"""Errors the user can act on. The command line prints them as one line (``error: ...``) instead of a traceback;
anything else is a bug and keeps its traceback."""

from __future__ import annotations

import argparse
import contextlib
import errno
import json
import os
import resource
import shutil
import signal
import sys
import time
from typing import Optional

# The exit status of every verb, for schedulers and scripts; written here once.
EXIT_USER_ERROR = 2  # a bad setting, data folder or checkpoint, or a usage error
EXIT_RUN_FAILED = 1  # a run that failed: divergence, a checkpoint not written, a lost peer process
EXIT_STATUSES = {
    0: "done",
    EXIT_USER_ERROR: "a user error: a bad setting, data folder or checkpoint, or a usage error",
    EXIT_RUN_FAILED: "a run that failed: divergence, a checkpoint not written, another process of the run lost",
    "128 + N": "stopped by signal N: 143 SIGTERM, 130 Ctrl-C, 138 SLURM's SIGUSR1 (the job requeued); a fit saves "
               "last.ckpt first (continue with --ckpt_path last)",
}
DEBUG_VARIABLE = "CABLE_LIGHTNING_DEBUG"


class ConfigError(ValueError):
    """A bad setting, data folder or checkpoint (:data:`EXIT_USER_ERROR`, as a command-line usage error)."""


class CorruptCheckpointError(ConfigError):
    """A checkpoint file that cannot be read back (truncated, not a checkpoint, or refused by weights-only loading)."""


class RunFailedError(RuntimeError):
    """The run stopped for a reason the user must look at (divergence, a checkpoint that could not be written), said
    with what was kept (:data:`EXIT_RUN_FAILED`)."""


def user_error(exc: BaseException) -> BaseException | None:
    """The ConfigError or RunFailedError behind ``exc`` (jsonargparse and Lightning wrap errors raised in links,
    hooks and callbacks), or None when ``exc`` is a bug."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, (ConfigError, RunFailedError)):
            return exc
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__
    return None


def space_left(path: str, written: Optional[int] = None) -> str:
    """What may have stopped a write to ``path``, for its error: the process's file-size limit (``ulimit -f``) when the
    file (``written`` bytes) reached it, else the free space there, and the limit when there is one."""
    limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
    limited = limit != resource.RLIM_INFINITY
    if limited and written is not None and written >= limit:
        return f"the file reached this process's file-size limit (ulimit -f) of {limit / 2**20:g} MiB; raise it"
    folder = path if os.path.isdir(path) else os.path.dirname(os.path.abspath(path))
    notes = [f"{shutil.disk_usage(folder).free / 2**20:.0f} MiB free there"] if os.path.isdir(folder) else []
    if limited:
        notes.append(f"file-size limit (ulimit -f) {limit / 2**20:g} MiB")
    return ", ".join(notes) or "its folder is gone"


def full_disk(exc: BaseException) -> OSError | None:
    """The full disk (ENOSPC, a quota, the file-size limit) behind ``exc``, or None."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
            return exc
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__
    return None


class MissingFileError(ConfigError, FileNotFoundError):
    """A data folder, tokenizer file or checkpoint that is not there."""


class TargetExistsError(ConfigError, FileExistsError):
    """An output folder that may not be replaced (not written by this tool, or holding the command's input)."""


@contextlib.contextmanager
def error_boundary():
    """The error boundary of every entry point (every verb of ``python -m cable_lightning``, and the scripts in
    ``tools/``): a user error inside is printed as one line, ``error: ...``, and the process exits with its status
    (:data:`EXIT_STATUSES`); anything else is a bug and keeps its traceback, as does
    every error with ``CABLE_LIGHTNING_DEBUG=1``. A reader of stdout that goes away ends the command quietly, with
    128 + SIGPIPE, also after ``--help`` (argparse exits with the text still buffered)."""
    try:
        try:
            yield
        except SystemExit:
            sys.stdout.flush()
            raise
        sys.stdout.flush()  # inside the boundary: a reader that went away is met here, not at interpreter exit
    except BrokenPipeError:  # the reader went away (`report ... | head`): stop quietly, as cat and grep do
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # the exit's own flush goes nowhere
        sys.exit(128 + signal.SIGPIPE)
    except Exception as exc:
        known = user_error(exc)
        if known is None or os.environ.get(DEBUG_VARIABLE):
            raise
        print(f"error: {known}", file=sys.stderr, flush=True)
        said_to_torchrun(f"error: {known}")
        sys.exit(EXIT_USER_ERROR if isinstance(known, ConfigError) else EXIT_RUN_FAILED)


def said_to_torchrun(line: str) -> None:
    """Under torchrun, the line also goes to the error file its launcher reads (``TORCHELASTIC_ERROR_FILE``), so that
    the launcher's failure summary names it instead of pointing at its documentation."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    try:
        with open(path, "w") as f:
            # the format of torch.distributed.elastic's own error files: the summary shows py_callstack
            json.dump({"message": {"message": line, "extraInfo": {"py_callstack": line,
                                                                  "timestamp": str(int(time.time()))}}}, f)
    except OSError:
        pass  # the line is on stderr already


class KeepsWriteErrors:
    """A parser mixin: argparse drops an error writing its help or usage, so ``--help | head`` exited 0 having lost
    the text; raised, it reaches the error boundary like every other write to a reader that went away."""

    def _print_message(self, message: str, file=None) -> None:
        if message:
            (file or sys.stderr).write(message)


class ArgumentParser(KeepsWriteErrors, argparse.ArgumentParser):
    """The parser of every argparse verb: a usage error is one ``error:`` line, exiting as every other
    user error (argparse would print the usage text first); ``--help`` still prints it. Every verb spells its options
    as Lightning's do, with underscores (``--runs_dir``); one spelt with dashes (``--runs-dir``, an earlier spelling)
    is taken as the underscore one, with a note naming it: argparse took it as unknown and, before a positional
    remainder (sweep's), the rest of the line as that remainder."""

    def parse_known_args(self, args=None, namespace=None):
        args = sys.argv[1:] if args is None else list(args)
        for i, arg in enumerate(args[:args.index("--")] if "--" in args else args):  # after --: another command's
            name, equals, value = arg.partition("=")
            spelt, known = "--" + name[2:].replace("-", "_"), self._option_string_actions
            if name.startswith("--") and name not in known and spelt in known:
                print(f"note: {name} is spelt {spelt}; the dashed spelling still works", file=sys.stderr, flush=True)
                args[i] = spelt + equals + value
        return super().parse_known_args(args, namespace)

    def error(self, message: str):
        print(f"error: {message} ({self.prog} --help lists the settings)", file=sys.stderr, flush=True)
        sys.exit(EXIT_USER_ERROR)
