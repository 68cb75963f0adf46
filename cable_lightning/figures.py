"""Every figure the package draws, from plain numbers: the callbacks' TensorBoard figures of one run and the
report's figures over runs share these, so a run's curve and the report's look alike.

Matplotlib is imported inside each function (with the Agg backend: no display), so importing this module is free.
"""

from __future__ import annotations

import math

from .records.schema import PositionRecord


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig, path: str, dpi: int = 120) -> None:
    """Write ``fig`` to ``path`` and free it (pyplot keeps every open figure)."""
    fig.savefig(path, dpi=dpi)
    _pyplot().close(fig)


def line_figure(series: dict[str, list[tuple[float, float]]], title: str, train_length: int | None, xlabel: str,
                ylabel: str, log_y: bool, bands: dict[str, list[tuple[float, float, float]]] | None = None):
    """One line per series of (x, y) points on a log2 x axis, the training length marked; points that are None
    or not finite are skipped (inf/NaN cannot be drawn on log axes). ``bands``: per series, (x, low, high) points
    of an interval, shaded in the line's colour."""
    fig, ax = _pyplot().subplots(figsize=(7, 4.5))
    draw_lines(ax, series, title, train_length, xlabel, ylabel, log_y, bands)
    fig.tight_layout()
    return fig


def draw_lines(ax, series: dict[str, list[tuple[float, float]]], title: str, train_length: int | None, xlabel: str,
               ylabel: str, log_y: bool, bands: dict[str, list[tuple[float, float, float]]] | None = None,
               colours: dict[str, str] | None = None) -> None:
    """:func:`line_figure`'s lines on the axes ``ax`` (``colours``: a series' colour, so that panels agree)."""
    for name, points in series.items():
        points = [(x, y) for x, y in points if y is not None and math.isfinite(y)]
        if points:
            line, = ax.plot(*zip(*sorted(points)), marker="o", label=name, color=(colours or {}).get(name))
            band = sorted(b for b in (bands or {}).get(name, []) if all(map(math.isfinite, b)))
            if band:
                ax.fill_between(*zip(*band), color=line.get_color(), alpha=0.2, linewidth=0)
    if train_length:
        ax.axvline(train_length, color="grey", linestyle="--", label=f"trained at {train_length}")
    ax.set_xscale("log", base=2)
    if log_y:
        ax.set_yscale("log")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend(fontsize="small")


def zoomed_line_figure(series: dict[str, list[tuple[float, float]]], zoomed: list[str], titles: tuple[str, str],
                       xlabel: str, ylabel: str, bands: dict[str, list[tuple[float, float, float]]] | None = None):
    """Two panels of :func:`draw_lines`: every series on a log y axis, then the ``zoomed`` ones alone on a linear
    axis (where the others' scale would flatten their differences), each series one colour in both."""
    fig, (every, near) = _pyplot().subplots(1, 2, figsize=(12, 4.5))
    cycle = _pyplot().rcParams["axes.prop_cycle"].by_key()["color"]
    colours = {name: cycle[i % len(cycle)] for i, name in enumerate(series)}
    draw_lines(every, series, titles[0], None, xlabel, ylabel, True, bands, colours)
    draw_lines(near, {name: series[name] for name in zoomed}, titles[1], None, xlabel, ylabel, False, bands, colours)
    fig.tight_layout()
    return fig


def ppl_figure(series: dict[str, list[tuple[int, float]]], title: str, train_length: int | None = None,
               bands: dict[str, list[tuple[int, float, float]]] | None = None):
    """Perplexity against evaluation length (log axes), one line per series of (length, ppl) points, with interval
    ``bands``; shared by the per-run TensorBoard figure (a line per window mode) and the report (a line per PE)."""
    return line_figure(series, title, train_length, "evaluation length (tokens)", "perplexity", log_y=True,
                       bands=bands)


def position_figure(rows: list[PositionRecord], title: str, train_length: int | None = None):
    """Mean NLL against token position (log-spaced buckets, plotted at their last position), one line per
    evaluation length: a line that rises with position means later tokens, with more context, fare worse."""
    series = {f"length {length}": [(r.last_position, r.loss) for r in rows if r.length == length]
              for length in sorted({r.length for r in rows})}
    return line_figure(series, title, train_length, "token position in the window (bucket end)", "mean NLL (nats)",
                       log_y=False)


def accuracy_heatmap(labels: list[str], lengths: list[int], cells: dict, title: str, ylabel: str):
    """Accuracy per (row label, length) cell, ``cells[(label, length)]``; a missing or None cell is blank."""
    import numpy as np

    grid = np.full((len(labels), len(lengths)), np.nan)
    for (label, length), value in cells.items():
        if value is not None:
            grid[labels.index(label), lengths.index(length)] = value
    fig, ax = _pyplot().subplots(figsize=(1.2 * len(lengths) + 3, 0.5 * len(labels) + 2))
    image = ax.imshow(grid, vmin=0, vmax=1, cmap="RdYlGn", aspect="auto")
    for (i, j), value in np.ndenumerate(grid):
        ax.text(j, i, "-" if np.isnan(value) else f"{value:.2f}", ha="center", va="center", fontsize=8)
    ax.set_xticks(range(len(lengths)), [str(n) for n in lengths])
    ax.set_yticks(range(len(labels)), labels)
    ax.set_xlabel("length (tokens)")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    fig.colorbar(image, ax=ax, fraction=0.046)
    fig.tight_layout()
    return fig


def step_panels(panels: dict[str, list[dict]], ylabels: list[str], title: str, path: str) -> None:
    """A column of panels per name (an encoding), one row per ``ylabels`` entry: in each, one line per length of
    (step, mean, low, high) points (``panels[name][row][length]``), with its interval as a band where it has one;
    the first row on a log axis. Written to ``path``."""
    plt = _pyplot()
    fig, axes = plt.subplots(len(ylabels), len(panels), figsize=(4 * len(panels), 6.5), sharex=True, squeeze=False)
    for col, (name, rows) in enumerate(panels.items()):
        for row, (curves, ylabel) in enumerate(zip(rows, ylabels)):
            ax = axes[row][col]
            for length, points in sorted(curves.items()):
                steps, means, lows, highs = zip(*points)
                line, = ax.plot(steps, means, marker="o", label=f"L={length}")
                if all(low is not None for low in lows):
                    ax.fill_between(steps, lows, highs, color=line.get_color(), alpha=0.2)
            if row == 0:
                ax.set_yscale("log")
                ax.set_title(name)
            ax.set_xlabel("training step")
            ax.set_ylabel(ylabel)
            ax.legend(fontsize="x-small")
    fig.suptitle(title)
    fig.tight_layout()
    save_figure(fig, path, dpi=100)
