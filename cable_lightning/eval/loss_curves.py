"""The loss curves in the report (``<out>_loss_curves.png``): each encoding's pre-training loss from the TensorBoard
events beside its length records, and a fine-tuned export's contrastive loss (``finetune_loss.jsonl``)."""

from __future__ import annotations

import json
import os
import sys

from ..records.io import find_records, read_records
from ..records.schema import LengthRecord, LossPoint, Record, RetrievalRecord
from .comparable import differing, run_column

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
