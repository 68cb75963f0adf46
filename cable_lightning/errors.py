"""Errors the user can act on. The command line prints them as one line (``error: ...``) instead of a traceback;
anything else is a bug and keeps its traceback."""

from __future__ import annotations

import contextlib
import os
import sys

EXIT_USER_ERROR, EXIT_RUN_FAILED = 2, 1  # and 128 + the signal's number when stopped by one
DEBUG_VARIABLE = "CABLE_LIGHTNING_DEBUG"


class ConfigError(ValueError):
    """A bad setting, data folder or checkpoint: exit status 2, like a command-line usage error."""


class CorruptCheckpointError(ConfigError):
    """A checkpoint file that cannot be read back (truncated, not a checkpoint, or refused by weights-only loading)."""


class RunFailedError(RuntimeError):
    """The run stopped for a reason the user must look at (divergence, a checkpoint that could not be written):
    exit status 1, with what was kept."""


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


class MissingFileError(ConfigError, FileNotFoundError):
    """A data folder, tokenizer file or checkpoint that is not there."""


class TargetExistsError(ConfigError, FileExistsError):
    """An output folder that may not be replaced (not written by this tool, or holding the command's input)."""


@contextlib.contextmanager
def error_boundary():
    """The error boundary of every entry point (``python -m cable_lightning`` and ``export``, ``prepare``, every
    ``tools/*.py``): a user error inside is printed as one line, ``error: ...``, and the process exits with 2 (a bad
    setting, file or checkpoint) or 1 (a run that failed); anything else is a bug and keeps its traceback, as does
    every error with ``CABLE_LIGHTNING_DEBUG=1``."""
    try:
        yield
    except Exception as exc:
        known = user_error(exc)
        if known is None or os.environ.get(DEBUG_VARIABLE):
            raise
        print(f"error: {known}", file=sys.stderr, flush=True)
        sys.exit(EXIT_USER_ERROR if isinstance(known, ConfigError) else EXIT_RUN_FAILED)
