"""Collect runs into the CABLE paper's Table-1 layout and Figure-1 plot, with intervals over seeds.

Reads the records runs wrote (``length_eval.jsonl``, and where present the position, task, retrieval, throughput and
attention records), keeps each run's latest evaluation (a run is one encoding, training length and seed), and writes
under the prefix ``--out``, per window mode, perplexity by length and encoding with its extrapolation ratio
(``<out>_<mode>.md/.csv/.png``), then a table for each kind of record present. Each cell is the mean over seeds with
its 95% interval (one seed: a bootstrap over the evaluated windows); bold marks the best mean and every encoding a
paired test does not separate from it (eval/tables.py). docs/training.md#what-the-report-writes lists every file.

    python -m cable_lightning report runs/pydocs --out runs/pydocs/report
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from typing import Callable, Optional

from cable_lightning.errors import ArgumentParser, ConfigError
from cable_lightning.eval.diagnostics_report import diagnostics_report
from cable_lightning.eval.intervals import seed_interval, separable
from cable_lightning.eval.tables import (
    Cell,
    Table,
    best_columns,
    describe,
    format_cell,
    markdown,
    markdown_table,
    neighbours,
    write_csv,
    write_table,
)
from cable_lightning.figures import line_figure, save_figure, step_panels
from cable_lightning.records import (
    LengthRecord,
    LossPoint,
    PositionRecord,
    Record,
    RetrievalRecord,
    TaskRecord,
    ThroughputRecord,
    behind_their_seeds,
    differing,
    find_records,
    incomparable,
    latest_rows,
    latest_step,
    read_records,
    rows_by_step,
    run_column,
    run_label,
)
from cable_lightning.tasks.scoring import DEFAULT_THRESHOLD, effective_length


def aggregate(rows: list[Record], label: Callable, value: Callable, windows: Optional[Callable] = None) -> Table:
    """Cells of ``value(row)`` by (``label(row)``, encoding column), one value per run seed."""
    differ = differing(rows)
    cells: dict[tuple, Cell] = {}
    for r in rows:
        cell = cells.setdefault((label(r), run_column(r, differ)), Cell({}, {}))
        cell.values[r.run_seed] = value(r)
        if windows is not None:
            cell.windows[r.run_seed] = windows(r)
    columns = sorted({c for _, c in cells})
    labels = sorted({k for k, _ in cells})
    return columns, [[k] + [cells.get((k, c)) for c in columns] for k in labels]


def build_table(rows: list[LengthRecord], mode: str) -> Table:
    """Perplexity by evaluation length and encoding."""
    def windows(r):
        return ((r.window_nll, r.window_tokens), None) if r.window_nll else None

    return aggregate([r for r in rows if r.mode == mode], lambda r: r.length, lambda r: r.ppl, windows)


def ratio_table(rows: list[LengthRecord], mode: str) -> Table:
    """ppl(L) / ppl(training length) by evaluation length (other than the training length) and encoding, each run's
    ratio from its own rows (runs that did not evaluate their training length are left out). A one-seed interval
    resamples each window with the training-length windows that score the same tokens."""
    rows = [r for r in rows if r.mode == mode]
    at_train = {(r.run_key(), r.step): r for r in rows if r.length == r.train_length and r.ppl}
    rows = [r for r in rows if (r.run_key(), r.step) in at_train and r.length != r.train_length]

    def ratio(r):
        return None if r.ppl is None else r.ppl / at_train[r.run_key(), r.step].ppl

    def windows(r):
        ref = at_train[r.run_key(), r.step]
        return ((r.window_nll, r.window_tokens), (ref.window_nll, ref.window_tokens)) if r.window_nll and \
            ref.window_nll else None

    return aggregate(rows, lambda r: r.length, ratio, windows)


def training_length_table(rows: list[LengthRecord], mode: str) -> Optional[tuple[int, Table]]:
    """(m, each encoding's ppl(m x T) / ppl(T) by training length T): m the largest multiple of its training length
    that every training length evaluated, one value per seed; None unless the runs trained at two lengths or more
    and share a multiple past 1x. What a change of training length does to extrapolation, at the same multiple."""
    rows = [r for r in rows if r.mode == mode and r.ppl]
    trained = sorted({r.train_length for r in rows})
    if len(trained) < 2:
        return None
    multiples = set.intersection(*({r.length // t for r in rows if r.train_length == t and r.length % t == 0}
                                   for t in trained))
    if not (past := [m for m in multiples if m > 1]):
        return None
    m = max(past)
    ppl = {(r.run_key(), r.length // r.train_length): r.ppl for r in rows if r.length % r.train_length == 0}
    cells: dict[tuple[int, str], Cell] = {}
    for r in rows:
        if r.length == m * r.train_length and (r.run_key(), 1) in ppl:
            cells.setdefault((r.train_length, r.run_name()), Cell({})).values[r.run_seed] = r.ppl / ppl[r.run_key(), 1]
    columns = sorted({name for _, name in cells})
    return m, (columns, [[t] + [cells.get((t, name)) for name in columns] for t in trained])


def training_length_figure(m: int, table: Table, mode: str, path: str) -> None:
    columns, rows = table
    series = {name: [(row[0], e.mean) for row in rows if row[i + 1] and (e := row[i + 1].estimate())]
              for i, name in enumerate(columns)}
    bands = {name: [(row[0], e.low, e.high) for row in rows if row[i + 1] and (e := row[i + 1].estimate())
                    and e.low is not None] for i, name in enumerate(columns)}
    save_figure(line_figure(series, f"ppl({m}x) / ppl(1x) against the training length ({mode})", None,
                            "training length (tokens)", f"ppl({m}x) / ppl(1x)", False, bands=bands), path)


def position_table(rows: list[PositionRecord]) -> Table:
    """Mean NLL by (evaluation length, position bucket) and encoding."""
    return aggregate(rows, lambda r: (r.length, r.first_position, r.last_position), lambda r: r.loss)


def depth_means(rows: list) -> dict[tuple, Optional[float]]:
    """{(run, length): accuracy averaged over the rows' depths}, None where any cell could not be run."""
    cells: dict[tuple, list] = {}
    for r in rows:
        cells.setdefault((r.run_key(), r.length), []).append(r.accuracy)
    return {key: None if None in values else sum(values) / len(values) for key, values in cells.items()}


def task_table(rows: list[TaskRecord]) -> Table:
    """One task's exact-match accuracy by length and encoding: each run's mean over depths, aggregated over seeds."""
    accuracy = depth_means(rows)
    runs = list({(r.run_key(), r.length): r for r in rows}.values())
    return aggregate(runs, lambda r: r.length, lambda r: accuracy[r.run_key(), r.length])


def effective_table(rows: list[TaskRecord], threshold: float) -> str:
    """The effective length per task (rows) and encoding (columns): from the mean accuracy over seeds, then each
    seed's own in brackets when there are several."""
    tasks = sorted({r.task for r in rows})
    differ = differing(rows)
    columns = sorted({run_column(r, differ) for r in rows})
    records = {r.run_key(): r for r in rows}
    lines = []
    for task in tasks:
        cells = []
        for column in columns:
            runs: dict = {}  # seed -> {length: accuracy}
            train_length = None
            for (run, length), value in depth_means([r for r in rows if r.task == task]).items():
                if run_column(records[run], differ) == column:
                    runs.setdefault(records[run].run_seed, {})[length] = value
                    train_length = records[run].train_length
            if not runs:
                cells.append("")
                continue
            lengths = sorted({n for accuracy in runs.values() for n in accuracy})
            mean = {n: None if any(a.get(n) is None for a in runs.values())
                    else sum(a[n] for a in runs.values()) / len(runs) for n in lengths}
            text = format_length(effective_length(mean, train_length, threshold))
            if len(runs) > 1:
                text += " (" + ", ".join(format_length(effective_length(runs[s], train_length, threshold))
                                         for s in sorted(runs, key=str)) + ")"
            cells.append(text)
        lines.append([task, *cells])
    return markdown_table(["task", *columns], lines)


def algorithmic_scores(rows: list[TaskRecord]) -> dict[tuple, Optional[float]]:
    """{run: score} (the run's key names its task): an algorithmic task's per-token accuracy averaged over the
    evaluated lengths above the training length (the papers' score, over 41-500 for training lengths up to 40); None
    where a length could not be run or none was evaluated."""
    lengths: dict[tuple, list] = {}
    for r in rows:
        if r.scoring == "per_token" and r.length > r.train_length:
            lengths.setdefault(r.run_key(), []).append(r.accuracy)
    return {key: None if None in values else sum(values) / len(values) for key, values in lengths.items()}


def algorithmic_table(rows: list[TaskRecord]) -> str:
    """The Chomsky-hierarchy table: per task (rows) and encoding (columns, with the learning rate when runs differ in
    it), the score's mean over seeds [95% Student-t interval] and its maximum over seeds (the papers report the
    maximum over seeds and learning rates), in %; with several learning rates, a last column per encoding of the
    maximum over both. Bold: the highest mean and every column a paired t-test over shared seeds does not separate
    from it, or that shares fewer than two seeds with it (nothing can separate those)."""
    scores = algorithmic_scores(rows)
    runs = {key: r for r in rows if (key := r.run_key()) in scores}
    differ = differing(runs.values())
    columns = sorted({run_column(r, differ) for r in runs.values()})
    encodings = sorted({run_column(r, differ, with_lr=False) for r in runs.values()})
    header = columns + ([f"{e} max over seeds and lrs" for e in encodings] if differ[1] else [])
    lines = []
    for task in sorted({r.task for r in runs.values()}):
        seeds = [Cell({r.run_seed: scores[key] for key, r in runs.items() if r.task == task
                       and run_column(r, differ) == column}) for column in columns]
        marked = best_columns([c if c.values else None for c in seeds], higher=True, unpaired=True)
        cells = [f"**{text}**" if i in marked and text else text
                 for i, text in enumerate(score_cell(list(c.values.values())) for c in seeds)]
        if differ[1]:
            for encoding in encodings:
                values = [scores[key] for key, r in runs.items() if r.task == task
                          and run_column(r, differ, with_lr=False) == encoding]
                cells.append("-" if not values or None in values else f"{100 * max(values):.1f}")
        lines.append([task, *cells])
    return markdown_table(["task", *header], lines)


def algorithmic_training_table(runs: dict[tuple, dict[int, list[TaskRecord]]]) -> str:
    """Whether a step count is enough (have the accuracies stopped moving?): per algorithmic task, every evaluated step
    (rows) and encoding (columns), the accuracy at the training length and the score, in %, each the mean over the
    seeds evaluated at that step, with their count where it is fewer than the column's; '' when no run was
    evaluated at two steps."""
    rows = [r for steps in runs.values() for step_rows in steps.values() for r in step_rows if r.scoring == "per_token"]
    if len({(r.run_key(), r.step) for r in rows}) == len({r.run_key() for r in rows}):  # each run evaluated once
        return ""
    differ = differing(rows)
    columns = sorted({run_column(r, differ) for r in rows})
    sections = []
    for task in sorted({r.task for r in rows}):
        task_rows = [r for r in rows if r.task == task]
        seeds = {column: len({r.run_seed for r in task_rows if run_column(r, differ) == column}) for column in columns}
        lines = []
        for step in sorted({r.step for r in task_rows}):
            cells = []
            for column in columns:
                at_step = [r for r in task_rows if r.step == step and run_column(r, differ) == column]
                scores = list(algorithmic_scores(at_step).values())
                at_train = [r.accuracy for r in at_step if r.length == r.train_length]
                if not scores:
                    cells.append("")
                    continue
                if None in scores + at_train:
                    cells.append("-")
                    continue
                train = f"{100 * sum(at_train) / len(at_train):.0f}" if at_train else "?"
                count = f" (n={len(scores)})" if len(scores) < seeds[column] else ""
                cells.append(f"{train} / {100 * sum(scores) / len(scores):.1f}{count}")
            lines.append([step, *cells])
        sections.append(f"### {task}\n\n" + markdown_table(["step", *columns], lines))
    return "\n\n".join(sections)


def score_cell(values: list[Optional[float]]) -> str:
    """Mean [interval] and max over seeds, in %; '-' where a run could not serve a length."""
    if not values:
        return ""
    if None in values:
        return "-"
    e = seed_interval([100 * v for v in values])
    interval = "" if e.low is None else f" [{e.low:.1f}, {e.high:.1f}]"
    return f"{e.mean:.1f}{interval}, max {100 * max(values):.1f} (n={len(values)})"


def format_length(length: Optional[int]) -> str:
    return "-" if length is None else str(length)


def plot(columns, table, title: str, path: str, ylabel: str = "perplexity", log_y: bool = True):
    """Each column's means against the row lengths, a band for each interval."""
    series, bands = {}, {}
    for i, name in enumerate(columns):
        estimates = [(row[0], row[i + 1].estimate()) for row in table if row[i + 1] is not None]
        series[name] = [(length, e.mean) for length, e in estimates if e is not None]
        bands[name] = [(length, e.low, e.high) for length, e in estimates if e is not None and e.low is not None]
    save_figure(line_figure(series, title, None, "evaluation length (tokens)", ylabel, log_y, bands=bands), path)


def step_tables(runs: dict[tuple, dict[int, list[Record]]], mode: str) -> dict[int, tuple]:
    """``{step: (perplexity table, ratio table, the rows)}`` of ``mode``'s rows at each evaluated step, built once
    for both training figures; empty when no run was evaluated at two steps or more."""
    rows = [r for steps in runs.values() for step_rows in steps.values() for r in step_rows if r.mode == mode]
    if len({r.step for r in rows}) < 2:
        return {}
    by_step = {step: [r for r in rows if r.step == step] for step in sorted({r.step for r in rows})}
    return {step: (build_table(step_rows, mode), ratio_table(step_rows, mode), step_rows)
            for step, step_rows in by_step.items()}


def training_figure(tables: dict[int, tuple], mode: str, path: str) -> bool:
    """Per encoding (a column of panels): perplexity (top) and ratio to the training length (bottom) at each
    evaluated length against the training step (``tables``: :func:`step_tables`), the mean over seeds with a
    t-interval band; False when no run was evaluated at two steps or more."""
    if not tables:
        return False
    encodings = sorted({c for (ppl, _, _) in tables.values() for c in ppl[0]})
    panels: dict[str, list[dict]] = {}
    for encoding in encodings:
        for which in (0, 1):
            curves: dict[int, list] = {}
            for step, pair in tables.items():
                columns, table = pair[which]
                if encoding not in columns:
                    continue
                for length, *cells in table:
                    cell = cells[columns.index(encoding)]
                    e = seed_interval(list(cell.values.values())) if cell and None not in cell.values.values() \
                        else None
                    if e is not None and math.isfinite(e.mean):
                        curves.setdefault(length, []).append((step, e.mean, e.low, e.high))
            panels.setdefault(encoding, []).append(curves)
    step_panels(panels, ["perplexity", "ppl(L) / ppl(train length)"], f"extrapolation over training ({mode})", path)
    return True


def ratio_tokens_figure(tables: dict[int, tuple], mode: str, path: str) -> bool:
    """ppl(longest length) / ppl(training length) against the tokens trained (the step times the recipe's tokens of
    an optimizer step; the step where runs recorded no recipe), one line per encoding: the mean over seeds with its
    t-interval band (``tables``: :func:`step_tables`). How each encoding's extrapolation moves with training, all
    encodings on one axis; False when no run was evaluated at two steps or more."""
    rows = [r for _, _, step_rows in tables.values() for r in step_rows]
    if not rows:
        return False
    longest = max(r.length for r in rows)
    batch_tokens = {(r.recipe or {}).get("batch_tokens") for r in rows}
    per_step = batch_tokens.pop() if len(batch_tokens) == 1 and None not in batch_tokens else None
    series: dict[str, list] = {}
    bands: dict[str, list] = {}
    for step, (_, (columns, table), _) in tables.items():
        for length, *cells in table:
            if length != longest:
                continue
            for encoding, cell in zip(columns, cells):
                values = list(cell.values.values()) if cell else []
                e = seed_interval(values) if values and None not in values else None
                if e is not None and math.isfinite(e.mean):
                    x = step * per_step if per_step else step
                    series.setdefault(encoding, []).append((x, e.mean))
                    if e.low is not None:
                        bands.setdefault(encoding, []).append((x, e.low, e.high))
    train = sorted({r.train_length for r in rows})
    title = f"ppl({longest}) / ppl({'/'.join(map(str, train))}) against training ({mode})"
    xlabel = "tokens trained" if per_step else "training step"
    save_figure(line_figure(series, title, None, xlabel, f"ppl({longest}) / ppl(train length)", False, bands=bands),
                path)
    return True


def summary(ppl: Table, ratio: Table, train_length: int) -> str:
    """The headline form of a length table: one row per encoding, ranked by its ratio at the longest length, with its
    perplexity at 1x, 4x, 16x ... of the training length (and the longest) and that ratio; bold as in the full tables
    (the best of a column and every encoding a paired test does not separate from it)."""
    lengths = {label: cells for label, *cells in ppl[1]}
    ratios = {label: cells for label, *cells in ratio[1]}
    longest = max(ratios)
    shown = [n for n in lengths if n == longest or (n % train_length == 0 and _power_of_4(n // train_length))]
    picked = [(lengths[n], f"{format_length_ratio(n, train_length)} ({n})", 2) for n in shown]
    picked.append((ratios[longest], f"ppl({format_length_ratio(longest, train_length)}) / ppl(1x)", 3))
    texts = []
    for cells, _, digits in picked:
        marked = best_columns(cells)
        texts.append([("**{}**" if i in marked else "{}").format(format_cell(c.estimate() if c else None, digits))
                      for i, c in enumerate(cells)])
    last = ratios[longest]
    order = sorted(range(len(ppl[0])), key=lambda i: (last[i] is None or last[i].estimate() is None,
                                                       last[i].estimate().mean if last[i] and last[i].estimate()
                                                       else 0.0))
    return markdown_table(["encoding", *(header for _, header, _ in picked)],
                          [[ppl[0][i], *(column[i] for column in texts)] for i in order])


def _power_of_4(n: int) -> bool:
    return n >= 1 and n & (n - 1) == 0 and (n.bit_length() - 1) % 2 == 0


def format_length_ratio(length: int, train_length: int) -> str:
    return f"{length // train_length}x" if length % train_length == 0 else f"{length / train_length:.2g}x"


def annotated(table: Table, best=min, digits: int = 2) -> str:
    """A table in Markdown with its notes: what the intervals and bold mean, and each row's ranking with the paired
    test between neighbours."""
    parts = [markdown(*table, best=best, digits=digits), describe(table, "highest" if best is max else "lowest"),
             neighbours(*table, best=best, digits=digits)]
    return "\n\n".join(part for part in parts if part)


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


def speed_table(rows: list[ThroughputRecord]) -> str:
    """Each run's training speed (its latest fit on each machine): the rows of a speed table, as the run measured
    them (:class:`ThroughputRecord`)."""
    differ = differing(rows)
    head = ["run", "machine", "precision", "tokens trained", "steady tokens/s", "MFU", "steady steps (s)"]
    lines = []
    for r in sorted(rows, key=lambda r: (run_column(r, differ), str(r.run_seed), str(r.machine))):
        seed = "" if r.run_seed is None else f" seed {r.run_seed}"
        lines.append([f"{run_column(r, differ)}{seed}", r.machine or "?", r.precision or "?", f"{r.tokens:,}",
                      "-" if r.tokens_per_sec is None else f"{r.tokens_per_sec:,.0f}",
                      "-" if r.mfu is None else f"{r.mfu:.1%}", f"{r.steady_steps} ({r.steady_seconds:.3g})"])
    return markdown_table(head, lines) + ("\n\n_steady: after the first warm-up steps (compiling) to the last "
                                          "logging step, validations left out; MFU per device, against the device's "
                                          "datasheet dense bf16 peak (none on a CPU)._")


TRAIN_LOSS_TAG = "train/loss"  # what the LightningModules log every log_every_n_steps


def loss_curves(paths: list[str]) -> dict[str, dict[str, dict[int, list[float]]]]:
    """{"pre-training loss" / "contrastive loss": {encoding: {step: one value per seed}}}. A run's pre-training loss
    comes from the TensorBoard events beside its length records (a resumed run's versions joined, the later version
    winning a step); a tuned export's contrastive loss is attributed to its run by the checkpoint it was exported from
    (``provenance`` in its config.json, the ``checkpoint`` of the run's retrieval rows)."""
    from tensorboard.backend.event_processing.event_accumulator import SCALARS, EventAccumulator

    per_run: dict[str, dict[tuple, dict[int, float]]] = {"pre-training loss": {}, "contrastive loss": {}}
    named: dict[tuple, Record] = {}  # a row of each run: its column's name
    for file in find_records(paths, required=False):
        rows = read_records(file, LengthRecord, torn=lambda *_: None)  # a torn line: said once, by rows_by_step
        events = EventAccumulator(os.path.dirname(file), size_guidance={SCALARS: 0})
        events.Reload()
        if rows and TRAIN_LOSS_TAG in events.Tags()[SCALARS]:
            named[rows[0].run_key()] = rows[0]
            curve = per_run["pre-training loss"].setdefault(rows[0].run_key(), {})
            curve.update({event.step: event.value for event in events.Scalars(TRAIN_LOSS_TAG)})
    runs = {(row.checkpoint, row.run_key().finetune): row
            for file in find_records(paths, RetrievalRecord.FILE, required=False)
            for row in read_records(file, RetrievalRecord)}
    for file in find_records(paths, LossPoint.FILE, required=False):
        config = os.path.join(os.path.dirname(file), "config.json")
        if not os.path.isfile(config):  # a curve copied out of its export: nothing names its run
            print(f"{file}: no export's config.json beside it, so no run to draw its contrastive loss for; "
                  "left out", file=sys.stderr)
            continue
        with open(config, encoding="utf-8") as f:
            provenance = json.load(f).get("provenance") or {}
        tuned = provenance.get("finetune")
        run = runs.get((provenance.get("checkpoint"), None if tuned is None else json.dumps(tuned, sort_keys=True)))
        if run is not None:
            named[run.run_key()] = run
            per_run["contrastive loss"][run.run_key()] = {p.step: p.loss for p in read_records(file, LossPoint)}
    differ = differing(named.values())
    curves: dict[str, dict[str, dict[int, list[float]]]] = {}
    for kind, by_run in per_run.items():
        for key, curve in sorted(by_run.items(), key=lambda item: repr(item[0])):  # a line's values in seed order
            line = curves.setdefault(kind, {}).setdefault(run_column(named[key], differ), {})
            for step, value in curve.items():
                line.setdefault(step, []).append(value)
    return curves


def loss_curves_figure(curves: dict[str, dict[str, dict[int, list[float]]]], path: str) -> None:
    """One panel per kind of loss, one line per encoding: the mean over its seeds at every logged step (steps some
    seed did not log are left out, so a line is always a mean over the same seeds)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(curves), figsize=(6.5 * len(curves), 4.5), squeeze=False)
    for ax, (kind, by_pe) in zip(axes[0], sorted(curves.items(), reverse=True)):
        for pe, by_step in sorted(by_pe.items()):
            seeds = max(map(len, by_step.values()))
            points = sorted((step, sum(v) / len(v)) for step, v in by_step.items() if len(v) == seeds)
            ax.plot(*zip(*points), label=f"{pe} (n={seeds})", linewidth=1)
        ax.set_xlabel("training step")
        ax.set_ylabel(kind)
        ax.set_title(f"{kind}, mean over seeds")
        ax.legend(fontsize="x-small")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def report(paths: list[str], out: str, threshold: float = DEFAULT_THRESHOLD, figures: bool = True) -> dict[str, str]:
    """Writes <out>_<mode>.md/.csv/.png, <out>_<mode>_training.png and <out>_<mode>_ratio_tokens.png for each window
    mode present, and <out>_position.md/.csv, <out>_task_<name>.md/.csv and <out>_effective.md where runs have such
    rows, and <out>_behind.md where a run's latest evaluation is at an earlier step than another seed's,
    <out>_trained_on.md where a run was resumed with a longer max_steps (counted at its latest evaluation), and for runs
    at two training lengths or more <out>_<mode>_training_length.md/.csv/.png (ppl(mx) / ppl(1x) against the training
    length); returns {mode, "<mode> summary", "<mode> ratio by training length", "position", "task <name>", "effective
    length", "runs trained on" or "runs behind their other seeds": markdown}. ``figures=False`` draws no figure (the
    tables alone, as the published-tables test builds them)."""
    files = find_records(paths)
    runs = rows_by_step(files)
    rows = latest_step(runs)
    if not rows:
        raise ConfigError(f"{', '.join(files)} hold no evaluation rows; validate a run first")
    found = find_records(paths, TaskRecord.FILE, required=False)
    task_runs = rows_by_step(found, TaskRecord, lambda r: (r.task, r.length, r.depth)) if found else {}
    task_rows = latest_step(task_runs)
    found = find_records(paths, RetrievalRecord.FILE, required=False)
    retrieval_rows = latest_rows(found, RetrievalRecord, lambda r: (r.dataset, r.length)) if found else []
    # before anything is written
    if problem := incomparable(rows + task_rows) or retrieval_incomparable(retrieval_rows):
        raise ConfigError(f"report {' '.join(paths)}: {problem}")
    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
    tables = {}
    for mode in sorted({r.mode for r in rows}):
        ppl, ratio = build_table(rows, mode), ratio_table(rows, mode)
        tables[mode] = annotated(ppl)
        if ratio[1]:
            tables[mode] += ("\n\nExtrapolation: ppl(L) / ppl(training length), per run\n\n"
                             + annotated(ratio, digits=3))
        write_table(f"{out}_{mode}", tables[mode], ppl, "ppl")
        if ratio[1]:
            write_csv(f"{out}_{mode}_ratio.csv", ratio, "ratio")
            if len(trained := {r.train_length for r in rows if r.mode == mode}) == 1 and ppl[0] == ratio[0]:
                tables[f"{mode} summary"] = write_table(f"{out}_{mode}_summary", summary(ppl, ratio, *trained))
        if (by_length := training_length_table(rows, mode)) is not None:
            m, table = by_length
            tables[f"{mode} ratio by training length"] = write_table(
                f"{out}_{mode}_training_length",
                f"ppl({m}x) / ppl(1x) by training length, per run\n\n" + "\n\n".join(part for part in (
                    markdown(*table, digits=3, header="training length"), describe(table, "lowest"),
                    neighbours(*table, digits=3)) if part), table, "ratio", "training length")
            if figures:
                training_length_figure(m, table, mode, f"{out}_{mode}_training_length.png")
        if figures:
            plot(*ppl, f"perplexity vs evaluation length ({mode})", f"{out}_{mode}.png")
            over_training = step_tables(runs, mode)
            training_figure(over_training, mode, f"{out}_{mode}_training.png")
            ratio_tokens_figure(over_training, mode, f"{out}_{mode}_ratio_tokens.png")
    found = find_records(paths, PositionRecord.FILE, required=False)
    if found:
        table = position_table(latest_rows(found, PositionRecord, lambda r: (r.length, r.first_position)))
        header = "length: positions"
        tables["position"] = write_table(f"{out}_position", markdown(*table, digits=3, header=header) + "\n\n"
                                         + describe(table, "lowest"), table, "loss", header)
    for task in sorted({r.task for r in task_rows}):
        table = task_table([r for r in task_rows if r.task == task])
        tables[f"task {task}"] = write_table(f"{out}_task_{task}", markdown(*table, best=max) + "\n\n"
                                             + describe(table, "highest"), table, "accuracy")
    if any(r.scoring == "per_token" for r in task_rows):
        tables["algorithmic"] = (algorithmic_table(task_rows) + "\n\n_per-token accuracy (%) averaged over the "
                                 "evaluated lengths above the training length: mean over seeds [95% Student-t "
                                 "interval], max over seeds (n seeds); bold: the highest mean and every encoding "
                                 "a paired t-test over shared seeds (p >= 0.05) does not separate from it, or that "
                                 "shares fewer than two seeds with it. The papers report the max over seeds and "
                                 "learning rates and call >= 90 solved._")
        write_table(f"{out}_algorithmic", tables["algorithmic"])
        training = algorithmic_training_table(task_runs)
        if training:
            tables["algorithmic over training"] = (training + "\n\n_accuracy at the training length / score (per-token "
                                                   "accuracy over the lengths above it), %, the mean over the seeds "
                                                   "evaluated at the step (n: fewer than the column's seeds)._")
            write_table(f"{out}_algorithmic_training", tables["algorithmic over training"])
    if task_rows:
        tables["effective length"] = (effective_table(task_rows, threshold) + "\n\n"
                                      + f"_the longest length, from the training length on, whose exact-match accuracy "
                                      f"(mean over seeds and depths) stays at or above {threshold}; each seed's in "
                                      "brackets; -: even the training length falls short._")
        write_table(f"{out}_effective", tables["effective length"])
    for dataset in sorted({r.dataset for r in retrieval_rows}):
        text, table = retrieval_tables([r for r in retrieval_rows if r.dataset == dataset])
        tables[f"retrieval {dataset}"] = write_table(f"{out}_retrieval_{dataset}", text, table, "ndcg10")
        if figures:
            plot(*table, f"retrieval vs evaluation length ({dataset})", f"{out}_retrieval_{dataset}.png",
                 "nDCG@10 (x100)", log_y=False)
    found = find_records(paths, ThroughputRecord.FILE, required=False)
    if found:
        tables["speed"] = write_table(f"{out}_speed", speed_table(latest_rows(found, ThroughputRecord,
                                                                              lambda r: r.machine)))
    curves = loss_curves(paths)
    if curves and figures:
        loss_curves_figure(curves, f"{out}_loss_curves.png")
    tables.update(diagnostics_report(paths, out))  # attention.jsonl, long_context.jsonl: docs/diagnostics.md
    behind = behind_their_seeds(task_runs)  # an algorithmic run's key names its task; its length rows' key does not
    behind |= {run: steps for run, steps in behind_their_seeds(runs).items()
               if not any(k._replace(task=None) == run for k in behind)}
    if continued := trained_past_their_steps(runs):
        tables["runs trained on"] = ("Resumed with a longer max_steps; counted at their latest evaluation:\n\n"
                                     + "\n".join(continued))
        write_table(f"{out}_trained_on", tables["runs trained on"])
    if behind:
        lines = [f"- {run.describe()} at step {step}, another seed at {furthest}"
                 for run, (step, furthest) in sorted(behind.items(), key=str)]
        tables["runs behind their other seeds"] = ("Counted at their latest evaluation; in flight or stopped early, "
                                                   "so the means above mix steps:\n\n" + "\n".join(lines))
        write_table(f"{out}_behind", tables["runs behind their other seeds"])
    elif os.path.exists(f"{out}_behind.md"):  # an earlier report's, about runs that have since caught up
        os.remove(f"{out}_behind.md")
    return tables


def trained_past_their_steps(runs: dict) -> list[str]:
    """A line for each run whose evaluations name more than one max_steps (trained on: records.trained_on)."""
    lines = []
    for run, steps in sorted(runs.items(), key=str):
        planned = sorted({r.recipe["steps"] for rows in steps.values() for r in rows
                          if r.recipe and "steps" in r.recipe})
        if len(planned) > 1:
            lines.append(f"- {run.describe()}: evaluated at step {max(steps)}, trained to max_steps "
                         + " then ".join(map(str, planned)))
    return lines


def main(argv=None):
    parser = ArgumentParser(prog="python -m cable_lightning report", description=__doc__,
                            formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", nargs="+", help="run directories or length_eval.jsonl files/globs")
    parser.add_argument("--out", default="runs/report", help="output prefix")
    parser.add_argument("--threshold", type=float, default=DEFAULT_THRESHOLD,
                        help="the accuracy a length must keep to count toward a task's effective length")
    args = parser.parse_args(argv)
    if not 0.0 < args.threshold <= 1.0:
        raise ConfigError(f"--threshold must be in (0, 1], got {args.threshold}")
    titles = {"position": "mean NLL by token position"}
    for mode, table in report(args.runs, args.out, args.threshold).items():
        print(f"## {titles.get(mode, mode)}\n{table}\n")
    print(f"written: {args.out}_<mode>.md/.csv/.png, {args.out}_<mode>_training.png, "
          f"{args.out}_<mode>_ratio_tokens.png")


if __name__ == "__main__":  # an entry point once: say which verb replaced it, never exit 0 having done nothing
    from cable_lightning.verbs import replaced_entry_point

    replaced_entry_point(__spec__.name)
