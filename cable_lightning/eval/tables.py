"""Tables with intervals, as the report and the tools write them: a :class:`Cell` holds a value per seed, and a
:data:`Table` is rendered to Markdown (each cell ``mean [low, high]``, bold where a paired test cannot separate a
cell from its row's best, and the note under it that says so) and to CSV (a line per seed)."""

from __future__ import annotations

import csv
import math
from dataclasses import dataclass, field
from typing import Callable, Optional

from ..records.schema import Record
from .comparable import differing, run_column
from .intervals import Estimate, paired_p, seed_interval, separable, window_interval


def format_value(value: float, digits: int = 2) -> str:
    """A measured value for a table: ``digits`` decimals, or three significant digits from a million on (a diverged
    model's perplexity would otherwise print hundreds of digits)."""
    return f"{value:.{digits}f}" if abs(value) < 1e6 else f"{value:.3g}"


@dataclass
class Cell:
    """One table cell: a value per run seed, and for a ratio or perplexity the windows behind each run's value
    (``windows[seed]``: (windows, reference windows or None)), for a one-seed interval and paired test."""

    values: dict
    windows: Optional[dict] = None
    _estimate: list = field(default_factory=list, repr=False, compare=False)  # computed once (a bootstrap is slow)

    def estimate(self) -> Optional[Estimate]:
        """None: the encoding cannot serve the length (some run recorded no value)."""
        if not self._estimate:
            values = list(self.values.values())
            if None in values:
                self._estimate.append(None)
            elif len(values) == 1 and self.windows and all(self.windows.values()):
                [(windows, reference)] = self.windows.values()
                self._estimate.append(window_interval(windows, reference))
            else:
                self._estimate.append(seed_interval(values))
        return self._estimate[0]


Table = tuple[list[str], list[list]]  # columns, rows of [row label, Cell or None per column]


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


def paired(a: Cell, b: Cell) -> Optional[tuple[list, list]]:
    """The paired values two cells can be compared on: their shared seeds' values (two or more), else, with one
    run each, the mean NLLs of the same windows (same count); None when there is nothing to pair."""
    shared = [s for s in a.values if s in b.values]
    if len(shared) >= 2:
        return [a.values[s] for s in shared], [b.values[s] for s in shared]
    if len(a.values) == len(b.values) == 1 and a.windows and b.windows:
        [wa], [wb] = a.windows.values(), b.windows.values()
        if wa and wb and wa[1] is None and wb[1] is None and len(wa[0][0]) == len(wb[0][0]) >= 2:
            return list(wa[0][0]), list(wb[0][0])
    return None


def best_columns(cells: list[Optional[Cell]], higher: bool = False, unpaired: bool = False) -> set[int]:
    """The best mean's column and every column a paired t-test does not separate from it; ``unpaired``: also every
    column with nothing to pair with the best (no test can separate it)."""
    estimates = {i: c.estimate() for i, c in enumerate(cells) if c is not None}
    finite = {i: e.mean for i, e in estimates.items() if e is not None and math.isfinite(e.mean)}
    if not finite:
        return set()
    best = (max if higher else min)(finite, key=finite.get)
    marked = {best}
    for i in finite:
        if i == best:
            continue
        pairs = paired(cells[best], cells[i])
        if (unpaired if pairs is None else not separable(*pairs)):
            marked.add(i)
    return marked


def format_cell(estimate: Optional[Estimate], digits: int) -> str:
    """``mean [low, high]`` (the mean alone without an interval); "-" for no estimate (a length not served)."""
    if estimate is None:
        return "-"
    if estimate.low is None:
        return format_value(estimate.mean, digits)
    return (f"{format_value(estimate.mean, digits)} [{format_value(estimate.low, digits)}, "
            f"{format_value(estimate.high, digits)}]")


def markdown_row(cells: list) -> str:
    """One line of a Markdown table, every cell as it is given (a table written row by row, as gpu-check's)."""
    return "| " + " | ".join(map(str, cells)) + " |"


def markdown_table(header: list, rows: list[list]) -> str:
    """A Markdown table: the header, its ``|---|`` rule and a line per row (no rows: the header and rule alone)."""
    return "\n".join([markdown_row(header), "|---" * len(header) + "|"] + [markdown_row(row) for row in rows])


