"""Which rows are one run's evaluations, and which runs one table can compare: each run's evaluations by step (a run
resumed with a longer max_steps stays one run), its latest, and the runs behind their other seeds; why the rows of
some runs cannot share a table (:func:`incomparable`); and each run's column, named by what the table's runs differ
in (:func:`run_column`).
"""

from __future__ import annotations

import json
from typing import Iterable, NamedTuple, Optional

from ..records.io import complete_records
from ..records.schema import LengthRecord, Record, RunKey


def rows_by_step(files: list[str], kind: type[Record] = LengthRecord,
                 cell=lambda row: (row.length, row.mode)) -> dict[tuple, dict[int, list[Record]]]:
    """{run: {step: rows}}: every evaluation of every run; within one (run, step) the later line of a ``cell`` wins,
    so a re-validation replaces the end-of-fit numbers. Rows are read by :func:`records.io.read_records` (a bad row
    names its file and line)."""
    runs: dict[tuple, dict[int, dict]] = {}
    for file in files:
        for row in complete_records(file, kind):
            runs.setdefault(row.run_key(), {}).setdefault(row.step, {})[cell(row)] = row
    return trained_on({run: {step: list(rows.values()) for step, rows in steps.items()} for run, steps in runs.items()})


def trained_on(runs: dict[RunKey, dict[int, list[Record]]]) -> dict[RunKey, dict[int, list[Record]]]:
    """One run, under the key of its latest evaluation, for a run resumed with a longer ``max_steps`` (the ordinary
    way to train on): its keys differ only in the recipe's steps, and each later key's evaluations all come after the
    earlier's. Keys whose evaluations overlap are other runs, and stay apart (the report refuses to mix them)."""
    def without_steps(key: RunKey) -> RunKey:
        if key.recipe is None:
            return key
        return key._replace(recipe=json.dumps({k: v for k, v in json.loads(key.recipe).items() if k != "steps"},
                                              sort_keys=True))

    groups: dict[RunKey, list[RunKey]] = {}
    for key in runs:
        groups.setdefault(without_steps(key), []).append(key)
    merged = {}
    for keys in groups.values():
        ordered = sorted(keys, key=lambda k: min(runs[k]))
        if len(keys) > 1 and all(max(runs[a]) < min(runs[b]) for a, b in zip(ordered, ordered[1:])):
            merged[ordered[-1]] = {step: rows for key in ordered for step, rows in runs[key].items()}
        else:
            merged |= {key: runs[key] for key in keys}
    return merged


def latest_step(runs: dict[tuple, dict[int, list[Record]]]) -> list[Record]:
    """Each run's rows from its latest evaluation step, out of :func:`rows_by_step`'s {run: {step: rows}}."""
    return [row for steps in runs.values() for row in steps[max(steps)]]


def latest_rows(files: list[str], kind: type[Record] = LengthRecord,
                cell=lambda row: (row.length, row.mode)) -> list[Record]:
    """Each run's rows from its latest evaluation step (see :func:`rows_by_step`)."""
    return latest_step(rows_by_step(files, kind, cell))


def behind_their_seeds(runs: dict[RunKey, dict[int, list[Record]]]) -> dict[RunKey, tuple[int, int]]:
    """{run: (its latest step, the furthest of its seeds)} for the runs, out of :func:`rows_by_step`'s
    {run: {step: rows}}, whose latest evaluation is at an earlier step than another seed's of the same run (encoding,
    training length, learning rate, backbone, task): in flight or stopped early, so a mean over seeds mixes steps."""
    def seeds_of(run: RunKey) -> RunKey:  # the run key without its seed
        return run._replace(seed=None)

    latest = {run: max(steps) for run, steps in runs.items()}
    furthest: dict[tuple, int] = {}
    for run, step in latest.items():
        furthest[seeds_of(run)] = max(furthest.get(seeds_of(run), step), step)
    return {run: (step, furthest[seeds_of(run)]) for run, step in latest.items() if step < furthest[seeds_of(run)]}


def run_label(row: Record) -> str:
    """A run as a line of text names it: its encoding's label, training length and seed."""
    return f"{row.run_name()}@{row.train_length}" + ("" if row.run_seed is None else f" seed {row.run_seed}")


def incomparable(rows: Iterable[Record]) -> Optional[str]:
    """Why the rows' runs cannot share one table, or None: they measured different corpora (``corpus_hash``), or runs
    of one training length (and extension) were trained by different recipes; the line names each value with its runs
    and, for recipes, the settings that differ. Rows without a corpus hash (an earlier version's, or a corpus whose
    manifest has none) are compared as before: by their columns only. Last, two runs that differ only in what one of
    them does not record (a corpus hash, a recipe) would share a column and seed: one of them would be dropped, so
    that is refused too (:func:`one_column`)."""
    every = list(rows)
    rows = [r for r in every if r.corpus_hash is not None]

    def runs(group: Iterable[Record]) -> str:
        return ", ".join(sorted({run_label(r) for r in group}))

    corpora: dict[str, list[Record]] = {}
    for r in rows:
        corpora.setdefault(r.corpus_hash, []).append(r)
    if len(corpora) > 1:
        return ("these runs measured different corpora, which one table cannot compare: "
                + "; ".join(f"corpus {corpus[:12]}: {runs(group)}" for corpus, group in sorted(corpora.items()))
                + "; report each corpus's runs apart")
    lengths: dict[tuple, list[Record]] = {}
    for r in rows:
        if r.recipe is not None:
            lengths.setdefault((r.train_length, r.extended_to), []).append(r)
    for (length, extended), group in sorted(lengths.items(), key=str):
        settings = sorted({key for r in group for key in r.recipe})
        differ = []
        for key in settings:
            values: dict[str, list[Record]] = {}
            for r in group:
                values.setdefault(json.dumps(r.recipe.get(key)), []).append(r)
            if len(values) > 1:
                differ.append(f"{key} " + " vs ".join(f"{value} ({runs(by)})" for value, by in sorted(values.items())))
        if differ:
            at = f"training length {length}" + (f" extended to {extended}" if extended else "")
            keys = {r.run_key() for r in group}
            twice = len({key._replace(recipe=None) for key in keys}) < len(keys)  # one run under two recipes
            return (f"these runs ({at}) were trained by different recipes, which one table cannot compare: "
                    + "; ".join(differ) + "; report them apart, or train them alike"
                    + ("; two runs of one name and seed, evaluated at the same steps, were trained by different "
                       "recipes (two folders of one experiment): report each folder apart" if twice else ""))
    return one_column(every)


