"""Collect runs into the CABLE paper's Table-1 layout and Figure-1 plot, with intervals over seeds.

Reads the records runs wrote (``length_eval.jsonl``, and where present the position, task, retrieval, throughput and
attention records), keeps each run's latest evaluation (a run is one encoding, training length and seed), and writes
under the prefix ``--out``, per window mode, perplexity by length and encoding with its extrapolation ratio
(``<out>_<mode>.md/.csv/.png``), then a table for each kind of record present. Each cell is the mean over seeds with
its 95% interval (one seed: a bootstrap over the evaluated windows); bold marks the best mean and every encoding a
paired test does not separate from it (eval/tables.py). docs/training.md#what-the-report-writes lists every file.
The report is :data:`SECTIONS`, one entry per part: the records it reads and what it writes.

    python -m cable_lightning report runs/pydocs --out runs/pydocs/report
"""

from __future__ import annotations

import argparse
import math
import os
from dataclasses import dataclass
from typing import Any, Callable, NamedTuple, Optional

from cable_lightning.errors import ArgumentParser, ConfigError
from cable_lightning.eval.comparable import (
    behind_their_seeds,
    differing,
    incomparable,
    latest_step,
    rows_by_step,
    run_column,
)
from cable_lightning.eval.diagnostics_report import diagnostics_report
from cable_lightning.eval.intervals import seed_interval
from cable_lightning.eval.loss_curves import loss_curves, loss_curves_figure
from cable_lightning.eval.retrieval_tables import retrieval_incomparable, retrieval_tables
from cable_lightning.eval.tables import (
    Cell,
    Table,
    aggregate,
    annotated,
    best_columns,
    describe,
    format_cell,
    markdown,
    markdown_table,
    neighbours,
    write_csv,
    write_table,
)
from cable_lightning.eval.task_tables import algorithmic_table, algorithmic_training_table, effective_table, task_table
from cable_lightning.figures import line_figure, save_figure, step_panels, zoomed_line_figure
from cable_lightning.records.io import find_records
from cable_lightning.records.schema import (
    LengthRecord,
    PositionRecord,
    Record,
    RetrievalRecord,
    TaskRecord,
    ThroughputRecord,
)
from cable_lightning.tasks.scoring import DEFAULT_THRESHOLD


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


ZOOM_RATIO = 0.1  # the training-length figure's second panel: encodings whose ratio stays within this of 1


def training_length_figure(m: int, table: Table, mode: str, path: str) -> None:
    columns, rows = table
    series = {name: [(row[0], e.mean) for row in rows if row[i + 1] and (e := row[i + 1].estimate())]
              for i, name in enumerate(columns)}
    bands = {name: [(row[0], e.low, e.high) for row in rows if row[i + 1] and (e := row[i + 1].estimate())
                    and e.low is not None] for i, name in enumerate(columns)}
    title, ylabel = f"ppl({m}x) / ppl(1x) against the training length ({mode})", f"ppl({m}x) / ppl(1x)"
    # The encodings that extrapolate (ratio within ZOOM_RATIO of 1 at every length) differ by hundredths: beside one
    # that does not (RoPE: 1.4-3.8 here) they would be one line, so they get a panel of their own.
    near = [name for name, points in series.items() if points and all(abs(y - 1) <= ZOOM_RATIO for _, y in points)]
    if near and len(near) < len(series):
        figure = zoomed_line_figure(series, near, (title, f"within {ZOOM_RATIO:g} of 1"),
                                    "training length (tokens)", ylabel, bands)
    else:
        figure = line_figure(series, title, None, "training length (tokens)", ylabel, False, bands=bands)
    save_figure(figure, path)


def position_table(rows: list[PositionRecord]) -> Table:
    """Mean NLL by (evaluation length, position bucket) and encoding."""
    return aggregate(rows, lambda r: (r.length, r.first_position, r.last_position), lambda r: r.loss)


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


