"""The retrieval tables in the report (``retrieval.jsonl``): per retrieval set, nDCG@10 (and MRR@10, Recall@100) by
length and encoding, each encoding's change over the lengths, and why a set's rows cannot make one table."""

from __future__ import annotations

from typing import Optional

from ..records.schema import RetrievalRecord
from .comparable import incomparable, run_label
from .intervals import separable
from .tables import Cell, Table, aggregate, annotated, format_cell, neighbours


def retrieval_tables(rows: list[RetrievalRecord]) -> tuple[str, Table]:
    """One retrieval set's tables by length (x100, mean over seeds with intervals, bold where a paired test over the
    seeds does not separate a column from the best): nDCG@10, then MRR@10 and Recall@100 where every row has them,
    and the share of queries whose passage lies whole within each length; returns the text and the nDCG@10 table."""
    sections, first = [], None
    for metric, title in RetrievalRecord.METRICS.items():
        if any(getattr(r, metric) is None for r in rows):
            continue  # MLDR, and rows an earlier version wrote: nDCG@10 only
        table = aggregate(rows, lambda r: r.length, lambda r, metric=metric: 100 * getattr(r, metric))
        first = first or table
        sections.append(f"{title} (x100)\n\n" + annotated(table, best=max))
    if first is not None and len(first[1]) > 1:
        sections.append(length_change(first, "nDCG@10 (x100)"))
    shares = {r.length: r.visible for r in rows if r.visible is not None}
    if shares:
        sections.append("whole passage in view: " + ", ".join(f"{length}: {100 * share:.1f}%"
                                                              for length, share in sorted(shares.items())))
    return "\n\n".join(sections), first


def retrieval_incomparable(rows: list[RetrievalRecord]) -> Optional[str]:
    """Why the retrieval rows cannot make their tables, or None: two sets of one name whose contents differ (their
    ``dataset_hash``: a set built again under the same folder name), or, within one set's table, runs that
    :func:`incomparable` keeps apart. Rows without a set hash (MLDR, an earlier version's) are taken by their name."""
    for dataset in sorted({r.dataset for r in rows}):
        named = [r for r in rows if r.dataset == dataset]
        hashes = sorted({r.dataset_hash for r in named if r.dataset_hash is not None})
        if len(hashes) > 1:
            def runs(h: str) -> str:
                return ", ".join(sorted({run_label(r) for r in named if r.dataset_hash == h}))

            return (f"two retrieval sets are named {dataset}, with other contents: "
                    + " vs ".join(f"set {h[:12]} ({runs(h)})" for h in hashes)
                    + "; report them apart, or give one of them another folder name")
        if problem := incomparable(named):
            return f"retrieval on {dataset}: {problem}"
    return None


def length_change(table: Table, name: str) -> str:
    """Each encoding's change from the table's first length to its last, per seed: the mean with a t-interval, and
    whether a paired t-test over the seeds says it rises or falls. The CABLE paper's Table 2 is read by this shape
    (relative encodings rise as more of the document comes into view, RoPE and sinusoidal collapse)."""
    columns, rows = table
    first, last = rows[0], rows[-1]
    parts, changes = [], {}
    for column, start, end in zip(columns, first[1:], last[1:]):
        if start is None or end is None:
            continue
        seeds = [s for s in start.values if s in end.values and None not in (start.values[s], end.values[s])]
        if not seeds:
            continue
        before, after = [start.values[s] for s in seeds], [end.values[s] for s in seeds]
        if len(seeds) < 2:
            verdict = "one seed, no test"
        elif separable(after, before):
            verdict = "rises" if sum(after) > sum(before) else "falls"
        else:
            verdict = "not separated from no change"
        changes[column] = Cell({s: a - b for s, a, b in zip(seeds, after, before)})
        parts.append(f"{column} {format_cell(changes[column].estimate(), 2)} ({verdict})")
    text = f"{name}, change from {first[0]} to {last[0]} (paired t-test over seeds, p < 0.05): " + "; ".join(parts)
    ranking = neighbours(list(changes), [[f"change {first[0]} to {last[0]}", *changes.values()]], best=max)
    return "\n\n".join(part for part in (text, ranking) if part)
