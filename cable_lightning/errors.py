"""Errors the user can act on. The command line prints them as one line (``error: ...``) instead of a traceback;
anything else is a bug and keeps its traceback."""

from __future__ import annotations


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
