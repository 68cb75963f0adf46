"""The attention diagnostics in the report (docs/diagnostics.md): tables with seed intervals and one figure per
quantity against length, encodings side by side, from the ``attention.jsonl`` and ``long_context.jsonl`` records runs
wrote beside their ``length_eval.jsonl``.

A run is what it is in the perplexity tables (``Record.run_key``); each run's latest evaluation counts. A
run's value for a layer is the mean over its heads (``max_logit``: the maximum), for "all" the mean over layers and
heads (the maximum); a cell is the mean over the runs' seeds with a 95% Student-t interval
(:func:`eval.intervals.seed_interval`; one seed: its value alone).

Written: ``<out>_attention.md/.csv``, ``<out>_attention_<quantity>.png`` (a panel per layer and one for all, a line
per encoding with its interval band), and where causal runs recorded them ``<out>_long_context.md/.csv/.png`` (the key
tokens: the targets past the training length whose loss the whole window lowers by the threshold, beside the
perplexity of the same evaluation); where runs recorded the increments of a context-aware encoding or a task's answer
pair, ``<out>_increments.md/.csv/.png`` (docs/diagnostics.md#increments).
"""

from __future__ import annotations

import csv
import math
import os
from typing import Callable, Optional

from ..records.io import find_records
from ..records.schema import AttentionRecord, HiddenPairRecord, IncrementRecord, LengthRecord, LongContextRecord, Record
from .comparable import differing, latest_rows, run_column
from .diagnostics import MAXIMA, QUANTITIES
from .intervals import Estimate, seed_interval
from .tables import format_cell, markdown_table, write_markdown

Cells = dict[tuple, dict]  # (row label, column) -> {seed: value}


def latest(paths: list[str], kind: type[Record], cell: Callable) -> list[Record]:
    """Each run's ``kind`` rows of its latest step under ``paths`` (:func:`latest_rows`); none is no error."""
    return latest_rows(find_records(paths, kind.FILE, required=False), kind, cell)


def reduce(values: list[float], name: str) -> Optional[float]:
    values = [v for v in values if v is not None]
    if not values:
        return None
    return max(values) if name in MAXIMA else sum(values) / len(values)


def attention_cells(rows: list[AttentionRecord], name: str) -> Cells:
    """(("all" or "layer N", length), encoding) -> {seed: the run's value} for one quantity."""
    differ = differing(rows)
    grouped: dict[tuple, list] = {}
    for r in rows:
        key = (run_column(r, differ), r.run_seed, r.length)
        grouped.setdefault(key + ("all",), []).append(getattr(r, name))
        grouped.setdefault(key + (f"layer {r.layer}",), []).append(getattr(r, name))
    cells: Cells = {}
    for (encoding, seed, length, where), values in grouped.items():
        cells.setdefault(((where, length), encoding), {})[seed] = reduce(values, name)
    return cells


def estimate(values: dict) -> Optional[Estimate]:
    present = [v for v in values.values() if v is not None]
    return seed_interval(present) if present and len(present) == len(values) else None


def row_order(label) -> tuple:
    """"all" first, then the layers in order, then any other group by name; lengths ascending within each."""
    where, length = label
    if where == "all":
        return (0, 0, length)
    if where.startswith("layer "):
        return (1, int(where.split()[-1]), length)
    return (2, where, length)


def markdown(cells: Cells, digits: int = 3) -> str:
    """Rows (where, length) and encoding columns; "-" where a run recorded no value."""
    columns = sorted({c for _, c in cells})
    labels = sorted({k for k, _ in cells}, key=row_order)
    return markdown_table(["rows", "length", *columns], [
        [*label, *(format_cell(estimate(cells[label, c]), digits) if (label, c) in cells else "" for c in columns)]
        for label in labels])


def interval_note(cells: Cells) -> str:
    seeds = sorted({len(v) for v in cells.values()})
    if seeds == [1]:
        return "_one seed per cell: no interval._"
    return f"_mean over n={'/'.join(map(str, seeds))} seeds [95% Student-t interval]; one seed: its value alone._"


def write_csv(path: str, tables: dict[str, Cells]) -> None:
    """One line per (quantity, row, encoding, seed): every seed's value, with the cell's mean and interval."""
    with open(path, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["quantity", "rows", "length", "encoding", "seed", "value", "mean", "low", "high", "n"])
        for name, cells in tables.items():
            for ((where, length), encoding), values in sorted(cells.items(), key=lambda kv: (row_order(kv[0][0]),
                                                                                            kv[0][1])):
                e = estimate(values)
                summary = ["", "", "", len(values)] if e is None else [e.mean, "" if e.low is None else e.low,
                                                                       "" if e.high is None else e.high, e.n]
                for seed, value in values.items():
                    writer.writerow([name, where, length, encoding, "" if seed is None else seed,
                                     "" if value is None else value, *summary])


