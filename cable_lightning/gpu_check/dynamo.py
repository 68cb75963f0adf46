"""What gpu-check reads of Dynamo: its counters, its warning that a function hit its recompile limit, and the CPU
rehearsal's ``eager`` backend in place of inductor."""

from __future__ import annotations

import logging
import re
from contextlib import contextmanager

import torch


def dynamo_counts() -> dict[str, int]:
    """Dynamo's counters: frames compiled (a recompile is one more), graphs produced, graph breaks."""
    from torch._dynamo.utils import counters

    return {"compiles": counters["frames"]["ok"], "graphs": counters["stats"]["unique_graphs"],
            "graph_breaks": sum(counters["graph_break"].values())}


LIMIT_HIT = re.compile(r"hit config\.(\w*(?:recompile|cache_size)_limit)")


class RecompileWatch(logging.Handler):
    """Dynamo's warning that a function hit its recompile limit (``recompile_limit``; ``cache_size_limit`` before
    torch 2.6): after it that function runs eagerly, silently slow. ``hits``: (function, last reason) of each."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.hits: list[tuple[str, str]] = []

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if LIMIT_HIT.search(message):
            function = re.search(r"function: (.*)", message)
            reason = re.search(r"last reason: (.*)", message)
            self.hits.append((function.group(1) if function else "(unnamed)", reason.group(1) if reason else "?"))

    @contextmanager
    def watching(self):
        logger = logging.getLogger("torch._dynamo")
        logger.addHandler(self)
        try:
            yield self
        finally:
            logger.removeHandler(self)


@contextmanager
def eager_dynamo():
    """The rehearsal's compile: Dynamo traces as on a GPU (its counters and warnings are real), its ``eager`` backend
    runs the graphs (inductor takes 17-25 s a model on 2 cores)."""
    compile_ = torch.compile

    def eager(*args, **kwargs):
        kwargs = {name: value for name, value in kwargs.items() if name not in ("mode", "options")}  # inductor's
        return compile_(*args, **{**kwargs, "backend": "eager"})

    torch.compile = eager
    try:
        yield
    finally:
        torch.compile = compile_
