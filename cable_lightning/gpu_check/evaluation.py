"""The bench part: the bench's model-only evaluation at 16,384 tokens of each encoding, its first forward (where
FlexAttention compiles) timed apart."""

from __future__ import annotations

import argparse
import gc
import time

import torch

from .dynamo import dynamo_counts
from .plan import BENCH_COMPILE_BUDGET_S, backend_of


def bench(run, part: str, labels: list[str], head: list[str], deadline: float) -> None:
    """``Run.bench``: the bench's model-only evaluation at ``eval_length``, eager (the preset's vocabulary, as the
    bench's). The first forward, where FlexAttention compiles on CUDA, is timed apart; the timed forwards and the peak
    memory's reuse what it compiled (Dynamo's counts of each are in the row)."""
    from torch._dynamo.utils import counters

    from ..bench.memory import eval_peak_mib
    from ..bench.steps import eval_forward, eval_seconds
    from ..bench.variants import make_config
    from ..models import build_backbone
    from ..timing import synced_time

    sizes, dtype = run.sizes, run.sizes.dtype
    shape = argparse.Namespace(**{"preset": sizes.preset, "vocab_size": None, "n_layer": None, "n_head": None,
                                  "n_embd": None, **sizes.shape})
    budget = BENCH_COMPILE_BUDGET_S * run.args.budget_scale
    for label in labels:
        cells = [part, label, backend_of(label)]
        if time.monotonic() >= deadline:
            run.report.row(cells + ["skipped: its budget is spent"] + [""] * (len(head) - 4))
            continue
        try:
            torch._dynamo.reset()
            counters.clear()
            model = build_backbone(make_config(shape, label, sizes.block)).to(run.device).eval()
            start = synced_time(run.device)
            eval_forward(model, sizes.eval_length, run.device, dtype)()  # FlexAttention compiles here
            compiled, warm = synced_time(run.device) - start, dynamo_counts()["compiles"]
            seconds = eval_seconds(model, sizes.eval_length, run.device, dtype, sizes.repeats)
            mib = eval_peak_mib(model, sizes.eval_length, run.device, dtype) if run.cuda else None
            timed = dynamo_counts()["compiles"] - warm
        except Exception as exc:
            run.failed(cells, exc, len(head))
            continue
        finally:
            model = None
            gc.collect()
            if run.cuda:
                torch.cuda.empty_cache()
        if label == "nope":
            run.nope_eval = (seconds, mib)
        base_s, base_mib = run.nope_eval or (None, None)
        notes = ["CPU: no peak memory"] if mib is None else []
        if compiled > budget and backend_of(label) == "flex":
            notes.append(f"its first forward took {compiled:.0f} s, past its {budget:.0f} s compile budget")
        run.report.row(cells + [f"{compiled:.3f}", f"{seconds:.3f}", f"{seconds / base_s:.2f}" if base_s else "-",
                                 "-" if mib is None else f"{mib:,.0f}",
                                 f"{mib / base_mib:.2f}" if mib and base_mib else "-", f"{warm} / {timed}",
                                 "; ".join(notes)])