def trained_past_their_steps(runs: dict) -> list[str]:
    """A line for each run whose evaluations name more than one max_steps (trained on: eval.comparable.trained_on)."""
    lines = []
    for run, steps in sorted(runs.items(), key=str):
        planned = sorted({r.recipe["steps"] for rows in steps.values() for r in rows
                          if r.recipe and "steps" in r.recipe})
        if len(planned) > 1:
            lines.append(f"- {run.describe()}: evaluated at step {max(steps)}, trained to max_steps "
                         + " then ".join(map(str, planned)))
    return lines

class Evaluations(NamedTuple):
    """One kind of record under the report's paths: its files, each run's evaluations by step (:func:`rows_by_step`)
    and each run's latest rows."""

    files: list[str]
    runs: dict[tuple, dict[int, list[Record]]]
    rows: list[Record]


@dataclass(frozen=True)
class Inputs:
    """What a section writes from: the report's paths, output prefix and settings, and the records of every section
    that reads a kind (``read[kind]``)."""

    paths: list[str]
    out: str
    threshold: float
    figures: bool
    read: dict[type, Evaluations]


@dataclass(frozen=True)
class Section:
    """One part of the report: ``write`` writes its tables and figures under the prefix and returns {title: markdown}.
    A section that reads a kind of record names it (``kind``) and what one evaluation's rows are keyed by (``cell``:
    the later row of a cell wins); ``required``: the report needs such rows. Before anything is written, the latest
    rows of every ``compared`` section must be able to share a table (one :func:`incomparable` over them all: a
    task's runs are the perplexity's runs), and each section's own ``check`` must find nothing."""

    write: Callable[[Inputs], dict[str, str]]
    kind: Optional[type[Record]] = None
    cell: Optional[Callable[[Record], Any]] = None
    required: bool = False
    compared: bool = False
    check: Optional[Callable[[list[Record]], Optional[str]]] = None


def perplexity_section(inputs: Inputs) -> dict[str, str]:
    """Per window mode: perplexity by length and encoding with the ratio to the training length, the summary, the
    ratio by training length, and their figures."""
    runs, rows = inputs.read[LengthRecord].runs, inputs.read[LengthRecord].rows
    out, figures = inputs.out, inputs.figures
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
    return tables


def position_section(inputs: Inputs) -> dict[str, str]:
    """Mean NLL by position bucket."""
    found = inputs.read[PositionRecord]
    if not found.files:
        return {}
    table = position_table(found.rows)
    header = "length: positions"
    return {"position": write_table(f"{inputs.out}_position", markdown(*table, digits=3, header=header) + "\n\n"
                                    + describe(table, "lowest"), table, "loss", header)}


def task_section(inputs: Inputs) -> dict[str, str]:
    """Each task's accuracy, the algorithmic tasks' scores and their course over training, the effective lengths."""
    task_runs, task_rows, out = inputs.read[TaskRecord].runs, inputs.read[TaskRecord].rows, inputs.out
    tables = {}
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
        tables["effective length"] = (effective_table(task_rows, inputs.threshold) + "\n\n"
                                      + f"_the longest length, from the training length on, whose exact-match accuracy "
                                      f"(mean over seeds and depths) stays at or above {inputs.threshold}; each seed's "
                                      "in brackets; -: even the training length falls short._")
        write_table(f"{out}_effective", tables["effective length"])
    return tables


def retrieval_section(inputs: Inputs) -> dict[str, str]:
    """Per retrieval set, its tables by length and their figure."""
    retrieval_rows, out, tables = inputs.read[RetrievalRecord].rows, inputs.out, {}
    for dataset in sorted({r.dataset for r in retrieval_rows}):
        text, table = retrieval_tables([r for r in retrieval_rows if r.dataset == dataset])
        tables[f"retrieval {dataset}"] = write_table(f"{out}_retrieval_{dataset}", text, table, "ndcg10")
        if inputs.figures:
            plot(*table, f"retrieval vs evaluation length ({dataset})", f"{out}_retrieval_{dataset}.png",
                 "nDCG@10 (x100)", log_y=False)
    return tables