def one_column(rows: Iterable[Record]) -> Optional[str]:
    """Why the rows' runs cannot share one table because two of them would be one column and seed (their keys differ
    only in the corpus or recipe, which one of them does not record), naming the run and what differs; else None."""
    found: dict[RunKey, set[RunKey]] = {}
    for r in rows:
        key = r.run_key()
        found.setdefault(key._replace(corpus=None, recipe=None, settings=None, finetune=None), set()).add(key)
    for shared, keys in sorted(found.items(), key=str):
        if len(keys) < 2:
            continue
        differ = []
        corpora = sorted({key.corpus for key in keys}, key=str)
        if len(corpora) > 1:
            differ.append("corpus " + " vs ".join(corpus[:12] if corpus else "none recorded" for corpus in corpora))
        recipes = [json.loads(recipe) if recipe else None for recipe in sorted({key.recipe for key in keys}, key=str)]
        if len(recipes) > 1:
            settings = sorted({name for recipe in recipes if recipe for name in recipe})
            named = [f"{name} " + " vs ".join(json.dumps((recipe or {}).get(name)) for recipe in recipes)
                     for name in settings if len({json.dumps((recipe or {}).get(name)) for recipe in recipes}) > 1]
            differ.append("recipe (" + ", ".join(named) + ")" if None not in recipes
                          else "recipe (recorded vs none recorded)")
        for field, name in (("settings", "settings"), ("finetune", "fine-tuning settings")):
            if None in {getattr(key, field) for key in keys} and len({getattr(key, field) for key in keys}) > 1:
                differ.append(f"{name} (recorded vs none recorded)")
        if not differ:
            continue  # both record their settings, and those differ: two columns (run_column names them)
        return (f"{shared.describe()} is {len(keys)} runs that differ in {'; '.join(differ)}: one table would show one "
                "of them as that run; report them apart")
    return None


class Differences(NamedTuple):
    """What a report's runs differ in, so that its columns name it (:func:`run_column`): training length, learning rate,
    backbone, and per encoding the settings (of :attr:`Record.settings`) and the fine-tuning settings (of
    :attr:`RetrievalRecord.finetune`) whose values its runs do not share."""

    length: bool
    lr: bool
    model: bool
    settings: dict[str, tuple[str, ...]]
    finetune: dict[str, tuple[str, ...]] = {}


def differing(rows: Iterable[Record]) -> Differences:
    """What the rows' runs differ in (:class:`Differences`). A row written before runs carried their rate, backbone or
    settings (None) differs from none: it joins the runs that name one. A fine-tuning's seed follows its run's (the
    sweep fine-tunes each seed's run with that seed), so it differs only where one run of one seed was fine-tuned
    with two."""
    rows = list(rows)
    values: dict[str, dict[str, set[str]]] = {}
    tunings: dict[str, dict[str, set[tuple]]] = {}
    for r in rows:
        for name, value in (r.settings or {}).items():
            values.setdefault(r.run_name(), {}).setdefault(name, set()).add(json.dumps(value, sort_keys=True))
        for name, value in (getattr(r, "finetune", None) or {}).items():
            seen = (r.run_seed, json.dumps(value)) if name == "seed" else (None, json.dumps(value))
            tunings.setdefault(r.run_name(), {}).setdefault(name, set()).add(seen)

    settings = {run: tuple(sorted(n for n, seen in named.items() if len(seen) > 1)) for run, named in values.items()}
    tuned = {run: tuple(sorted(n for n, seen in named.items() if len({key for key, _ in seen}) < len(seen)))
             for run, named in tunings.items()}  # some run (or run seed) under two values
    return Differences(len({r.train_length for r in rows}) > 1, len({r.lr for r in rows if r.lr is not None}) > 1,
                       len({r.model for r in rows if r.model is not None}) > 1,
                       {run: names for run, names in settings.items() if names},
                       {run: names for run, names in tuned.items() if names})


def run_column(row: Record, differ: Differences, with_lr: bool = True) -> str:
    """A run's report column: its encoding's :meth:`Record.run_name`, with what the report's runs differ in
    (:func:`differing`): ``cable@512``, ``cable (decoder L12-D768-H12)``, ``cable lr=0.0003``,
    ``cable bias_activation=softplus``, ``cable finetune.max_steps=400``."""
    name = f"{row.run_name()}@{row.train_length}" if differ.length else row.run_name()
    name += f" ({row.model})" if differ.model and row.model else ""
    for setting in differ.settings.get(row.run_name(), ()):
        if row.settings and setting in row.settings:
            name += f" {setting.removeprefix('pos_encoding.')}={row.settings[setting]}"
    tuned = getattr(row, "finetune", None) or {}
    for setting in differ.finetune.get(row.run_name(), ()):
        if setting in tuned:
            name += f" finetune.{setting}={tuned[setting]}"
    return f"{name} lr={row.lr:g}" if with_lr and differ.lr and row.lr is not None else name
