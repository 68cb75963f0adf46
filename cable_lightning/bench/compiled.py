"""``--compile``: each encoding's training step with its blocks compiled (``compile: true``) against the same weights
eager: the compile's time apart from the steady steps, and the steps a fit needs to pay it back."""

from __future__ import annotations

import torch

from ..eval.tables import markdown_table
from ..models import build_backbone
from ..timing import interleaved, synced_time
from .steps import train_step, training_batch
from .variants import make_config, row_name


def compile_rows(pes, args, device, dtype) -> list[dict]:
    """At each training length: the first compiled step's time over the steady compiled step (``compile_s``, with a
    fresh Dynamo, inductor's on-disk cache as this machine has it: ``inductor_cache`` counts the graphs it held and
    those compiled anew), both steady steps timed in turns, and the steps a fit needs before the compiled steps have
    paid the compile back (None: never)."""
    from torch._dynamo.utils import counters

    rows = []
    for pe in pes:
        torch.manual_seed(0)
        config = make_config(args, pe, max(args.train_lengths))
        eager, compiled = build_backbone(config).to(device), build_backbone(config).to(device)
        compiled.load_state_dict(eager.state_dict())
        for t in args.train_lengths:
            torch._dynamo.reset()  # each length compiles from nothing, as a fit at that length would
            compiled.compiled_blocks = None
            compiled.compile_blocks()
            x = training_batch(config.vocab_size, t, args.tokens_per_step, device)
            compiled_step = train_step(compiled, x, device, dtype)
            cache = counters["inductor"]
            hits, misses = cache["fxgraph_cache_hit"], cache["fxgraph_cache_miss"]
            start = synced_time(device)
            compiled_step()
            first = synced_time(device) - start
            hits, misses = cache["fxgraph_cache_hit"] - hits, cache["fxgraph_cache_miss"] - misses
            eager_s, compiled_s = interleaved([train_step(eager, x, device, dtype), compiled_step], device,
                                              args.repeats)
            compile_s = max(0.0, first - compiled_s)
            rows.append({"pe": row_name(pe), "length": t, "eager_step_s": eager_s, "compiled_step_s": compiled_s,
                         "speedup": eager_s / compiled_s, "compile_s": compile_s,
                         "inductor_cache": {"hits": hits, "misses": misses},
                         "payback_steps": compile_s / (eager_s - compiled_s) if compiled_s < eager_s else None})
        print(f"measured compiled {pe}", flush=True)
    return rows


def compile_table(rows) -> str:
    head = ["pe", "length", "eager step s", "compiled step s (x eager's speed)", "compile s",
            "inductor's cache: graphs held / compiled", "steps to pay back"]
    body = [[r["pe"], str(r["length"]), f"{r['eager_step_s']:.3f}", f"{r['compiled_step_s']:.3f} ({r['speedup']:.2f}x)",
             f"{r['compile_s']:.1f}", f"{r['inductor_cache']['hits']} / {r['inductor_cache']['misses']}",
             "never" if r["payback_steps"] is None else f"{r['payback_steps']:.0f}"] for r in rows]
    return markdown_table(head, body)