def speed_section(inputs: Inputs) -> dict[str, str]:
    """Each run's training speed on each machine."""
    found = inputs.read[ThroughputRecord]
    return {"speed": write_table(f"{inputs.out}_speed", speed_table(found.rows))} if found.files else {}


def loss_curves_section(inputs: Inputs) -> dict[str, str]:
    """The pre-training and contrastive loss curves (a figure, no table)."""
    curves = loss_curves(inputs.paths)
    if curves and inputs.figures:
        loss_curves_figure(curves, f"{inputs.out}_loss_curves.png")
    return {}


def run_notes(inputs: Inputs) -> dict[str, str]:
    """The runs resumed with a longer max_steps, and the runs behind their other seeds (an earlier report's note
    about runs that have since caught up is removed)."""
    runs, task_runs, out, tables = inputs.read[LengthRecord].runs, inputs.read[TaskRecord].runs, inputs.out, {}
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
    elif os.path.exists(f"{out}_behind.md"):
        os.remove(f"{out}_behind.md")
    return tables


SECTIONS = [  # in the order they are written
    Section(perplexity_section, LengthRecord, lambda r: (r.length, r.mode), required=True, compared=True),
    Section(position_section, PositionRecord, lambda r: (r.length, r.first_position)),
    Section(task_section, TaskRecord, lambda r: (r.task, r.length, r.depth), compared=True),
    Section(retrieval_section, RetrievalRecord, lambda r: (r.dataset, r.length), check=retrieval_incomparable),
    Section(speed_section, ThroughputRecord, lambda r: r.machine),
    Section(loss_curves_section),  # the TensorBoard events beside the length records, and finetune_loss.jsonl
    Section(lambda inputs: diagnostics_report(inputs.paths, inputs.out)),  # attention and more: docs/diagnostics.md
    Section(run_notes),
]


def read_section(section: Section, paths: list[str]) -> Evaluations:
    """A section's records under ``paths`` (:func:`rows_by_step`); a required kind without rows is an error."""
    files = find_records(paths, section.kind.FILE, required=section.required)
    runs = rows_by_step(files, section.kind, section.cell)
    if section.required and not runs:
        raise ConfigError(f"{', '.join(files)} hold no evaluation rows; validate a run first")
    return Evaluations(files, runs, latest_step(runs))


def report(paths: list[str], out: str, threshold: float = DEFAULT_THRESHOLD, figures: bool = True) -> dict[str, str]:
    """Writes <out>_<mode>.md/.csv/.png, <out>_<mode>_training.png and <out>_<mode>_ratio_tokens.png for each window
    mode present, and <out>_position.md/.csv, <out>_task_<name>.md/.csv and <out>_effective.md where runs have such
    rows, and <out>_behind.md where a run's latest evaluation is at an earlier step than another seed's,
    <out>_trained_on.md where a run was resumed with a longer max_steps (counted at its latest evaluation), and for runs
    at two training lengths or more <out>_<mode>_training_length.md/.csv/.png (ppl(mx) / ppl(1x) against the training
    length); returns {mode, "<mode> summary", "<mode> ratio by training length", "position", "task <name>", "effective
    length", "runs trained on" or "runs behind their other seeds": markdown}. ``figures=False`` draws no figure (the
    tables alone, as the published-tables test builds them)."""
    read = {s.kind: read_section(s, paths) for s in SECTIONS if s.kind is not None}
    compared = [r for s in SECTIONS if s.compared for r in read[s.kind].rows]
    checks = (s.check(read[s.kind].rows) for s in SECTIONS if s.check is not None)
    if problem := incomparable(compared) or next((p for p in checks if p), None):  # before anything is written
        raise ConfigError(f"report {' '.join(paths)}: {problem}")
    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
    inputs = Inputs(paths, out, threshold, figures, read)
    tables = {}
    for section in SECTIONS:
        tables.update(section.write(inputs))
    return tables


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
