"""The bench's main table: per encoding, the training step's tokens/s and MFU at each training length, the evaluation
forward's seconds and peak memory at each evaluation length (and with ``--padded_batch`` a padded fine-tuning step),
each with its ratio to ``nope`` measured in the same process."""

from __future__ import annotations

import torch

from ..eval.tables import markdown_table
from ..models import build_backbone
from ..timing import timed
from .memory import eval_peak_mib, out_of_memory
from .padded import PADDED_MODES, padded_step_seconds
from .steps import eval_seconds, train_step, training_batch
from .variants import make_config, row_name


def train_tokens_per_second(model, t, tokens_per_step, device, dtype, repeats):
    x = training_batch(model.config.vocab_size, t, tokens_per_step, device)
    return x.shape[0] * t / timed(train_step(model, x, device, dtype), device, repeats)


def encoding_row(pe, args, device, dtype) -> dict:
    """One encoding's row: training tokens/s and FLOPs per token, evaluation seconds and peak memory ("OOM" where it
    ran out, "skipped" for the naive CABLE past ``--naive_max_length``), the padded step's seconds."""
    torch._dynamo.reset()  # what one encoding compiled (FlexAttention) counts toward no other's recompile limit
    torch.manual_seed(0)
    row = {"pe": row_name(pe), "train_tok_s": {}, "eval_s": {}, "eval_peak_mib": {}}
    if args.padded_batch:
        encoder = build_backbone(make_config(args, pe, args.padded_longest, causal=False)).to(device)
        row["padded_step_s"] = {mode: padded_step_seconds(encoder, args.padded_batch, args.padded_longest, device,
                                                           args.repeats, mode) for mode in PADDED_MODES}
    model = build_backbone(make_config(args, pe, max(args.train_lengths))).to(device)
    for t in args.train_lengths:
        row["train_tok_s"][t] = train_tokens_per_second(model, t, args.tokens_per_step, device, dtype, args.repeats)
    row["train_flops_per_token"] = {t: model.training_flops_per_token(t) for t in args.train_lengths}
    model.eval()
    for t in args.eval_lengths:
        longest = model.config.pos_encoding.longest_length(model.config.block_size)
        if longest is not None and t > longest:  # a learnable table cannot serve longer inputs
            continue
        if t > args.naive_max_length and pe.endswith(":materialized"):
            row["eval_s"][t] = row["eval_peak_mib"][t] = "skipped"
            continue
        try:
            row["eval_s"][t] = eval_seconds(model, t, device, dtype, args.repeats)
            if not args.skip_memory:
                row["eval_peak_mib"][t] = eval_peak_mib(model, t, device, dtype)
        except (RuntimeError, MemoryError) as err:
            if not out_of_memory(err):
                raise
            row["eval_s"][t] = row["eval_peak_mib"][t] = "OOM"
            if device.type == "cuda":
                torch.cuda.empty_cache()
    return row


def add_mfu_and_ratios(rows: list[dict], peak: float) -> None:
    """Each row's MFU (its model FLOPs per second over ``peak``) and its tokens/s and evaluation seconds over
    ``nope``'s."""
    for row in rows:
        row["train_mfu"] = {t: v * row["train_flops_per_token"][t] / peak for t, v in row["train_tok_s"].items()}
    base = next(r for r in rows if r["pe"] == "nope")
    for row in rows:
        row["train_ratio_to_nope"] = {t: base["train_tok_s"][t] / v for t, v in row["train_tok_s"].items()}
        row["eval_ratio_to_nope"] = {t: v / base["eval_s"][t] for t, v in row["eval_s"].items()
                                     if not isinstance(v, str)}


def fmt(value, spec, ratio=None) -> str:
    if value is None:
        return "-"
    if isinstance(value, str):
        return value
    return f"{value:{spec}}" + (f" ({ratio:.2f})" if ratio is not None else "")


def table(result) -> str:
    rows = result["rows"]
    train_ts = list(rows[0]["train_tok_s"])
    eval_ts = list(rows[0]["eval_s"])
    head = (["pe"] + [f"train tok/s @{t} (x nope)" for t in train_ts] + [f"MFU @{t}" for t in train_ts]
            + [f"eval s @{t} (x nope)" for t in eval_ts]
            + [f"eval peak MiB @{t}" for t in eval_ts])
    padded = "padded_step_s" in rows[0]
    if padded:
        head += ["padded step s, per span", "one call, one group (x per span)", "one call, grouped (x per span)"]
    lines = []
    for r in rows:
        cells = [r["pe"]]
        cells += [f"{r['train_tok_s'][t]:.0f} ({r['train_ratio_to_nope'][t]:.2f})" for t in train_ts]
        cells += [f"{r['train_mfu'][t]:.1%}" for t in train_ts]
        cells += [fmt(r["eval_s"].get(t), ".3f", r["eval_ratio_to_nope"].get(t)) for t in eval_ts]
        cells += [fmt(r["eval_peak_mib"].get(t), ".0f") for t in eval_ts]
        if padded:
            step = r["padded_step_s"]
            cells += [f"{step['per_span']:.2f}"] + [f"{step[mode]:.2f} ({step[mode] / step['per_span']:.2f})"
                                                    for mode in PADDED_MODES[1:]]
        lines.append(cells)
    return markdown_table(head, lines)


def peaks_line(meta) -> str:
    """Both CPU matmul peaks, so a user sees what bf16 offers on this CPU, and the one MFU divides by."""
    line = f"MFU against {meta['peak_source']}: {meta['peak_flops'] / 1e9:.1f} GFLOP/s"
    peaks = meta["cpu_matmul_peaks"]
    if peaks is None:
        return line
    threads = torch.get_num_threads()
    return (f"CPU matmul peaks (1024x1024, {threads} thread{'s' * (threads > 1)}, best of before and after): fp32 "
            f"{peaks['fp32'] / 1e9:.1f} GFLOP/s, bf16 {peaks['bf16'] / 1e9:.1f} GFLOP/s "
            f"({peaks['bf16'] / peaks['fp32']:.2f}x fp32)\n{line}")
