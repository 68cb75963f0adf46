"""Collect runs into the CABLE paper's Table-1 layout and Figure-1 plot.

Reads ``length_eval.jsonl`` files (written by LengthEvalRecorder), keeps each run's latest
evaluation, and writes per window mode: a markdown table (rows: evaluation length, columns: PE,
best per row in bold, unsupported as a dash), the same as CSV, and a perplexity-vs-length PNG.
Where runs also have ``passkey.jsonl`` (PasskeyRetrieval), a passkey table beside it: the same layout,
each cell the accuracy averaged over depths, best (highest) in bold.

    python tools/report.py runs/pydocs --out runs/pydocs/report
"""

from __future__ import annotations

import argparse
import csv
import glob
import os

from cable_lightning.callbacks.length_eval import ppl_figure
from cable_lightning.errors import ConfigError, MissingFileError, error_boundary
from cable_lightning.records import LengthRecord, PasskeyRecord, Record, read_records


def find_records(paths: list[str], name: str = LengthRecord.FILE, required: bool = True) -> list[str]:
    files = []
    for path in paths:
        if os.path.isdir(path):
            files += glob.glob(os.path.join(path, "**", name), recursive=True)
        elif os.path.basename(path) == name or name == LengthRecord.FILE:
            files += glob.glob(path)
    if not files and required:
        raise MissingFileError(f"no {name} under {', '.join(paths)}; train or validate a run first")
    return sorted(files, key=os.path.getmtime)  # the order they were written: later evaluations win


def latest_rows(files: list[str], kind: type[Record] = LengthRecord,
                cell=lambda row: (row.length, row.mode)) -> list[Record]:
    """Each run's rows from its latest evaluation step; at equal steps the later line wins, so a
    re-validation replaces the end-of-fit numbers. A run is one (pe, training length); ``cell`` names a row
    within an evaluation. Rows are read by :func:`read_records` (a bad row names its file and line)."""
    runs: dict[tuple, dict] = {}
    for file in files:
        for row in read_records(file, kind):
            run = runs.setdefault((row.pe, row.train_length), {"step": -1, "rows": {}})
            if row.step > run["step"]:
                run["step"], run["rows"] = row.step, {}
            if row.step == run["step"]:
                run["rows"][cell(row)] = row
    return [row for run in runs.values() for row in run["rows"].values()]


def column_name(pe: str, train_length: int, several_lengths: bool) -> str:
    return f"{pe}@{train_length}" if several_lengths else pe


def build_table(rows: list[LengthRecord], mode: str) -> tuple[list[str], list[list]]:
    rows = [r for r in rows if r.mode == mode]
    several = len({r.train_length for r in rows}) > 1
    columns = sorted({column_name(r.pe, r.train_length, several) for r in rows})
    lengths = sorted({r.length for r in rows})
    cell = {(r.length, column_name(r.pe, r.train_length, several)): r.ppl for r in rows}
    return columns, [[length] + [cell.get((length, c)) for c in columns] for length in lengths]


def passkey_table(rows: list[PasskeyRecord]) -> tuple[list[str], list[list]]:
    """Rows: prompt length, columns: PE; each cell the accuracy averaged over depths (None where unsupported)."""
    several = len({r.train_length for r in rows}) > 1
    cells: dict[tuple, list] = {}
    for r in rows:
        cells.setdefault((r.length, column_name(r.pe, r.train_length, several)), []).append(r.accuracy)
    columns = sorted({c for _, c in cells})
    mean = {k: None if None in v else sum(v) / len(v) for k, v in cells.items()}
    return columns, [[length] + [mean.get((length, c)) for c in columns] for length in sorted({n for n, _ in cells})]


def markdown(columns, table, best=min) -> str:
    lines = ["| length | " + " | ".join(columns) + " |", "|---" * (len(columns) + 1) + "|"]
    for length, *values in table:
        present = [v for v in values if v is not None]
        best_value = best(present) if present else None
        cells = ["-" if v is None else (f"**{v:.2f}**" if v == best_value else f"{v:.2f}") for v in values]
        lines.append(f"| {length} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(columns, table, title: str, path: str):
    import matplotlib.pyplot as plt

    series = {name: [(row[0], row[i + 1]) for row in table if row[i + 1] is not None] for i, name in enumerate(columns)}
    fig = ppl_figure(series, title)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def report(paths: list[str], out: str) -> dict[str, str]:
    """Writes <out>_<mode>.md/.csv/.png for each window mode present, and <out>_passkey.md/.csv where runs have
    passkey rows; returns {mode or "passkey": markdown}."""
    files = find_records(paths)
    rows = latest_rows(files)
    if not rows:
        raise ConfigError(f"{', '.join(files)} hold no evaluation rows; validate a run first")
    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
    tables = {}
    for mode in sorted({r.mode for r in rows}):
        columns, table = build_table(rows, mode)
        tables[mode] = markdown(columns, table)
        with open(f"{out}_{mode}.md", "w") as f:
            f.write(tables[mode] + "\n")
        with open(f"{out}_{mode}.csv", "w", newline="") as f:
            writer = csv.writer(f)
            writer.writerow(["length"] + columns)
            writer.writerows([[length] + ["" if v is None else f"{v:.4f}" for v in values]
                              for length, *values in table])
        plot(columns, table, f"perplexity vs evaluation length ({mode})", f"{out}_{mode}.png")
    passkey_files = find_records(paths, PasskeyRecord.FILE, required=False)
    if passkey_files:
        latest = latest_rows(passkey_files, PasskeyRecord, cell=lambda row: (row.length, row.depth))
        columns, table = passkey_table(latest)
        tables["passkey"] = markdown(columns, table, best=max)
        with open(f"{out}_passkey.md", "w") as f:
            f.write(tables["passkey"] + "\n")
        with open(f"{out}_passkey.csv", "w", newline="") as f:
            writer = csv.writer(f)
            writer.writerow(["length"] + columns)
            writer.writerows([[length] + ["" if v is None else f"{v:.4f}" for v in values]
                              for length, *values in table])
    return tables


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", nargs="+", help="run directories or length_eval.jsonl files/globs")
    parser.add_argument("--out", default="runs/report", help="output prefix")
    args = parser.parse_args(argv)
    for mode, table in report(args.runs, args.out).items():
        print(f"## {'passkey accuracy (mean over depths)' if mode == 'passkey' else mode}\n{table}\n")
    print(f"written: {args.out}_<mode>.md/.csv/.png")


if __name__ == "__main__":
    with error_boundary():
        main()
