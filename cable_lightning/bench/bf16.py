"""``--bf16_speedup``: each encoding's training step under bf16 autocast against the same weights in fp32: whether
bf16 pays at a config's shape (tiny widths gain little) before its runs are switched."""

from __future__ import annotations

import torch

from ..eval.tables import markdown_table
from ..models import build_backbone
from ..timing import interleaved
from .steps import train_step, training_batch
from .variants import make_config, row_name


def bf16_rows(pes, args, device) -> list[dict]:
    """At each training length, both steps timed in turns in this process: ``speedup`` is the fp32 step's time over
    the bf16 one's."""
    rows = []
    for pe in pes:
        torch.manual_seed(0)
        model = build_backbone(make_config(args, pe, max(args.train_lengths))).to(device)
        for t in args.train_lengths:
            x = training_batch(model.config.vocab_size, t, args.tokens_per_step, device)
            fp32_s, bf16_s = interleaved([train_step(model, x, device, torch.float32),
                                          train_step(model, x, device, torch.bfloat16)], device, args.repeats)
            rows.append({"pe": row_name(pe), "length": t, "fp32_step_s": fp32_s, "bf16_step_s": bf16_s,
                         "speedup": fp32_s / bf16_s})
        print(f"measured bf16 against fp32 {pe}", flush=True)
    return rows


def bf16_table(rows) -> str:
    head = ["pe", "length", "fp32 step s", "bf16 step s", "bf16's speedup"]
    body = [[r["pe"], str(r["length"]), f"{r['fp32_step_s']:.3f}", f"{r['bf16_step_s']:.3f}", f"{r['speedup']:.2f}x"]
            for r in rows]
    return markdown_table(head, body)
