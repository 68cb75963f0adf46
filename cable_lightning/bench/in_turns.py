"""``--in_turns``: each encoding's training step and evaluation forward timed in turns with NoPE's, both models in this
process: on a machine that other jobs share, load that comes and goes falls on both alike, so the cost ratio holds
where the main table's (each encoding timed after the one before) moves with the load."""

from __future__ import annotations

import torch

from ..eval.tables import markdown_table
from ..models import build_backbone
from ..timing import interleaved
from .steps import eval_forward, train_step, training_batch
from .variants import make_config, row_name


def in_turns_rows(pes, args, device, dtype) -> list[dict]:
    """Per encoding (NoPE aside) and length: the seconds of its step and of NoPE's, timed in turns, and their ratio
    (``cost``: > 1 is slower than NoPE)."""
    torch.manual_seed(0)
    nope = build_backbone(make_config(args, "nope", max(args.train_lengths))).to(device)
    rows = []
    for pe in (pe for pe in pes if pe != "nope"):
        torch.manual_seed(0)
        model = build_backbone(make_config(args, pe, max(args.train_lengths))).to(device)
        for t in args.train_lengths:
            x = training_batch(nope.config.vocab_size, t, args.tokens_per_step, device)
            base_s, pe_s = interleaved([train_step(nope, x, device, dtype), train_step(model, x, device, dtype)],
                                       device, args.repeats)
            rows.append({"pe": row_name(pe), "work": "training step", "length": t, "nope_s": base_s, "pe_s": pe_s,
                         "cost": pe_s / base_s})
        model.eval()
        nope.eval()
        for t in args.eval_lengths:
            base_s, pe_s = interleaved([eval_forward(nope, t, device, dtype), eval_forward(model, t, device, dtype)],
                                       device, args.repeats)
            rows.append({"pe": row_name(pe), "work": "evaluation", "length": t, "nope_s": base_s, "pe_s": pe_s,
                         "cost": pe_s / base_s})
        nope.train()
        print(f"measured {pe} in turns with nope", flush=True)
    return rows


def in_turns_table(rows) -> str:
    head = ["pe", "work", "length", "nope s", "pe s", "cost (x nope)"]
    body = [[r["pe"], r["work"], str(r["length"]), f"{r['nope_s']:.3f}", f"{r['pe_s']:.3f}", f"{r['cost']:.2f}"]
            for r in rows]
    return markdown_table(head, body)