def markdown(columns, table, best=min, digits: int = 2, header: str = "length") -> str:
    """A :data:`Table` in Markdown: each cell ``mean [low, high]``, the best in its row and every cell a paired test
    does not separate from it in bold (:func:`best_columns`; ``best``: min or max)."""
    lines = []
    for label, *cells in table:
        marked = best_columns(cells, higher=best is max)
        text = [format_cell(c.estimate() if c is not None else None, digits) for c in cells]
        text = [f"**{t}**" if i in marked else t for i, t in enumerate(text)]
        lines.append([row_label(label), *text])
    return markdown_table([header, *columns], lines)


def row_label(label) -> str:
    """A row's label as the tables print it: a (name, low, high) label reads ``name: low-high``."""
    return f"{label[0]}: {label[1]}-{label[2]}" if isinstance(label, tuple) else str(label)


def neighbours(columns, table, best=min, digits: int = 2) -> str:
    """Each row's encodings from best to worst mean, with the paired t-test's p-value between each and the one before
    it (:func:`paired`), so that every step of a ranking, not only its distance from the best, says whether it exceeds
    the noise; "no pair" where nothing pairs (no shared seeds, or one run each without the same windows)."""
    lines = []
    for label, *cells in table:
        cell = dict(zip(columns, cells))
        means = {c: e.mean for c in columns if cell[c] is not None and (e := cell[c].estimate()) is not None
                 and math.isfinite(e.mean)}
        if len(means) < 2:
            continue
        order = sorted(means, key=means.get, reverse=best is max)
        parts = [f"{order[0]} {format_value(means[order[0]], digits)}"]
        for before, column in zip(order, order[1:]):
            pairs = paired(cell[before], cell[column])
            test = "no pair" if pairs is None else f"p = {paired_p(*pairs):.3g}"
            parts.append(f"{column} {format_value(means[column], digits)} ({test})")
        lines.append(f"- {row_label(label)}: " + f" {'>' if best is max else '<'} ".join(parts))
    if not lines:
        return ""
    return "_Ranked by mean; p: paired t-test against the encoding before it._\n\n" + "\n".join(lines)


def describe(table: Table, best: str) -> str:
    """The note under a table: what its intervals mean, with n, and how bold is decided."""
    estimates = [c.estimate() for _, *cells in table[1] for c in cells if c is not None]
    seeds = sorted({e.n for e in estimates if e is not None and e.how == "t"})
    windows = sorted({e.n for e in estimates if e is not None and e.how == "bootstrap"})
    parts = []
    if seeds:
        parts.append(f"mean over n={'/'.join(map(str, seeds))} seeds [95% Student-t interval]")
    if windows:
        parts.append(f"one seed [95% percentile bootstrap over its n={'/'.join(map(str, windows))} evaluated "
                     "windows]")
    if not parts:
        parts.append("one run per cell, no interval")
    return (f"_{'; '.join(parts)}. Bold: the {best} mean and every encoding a paired t-test (p >= 0.05; across shared "
            "seeds, or one seed's same windows) does not separate from it._")


def write_csv(path: str, table: Table, name: str, header: str = "length") -> None:
    """One line per (row, encoding, seed): every seed's value, with the cell's mean and interval."""
    columns, rows = table
    with open(path, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow([header, "encoding", "seed", name, "mean", "low", "high", "n", "interval"])
        for label, *cells in rows:
            for column, cell in zip(columns, cells):
                if cell is None:
                    continue
                e = cell.estimate()
                summary = ["", "", "", len(cell.values), ""] if e is None else \
                    [e.mean, "" if e.low is None else e.low, "" if e.high is None else e.high, e.n, e.how]
                label = "-".join(map(str, label)) if isinstance(label, tuple) else label
                for seed, value in cell.values.items():
                    writer.writerow([label, column, "" if seed is None else seed, "" if value is None else value,
                                     *summary])


def write_markdown(path: str, text: str) -> None:
    with open(path, "w", encoding="utf-8") as f:
        f.write(text + "\n")


def write_table(prefix: str, text: str, table: Optional[Table] = None, name: str = "", header: str = "length") -> str:
    """``<prefix>.md`` holding ``text`` and, given the ``table`` behind it, ``<prefix>.csv`` (:func:`write_csv`, the
    value column named ``name``); returns ``text``."""
    write_markdown(f"{prefix}.md", text)
    if table is not None:
        write_csv(f"{prefix}.csv", table, name, header)
    return text


def annotated(table: Table, best=min, digits: int = 2) -> str:
    """A table in Markdown with its notes: what the intervals and bold mean, and each row's ranking with the paired
    test between neighbours."""
    parts = [markdown(*table, best=best, digits=digits), describe(table, "highest" if best is max else "lowest"),
             neighbours(*table, best=best, digits=digits)]
    return "\n\n".join(part for part in parts if part)