def panels_figure(cells: Cells, title: str, ylabel: str, train_lengths: set[int], path: str,
                  share_y: bool = True) -> None:
    """A panel per row group ("all", then each layer), a line per encoding against length with its interval band."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = sorted({where for (where, _), _ in cells}, key=lambda w: row_order((w, 0)))
    encodings = sorted({c for _, c in cells})
    fig, axes = plt.subplots(1, len(groups), figsize=(3.6 * len(groups) + 1, 3.6), squeeze=False, sharey=share_y)
    handles = {}
    for ax, where in zip(axes[0], groups):
        for number, encoding in enumerate(encodings):
            points = sorted((length, e) for ((w, length), c), values in cells.items()
                            if w == where and c == encoding and (e := estimate(values)) is not None
                            and math.isfinite(e.mean))
            if not points:
                continue
            # one colour per encoding in every panel, whichever encodings a panel lacks
            line, = ax.plot([x for x, _ in points], [e.mean for _, e in points], marker="o", label=encoding,
                            color=f"C{number % 10}")
            handles.setdefault(encoding, line)
            band = [(x, e.low, e.high) for x, e in points if e.low is not None]
            if band:
                ax.fill_between(*zip(*band), color=line.get_color(), alpha=0.2, linewidth=0)
        for train_length in train_lengths:
            ax.axvline(train_length, color="grey", linestyle="--")
        ax.set_xscale("log", base=2)
        ax.set_title(where)
        ax.set_xlabel("evaluation length (tokens)")
    axes[0][0].set_ylabel(ylabel)
    axes[0][-1].legend(list(handles.values()), list(handles), fontsize="x-small")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


LONG_CONTEXT = {  # table name -> a run's value from its LongContextRecord
    "key tokens, share of the targets past the training length": lambda r: r.key_tokens / r.tokens if r.tokens
    else None,
    "key tokens, loss with the whole window (nats)": lambda r: r.key_loss,
    "key tokens, loss with the training length (nats)": lambda r: r.key_loss_short,
    "hurt tokens, share of the targets past the training length": lambda r: r.hurt_tokens / r.tokens if r.tokens
    else None,
    "targets past the training length, loss with the whole window (nats)": lambda r: r.loss,
    "targets past the training length, loss with the training length (nats)": lambda r: r.loss_short,
}


def simple_cells(rows: list[Record], value: Callable) -> Cells:
    differ = differing(rows)
    cells: Cells = {}
    for r in rows:
        cells.setdefault((("all", r.length), run_column(r, differ)), {})[r.run_seed] = value(r)
    return cells


INCREMENT_TABLES = {  # table name -> (the encoding's quantity, the figure of it)
    "increment exactly 0, share of tokens": ("increment", "zero_share"),
    "increment, mean": ("increment", "mean"),
    "increment, median": ("increment", "p50"),
    "weight, mean": ("weight", "mean"),
}
PAIR_TABLE = "answer 1 vs answer 2: relative difference of the final hidden states"


def increment_cells(rows: list[IncrementRecord], quantity: str, figure: str) -> Cells:
    """(("<tokens>: layer N", length), encoding) -> {seed: the mean over the run's heads}."""
    differ = differing(rows)
    grouped: dict[tuple, list] = {}
    for r in rows:
        if r.quantity == quantity:
            key = (run_column(r, differ), r.run_seed, r.length, f"{r.tokens}: layer {r.layer}")
            grouped.setdefault(key, []).append(getattr(r, figure))
    cells: Cells = {}
    for (encoding, seed, length, where), values in grouped.items():
        cells.setdefault(((where, length), encoding), {})[seed] = sum(values) / len(values)
    return cells


def increments_report(paths: list[str], out: str) -> Optional[str]:
    """``<out>_increments.md/.csv`` and one figure ``<out>_increments.png`` (the share of zero increments at all
    tokens and at a task's answers per layer, at the mask where there are none, and the answer pair's difference,
    against length); None when no run recorded them."""
    rows = latest(paths, IncrementRecord, lambda r: (r.length, r.layer, r.head, r.quantity, r.tokens))
    pairs = latest(paths, HiddenPairRecord, lambda r: r.length)
    if not rows and not pairs:
        return None
    tables = {name: cells for name, (quantity, figure) in INCREMENT_TABLES.items()
              if (cells := increment_cells(rows, quantity, figure))}
    if pairs:
        tables[PAIR_TABLE] = simple_cells(pairs, lambda r: r.difference_mean)
    inputs = sorted({r.inputs for r in rows} | {r.inputs for r in pairs})
    parts = [f"Context-aware increments (docs/diagnostics.md#increments), read on: {', '.join(inputs)}. Per run the "
             "mean over heads; rows: the set of tokens and the layer."]
    parts += [f"### {name}\n\n{markdown(cells)}\n\n{interval_note(cells)}" for name, cells in tables.items()]
    text = "\n\n".join(parts)
    write_markdown(f"{out}_increments.md", text)
    write_csv(f"{out}_increments.csv", tables)
    zeros = tables.get("increment exactly 0, share of tokens", {})
    pictured = ("all", "answer") if any(key[0][0].startswith("answer:") for key in zeros) else ("all", "mask")
    shown = {key: v for key, v in zeros.items() if key[0][0].split(":")[0] in pictured}
    shown |= {(("answer pair: hidden difference", length), c): v
              for ((_, length), c), v in tables.get(PAIR_TABLE, {}).items()}
    panels_figure(shown, "share of increments exactly 0 (per set of tokens and layer); the answer pair's hidden "
                  "difference", "", {r.train_length for r in rows + pairs}, f"{out}_increments.png", share_y=False)
    return text


def diagnostics_report(paths: list[str], out: str) -> dict[str, str]:
    """Writes the diagnostics' tables and figures under the prefix ``out`` (nothing when no run recorded them);
    returns {"attention": markdown, "long context": markdown} for those written."""
    tables = {}
    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
    rows = latest(paths, AttentionRecord, lambda r: (r.length, r.layer, r.head))
    if rows:
        by_name = {name: attention_cells(rows, name) for name in QUANTITIES}
        sink, local = sorted({r.sink for r in rows}), sorted({r.local for r in rows})
        parts = [f"Attention diagnostics (docs/diagnostics.md): per run the mean over heads (max_logit: the maximum), "
                 f"'all' over layers and heads; sink = the first {'/'.join(map(str, sink))} positions, local = the "
                 f"last {'/'.join(map(str, local))}."]
        for name, cells in by_name.items():
            parts.append(f"### {name}\n\n{markdown(cells)}\n\n{interval_note(cells)}")
            panels_figure(cells, f"attention {name} vs evaluation length", name, {r.train_length for r in rows},
                          f"{out}_attention_{name}.png")
        tables["attention"] = "\n\n".join(parts)
        write_markdown(f"{out}_attention.md", tables["attention"])
        write_csv(f"{out}_attention.csv", by_name)
    gains = latest(paths, LongContextRecord, lambda r: r.length)
    if gains:
        by_name = {name: simple_cells(gains, value) for name, value in LONG_CONTEXT.items()}
        ppl = latest(paths, LengthRecord, lambda r: (r.length, r.mode))
        ppl = [r for r in ppl if r.mode == "nonoverlap"]
        if ppl:
            by_name = {"perplexity (every target, non-overlapping windows)": simple_cells(ppl, lambda r: r.ppl)} \
                | by_name
        thresholds = "/".join(f"{t:g}" for t in sorted({r.threshold for r in gains}))
        parts = [f"Tokens that need the long context (the model itself the reference; docs/diagnostics.md): key tokens "
                 f"are targets past the training length whose loss with the whole window is at least {thresholds} "
                 "nats below their loss with the training length; hurt tokens the reverse."]
        for name, cells in by_name.items():
            parts.append(f"### {name}\n\n{markdown(cells)}\n\n{interval_note(cells)}")
        tables["long context"] = "\n\n".join(parts)
        write_markdown(f"{out}_long_context.md", tables["long context"])
        write_csv(f"{out}_long_context.csv", by_name)
        shown = [name for name in LONG_CONTEXT if "share" in name or name.startswith("key tokens, loss with the whole")]
        merged = {((name, length), c): v for name in shown for ((_, length), c), v in by_name[name].items()}
        panels_figure(merged, "tokens that need the long context", "", {r.train_length for r in gains},
                      f"{out}_long_context.png", share_y=False)
    increments = increments_report(paths, out)
    if increments is not None:
        tables["increments"] = increments
    return tables
