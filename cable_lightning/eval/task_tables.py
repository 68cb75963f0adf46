"""The synthetic tasks' tables in the report (``task_accuracy.jsonl``): each task's accuracy by length and encoding,
the effective length (the longest length whose accuracy stays at a threshold), and for the algorithmic tasks
(per-token scoring) the Chomsky-hierarchy score table and its course over training."""

from __future__ import annotations

from typing import Optional

from ..records.schema import TaskRecord
from ..tasks.scoring import effective_length
from .comparable import differing, run_column
from .intervals import seed_interval
from .tables import Cell, Table, aggregate, best_columns, markdown_table


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
