"""The records a run writes beside its TensorBoard events, one JSON object a line: each kind is a dataclass with
its file name, written by :func:`append_records` and read back by :func:`read_records` (the report's input). Every
JSON-lines file the package and its tools read (records, BEIR-style ``corpus.jsonl``/``queries.jsonl``) goes through
:func:`read_jsonl`: a bad row is an error naming the file and line, and a truncated last line (a writer killed
mid-row) is skipped with a word; the report leaves out the evaluation such a line ends (:func:`complete_records`).

Every record carries its run's context (the encoding's label, the training length, the stage that wrote it) and
the step and checkpoint it measured, so a file can be read on its own. ``run_seed`` is the run's ``seed_everything``
(None in rows an earlier version wrote): runs of one encoding with different seeds are different runs, which
the report (``python -m cable_lightning report``) aggregates into a mean and an interval.
"""

from __future__ import annotations

import dataclasses
import glob
import hashlib
import json
import os
import re
import sys
from dataclasses import dataclass
from typing import Any, Callable, ClassVar, Iterable, NamedTuple, Optional

from .errors import ConfigError, MissingFileError, RunFailedError, space_left


class RunKey(NamedTuple):
    """What makes a run, as its records name it (:meth:`Record.run_key`): the encoding's label (with its training
    layout and extension), training length, seed, peak learning rate, backbone, the corpus it measured and the recipe
    it was trained by (sorted JSON), and for an algorithmic task, the task. Two runs that differ in any of these never
    share a key, so a report keeps both (and refuses to put runs of different corpora or recipes in one table:
    :func:`incomparable`)."""

    name: str
    train_length: int
    seed: Optional[int]
    lr: Optional[float]
    model: Optional[str]
    corpus: Optional[str]
    recipe: Optional[str]
    task: Optional[str] = None
    settings: Optional[str] = None  # the weight-defining settings besides the shape (sorted JSON; Record.settings)
    finetune: Optional[str] = None  # a retrieval row's fine-tuning settings (sorted JSON; RetrievalRecord.finetune)

    def describe(self) -> str:
        """The run as a line of text names it."""
        task = f", {self.task}" if self.task else ""
        return f"{self.name} (training length {self.train_length}{task}, seed {self.seed})"


@dataclass(frozen=True, kw_only=True)
class RunContext:
    """What every record of one evaluation names, typed, made once per evaluation
    (``LanguageModel.record_context``) so that every record of it names the run alike: the run (its encoding's label,
    training length and extension, layout, seed, peak learning rate, backbone, the corpus it measured and the recipe
    it was trained by: what its :class:`RunKey` is made of), the step and stage measured, the checkpoint and the
    machine. A record is made from it as from a mapping (``LengthRecord(**context, length=...)``)."""

    pe: str
    train_length: int
    step: int
    stage: str
    checkpoint: Optional[str]
    run_seed: Optional[int]
    layout: Optional[str]
    extended_to: Optional[int]
    lr: Optional[float]
    model: Optional[str]
    corpus_hash: Optional[str]
    recipe: Optional[dict]
    machine: Optional[str]
    settings: Optional[dict] = None

    def keys(self) -> list[str]:
        return [f.name for f in dataclasses.fields(self)]

    def __getitem__(self, name: str) -> Any:
        return getattr(self, name)


@dataclass(kw_only=True)
class Record:
    """What every record says about where it comes from."""

    FILE: ClassVar[str]
    # What a measured value can be (low, high; None: unbounded), checked on reading (:meth:`out_of_range`)
    RANGES: ClassVar[dict[str, tuple]] = {"train_length": (1, None), "step": (0, None), "lr": (0, None)}

    pe: str  # the encoding's label: cable, dape_v2+cable, rope+linear4
    train_length: int
    step: int
    stage: str = "fit"  # or validate, test
    checkpoint: Optional[str] = None  # the checkpoint a validate/test measured (None: the weights of the running fit)
    run_seed: Optional[int] = None  # the run's seed_everything (TaskRecord.seed is the evaluation examples' own seed)
    # What training saw of its blocks (data.layout's label: docs-train, randomized1024, linear32-128@400, ...); None:
    # packed blocks at contiguous positions, the whole block from the first step
    layout: Optional[str] = None
    # A context extension: the length this run trained at after train_length (None: trained at train_length only)
    extended_to: Optional[int] = None
    lr: Optional[float] = None  # the run's peak learning rate (None in rows an earlier version wrote)
    model: Optional[str] = None  # the backbone's BackboneConfig.shape() (None in rows an earlier version wrote)
    # What lets runs of several machines join one table (None in rows an earlier version wrote): the measured data's
    # content hash (its manifest's ``corpus_hash``; None for a corpus without one), the settings that define the
    # training besides those the run's key holds (:meth:`LanguageModel.recipe`), and the device it ran on
    corpus_hash: Optional[str] = None
    recipe: Optional[dict] = None
    machine: Optional[str] = None
    # Every setting that defines the weights or their training besides the encoding's name and the recipe: the
    # backbone's and the encoding's own (``pos_encoding.base``, ``pos_encoding.bias_activation``, ``mlp_ratio``) and
    # dropout (None in rows an earlier version wrote): two runs that differ here are two runs, two columns
    settings: Optional[dict] = None

    def run_name(self) -> str:
        """The encoding's label, with what training saw when it was not packed contiguous blocks (``[docs-train]``)
        and a context extension's lineage (``>512``: trained at train_length, extended to 512): a report column."""
        layout = f" [{self.layout}]" if self.layout else ""
        extended = f" >{self.extended_to}" if self.extended_to else ""
        return f"{self.pe}{layout}{extended}"

    def run_key(self) -> RunKey:
        """What makes a run (:class:`RunKey`)."""
        recipe = None if self.recipe is None else json.dumps(self.recipe, sort_keys=True)
        settings = None if self.settings is None else json.dumps(self.settings, sort_keys=True)
        return RunKey(self.run_name(), self.train_length, self.run_seed, self.lr, self.model, self.corpus_hash, recipe,
                      settings=settings)

    def out_of_range(self) -> Optional[str]:
        """What is wrong with a row read back (a number outside what it measures), or None."""
        for name, (low, high) in self.RANGES.items():
            value = getattr(self, name)
            if value is None:
                continue
            number = not isinstance(value, bool) and isinstance(value, (int, float))
            if not number or not (low is None or value >= low) or not (high is None or value <= high):
                return f"{name} {value!r} is not a number in [{low}, {'inf' if high is None else high}]"
        return None


@dataclass(kw_only=True)
class LengthRecord(Record):
    """Perplexity at one evaluation length and window mode."""

    FILE: ClassVar[str] = "length_eval.jsonl"
    RANGES: ClassVar[dict[str, tuple]] = Record.RANGES | {"length": (1, None), "ppl": (1, None), "stride": (0, None),
                                                          "loss": (0, None), "tokens": (0, None)}

    length: int
    mode: str  # nonoverlap or sliding
    ppl: Optional[float]  # None: the encoding cannot serve this length
    stride: int = 0
    loss: Optional[float] = None
    tokens: int = 0
    seconds: float = 0.0
    tokens_per_sec: Optional[float] = None
    # Per evaluated window: its mean NLL (4 decimals) and scored tokens, in stream order (each window scores the
    # targets after the previous one's, also under DDP); the report's one-seed bootstrap interval resamples them.
    window_nll: Optional[list[float]] = None
    window_tokens: Optional[list[int]] = None


@dataclass(kw_only=True)
class PositionRecord(Record):
    """Mean loss over one bucket of token positions of the non-overlapping windows of one length."""

    FILE: ClassVar[str] = "position_loss.jsonl"
    RANGES: ClassVar[dict[str, tuple]] = Record.RANGES | {"length": (1, None), "first_position": (0, None),
                                                          "last_position": (0, None), "loss": (0, None)}

    length: int
    first_position: int
    last_position: int
    loss: Optional[float]  # None: no token was scored in the bucket
    mode: str = "nonoverlap"
    stride: int = 0
    tokens: int = 0


@dataclass(kw_only=True)
class TaskRecord(Record):
    """Exact-match accuracy on one synthetic task (``cable_lightning.tasks.generation``) at one length, and one depth of
    the queried fact for tasks that place it (None for the others)."""

    FILE: ClassVar[str] = "task_accuracy.jsonl"
    RANGES: ClassVar[dict[str, tuple]] = Record.RANGES | {"length": (1, None), "depth": (0, 1), "accuracy": (0, 1),
                                                          "trials": (0, None), "correct": (0, None)}

    task: str
    length: int  # tokens the model reads (the example has one more: the last answer token is only a target)
    depth: Optional[float]
    accuracy: Optional[float]  # None: the encoding cannot serve this length
    trials: int = 0
    correct: Optional[int] = None  # examples answered exactly
    seed: int = 0  # the evaluation examples' seed
    scoring: str = "exact_match"  # or per_token: accuracy is the mean share of each example's answer tokens right

    def run_key(self) -> RunKey:
        """An algorithmic task (per-token scoring) trains a model of its own, so the task is part of its run: a report
        over several tasks keeps each task's runs, not only the one evaluated last."""
        key = super().run_key()
        return key._replace(task=self.task) if self.scoring == "per_token" else key


@dataclass(kw_only=True)
class RetrievalRecord(Record):
    """nDCG@10 (and MRR@10, Recall@100) of an exported, fine-tuned encoder on a retrieval set at one maximum input
    length (``retrieval evaluate --records``); ``step`` and ``run_seed`` are those of the pre-training checkpoint
    the export came from, ``visible`` the share of queries whose passage ends within the length (None: the set does
    not record where its passages lie)."""

    FILE: ClassVar[str] = "retrieval.jsonl"
    METRICS: ClassVar[dict[str, str]] = {"ndcg": "nDCG@10", "mrr": "MRR@10", "recall": "Recall@100"}  # field: name
    RANGES: ClassVar[dict[str, tuple]] = Record.RANGES | {"length": (1, None), "ndcg": (0, 1), "queries": (0, None),
                                                          "visible": (0, 1), "mrr": (0, 1), "recall": (0, 1)}

    stage: str = "retrieval"
    dataset: str  # the set's name (its folder's; a display name: dataset_hash says which set it is)
    length: int
    ndcg: float
    queries: int = 0
    visible: Optional[float] = None
    mrr: Optional[float] = None  # None: rows an earlier version wrote, and MLDR (nDCG@10 only)
    recall: Optional[float] = None
    # The set's content (:func:`content_hash` of its corpus, queries and qrels; None: MLDR, and rows an earlier
    # version wrote), and the contrastive fine-tuning the evaluated encoder had (``retrieval finetune``'s settings:
    # max_steps, batch_size, lr, warmup_ratio, seed, max_seq_length, mini_batch_size, and the triples' content hash or
    # "msmarco"; None: an encoder not fine-tuned here, and rows an earlier version wrote)
    dataset_hash: Optional[str] = None
    finetune: Optional[dict] = None

    def run_key(self) -> RunKey:
        """Two fine-tunings of one pre-trained run are two runs: the fine-tuning settings are part of the key."""
        key = super().run_key()
        return key if self.finetune is None else key._replace(finetune=json.dumps(self.finetune, sort_keys=True))

    def evaluation(self) -> tuple:
        """What one row measured: the run and its fine-tuning, the checkpoint and step, the set and the length (a
        row with the same evaluation is one already written: ``retrieval evaluate --records`` writes it once)."""
        return self.run_key(), self.step, self.checkpoint, self.dataset, self.dataset_hash, self.length


@dataclass(kw_only=True)
class AttentionRecord(Record):
    """One attention head's diagnostics at one evaluation length (``eval.diagnostics``, docs/diagnostics.md), over
    the first ``windows`` non-overlapping windows of that length: means over their query rows, ``max_logit`` the
    maximum. ``sink`` and ``local`` are the positions the sink and locality shares count; ``seconds`` is what the
    length's diagnostics took in all (every layer, and the short-context pass)."""

    FILE: ClassVar[str] = "attention.jsonl"
    RANGES: ClassVar[dict[str, tuple]] = Record.RANGES | {
        "length": (1, None), "layer": (0, None), "head": (0, None), "windows": (1, None), "entropy": (0, None),
        "entropy_norm": (0, None), "distance_mean": (0, None), "distance_p90": (0, None), "sink_mass": (0, None),
        "local_mass": (0, None), "mass": (0, None), "sink": (1, None), "local": (1, None), "seconds": (0, None)}

    length: int
    layer: int
    head: int
    windows: int
    entropy: Optional[float]  # None: no row defined it
    entropy_norm: Optional[float]
    distance_mean: Optional[float]
    distance_p90: Optional[float]
    sink_mass: Optional[float]
    local_mass: Optional[float]
    max_logit: Optional[float]
    mass: Optional[float]
    sink: int
    local: int
    seconds: float = 0.0


@dataclass(kw_only=True)
class ContextGain:
    """The long context's gain on targets past the training length (``eval.diagnostics.context_gain``): counts and
    mean losses (nats) of every such target, of the key tokens (loss drops by at least the threshold) and of the hurt
    ones (rises by as much), with the whole window (``loss``) and with at most the training length (``loss_short``)."""

    tokens: int
    loss: Optional[float]
    loss_short: Optional[float]
    key_tokens: int
    key_loss: Optional[float]
    key_loss_short: Optional[float]
    hurt_tokens: int
    hurt_loss: Optional[float]
    hurt_loss_short: Optional[float]


@dataclass(kw_only=True)
class LongContextRecord(ContextGain, Record):
    """What the whole window gains over the training length at one length (:class:`ContextGain`), with how it was
    measured: ``loss_short`` from sliding windows of ``context`` tokens advancing by ``stride``, the key tokens'
    ``threshold`` (LongPPL's key tokens, the model itself the reference)."""

    FILE: ClassVar[str] = "long_context.jsonl"
    RANGES: ClassVar[dict[str, tuple]] = Record.RANGES | {
        "length": (1, None), "context": (1, None), "stride": (1, None), "threshold": (0, None), "windows": (1, None),
        "tokens": (0, None), "key_tokens": (0, None), "hurt_tokens": (0, None), "loss": (0, None),
        "loss_short": (0, None), "key_loss": (0, None), "key_loss_short": (0, None), "hurt_loss": (0, None),
        "hurt_loss_short": (0, None)}

    length: int
    context: int
    stride: int
    threshold: float
    windows: int


@dataclass(kw_only=True)
class IncrementRecord(Record):
    """One head's per-token quantity of a context-aware encoding (``PositionalEncoding.token_increments``: CABLE's
    increment b and weight g, FoX's -log f, ...) over one set of ``tokens`` of the ``inputs`` read at one length
    (``eval.diagnostics``, docs/diagnostics.md#increments): how many tokens, the share whose value is exactly 0, the
    mean and nearest-rank quantiles."""

    FILE: ClassVar[str] = "increments.jsonl"
    RANGES: ClassVar[dict[str, tuple]] = Record.RANGES | {
        "length": (1, None), "layer": (0, None), "head": (0, None), "count": (1, None), "zero_share": (0, 1),
        "examples": (1, None)}

    length: int
    inputs: str  # what was read: "windows" (the diagnostics' windows) or "task:<name>" (its evaluation examples)
    examples: int
    layer: int
    head: int
    quantity: str  # the encoding's own name for it: increment, weight, weight_right, ...
    tokens: str  # all, mask, answer, marker, symbol, filler
    count: int
    zero_share: float
    mean: float
    p10: float
    p50: float
    p90: float


@dataclass(kw_only=True)
class HiddenPairRecord(Record):
    """How far apart the final hidden states of two positions are, ||h_a - h_b|| / max(||h_a||, ||h_b||) per example
    (0: the model cannot tell them apart): a task's first two answer positions, as the model reads them
    (``eval.diagnostics``)."""

    FILE: ClassVar[str] = "hidden_pairs.jsonl"
    RANGES: ClassVar[dict[str, tuple]] = Record.RANGES | {
        "length": (1, None), "examples": (1, None), "difference_mean": (0, None), "difference_min": (0, None),
        "difference_max": (0, None)}

    length: int
    inputs: str
    pair: str  # which two positions: "answer 1, answer 2"
    examples: int
    difference_mean: float
    difference_min: float
    difference_max: float


@dataclass(kw_only=True)
class ThroughputRecord(Record):
    """A fit's training speed (:class:`callbacks.TokenThroughput`, at its end): the steady phase's tokens/s over every
    process and MFU per device (None without a peak to divide by: a CPU), from the first logging step at or after
    ``warmup`` optimizer steps (compiling) to the end of training, validations left out; ``tokens`` is what the run
    has trained by then (the global step x the tokens of an optimizer step), ``step`` that global step."""

    FILE: ClassVar[str] = "throughput.jsonl"
    RANGES: ClassVar[dict[str, tuple]] = Record.RANGES | {
        "tokens": (0, None), "tokens_per_sec": (0, None), "mfu": (0, None), "steady_steps": (0, None),
        "steady_seconds": (0, None), "devices": (1, None), "warmup": (0, None)}

    tokens: int
    tokens_per_sec: Optional[float]  # None: no steady step was timed (training ended in the warm-up)
    mfu: Optional[float]
    steady_steps: int
    steady_seconds: float
    warmup: int
    devices: int = 1
    precision: Optional[str] = None


@dataclass
class LossPoint:
    """One point of a fine-tuning's contrastive loss curve, in a fine-tuned export's ``finetune_loss.jsonl``: the
    export's ``config.json`` (``provenance``) names the run, so the point names none of its own."""

    FILE: ClassVar[str] = "finetune_loss.jsonl"

    step: int
    loss: float

    def out_of_range(self) -> Optional[str]:
        if isinstance(self.step, bool) or not isinstance(self.step, int) or self.step < 0:
            return f"step {self.step!r} is not a number in [0, inf]"
        if isinstance(self.loss, bool) or not isinstance(self.loss, (int, float)):
            return f"loss {self.loss!r} is not a number"
        return None


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


def format_value(value: float, digits: int = 2) -> str:
    """A measured value for a table: ``digits`` decimals, or three significant digits from a million on (a diverged
    model's perplexity would otherwise print hundreds of digits)."""
    return f"{value:.{digits}f}" if abs(value) < 1e6 else f"{value:.3g}"


def content_hash(paths: Iterable[str]) -> str:
    """sha256 over the files' contents, in order (each preceded by its size, so that where one ends counts): what
    names a retrieval set (its corpus, queries and qrels) and the checkpoint an export came from, whatever folder
    they are in."""
    digest = hashlib.sha256()
    for path in paths:
        try:
            with open(path, "rb") as f:
                digest.update(f"{os.fstat(f.fileno()).st_size}\n".encode())
                while chunk := f.read(1 << 20):
                    digest.update(chunk)
        except FileNotFoundError:
            raise MissingFileError(f"{path} does not exist") from None
        except OSError as exc:
            raise ConfigError(f"{path} cannot be read ({type(exc).__name__}: {exc})") from None
    return digest.hexdigest()


def append_records(folder: str, records: list[Record]) -> None:
    """Append records, each kind to its own file in ``folder``; a failed write (a full disk) is an error naming the
    file."""
    for kind in {type(r) for r in records}:
        path = os.path.join(folder, kind.FILE)
        try:
            os.makedirs(folder, exist_ok=True)
            with open(path, "a", encoding="utf-8") as f:
                for record in records:
                    if type(record) is kind:
                        f.write(json.dumps(dataclasses.asdict(record)) + "\n")
        except OSError as exc:
            raise RunFailedError(f"could not write the records {path} ({type(exc).__name__}: {exc}; "
                                 f"{space_left(path)}); the checkpoints written before it are intact") from exc


def write_records(path: str, records: list) -> None:
    """Write ``path`` anew, one record a line (an export's own records, written once into its staging folder)."""
    try:
        with open(path, "w", encoding="utf-8") as f:
            f.writelines(json.dumps(dataclasses.asdict(record)) + "\n" for record in records)
    except OSError as exc:
        raise RunFailedError(f"could not write the records {path} ({type(exc).__name__}: {exc}; "
                             f"{space_left(path)})") from exc


def skip_torn(path: str, number: int, text: str) -> None:
    print(f"{path}:{number}: skipping a truncated last line", file=sys.stderr, flush=True)


def read_jsonl(path: str, required: Iterable[str] = (), make: Callable[[dict], Any] = dict,
               torn: Callable[[str, int, str], None] = skip_torn) -> list:
    """The rows of ``path`` (blank lines skipped), each an object holding the ``required`` keys, made into
    ``make(row)``; a ValueError from ``make`` is an error naming the line. A truncated last line (no newline after
    it: the writer stopped mid-row) is left out and handed to ``torn`` (path, line number, its text)."""
    required = tuple(required)
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.read().split("\n")
    except FileNotFoundError:
        raise MissingFileError(f"{path} does not exist") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{path} cannot be read ({type(exc).__name__}: {exc})") from None
    rows = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            if number == len(lines):  # no newline after it: the writer stopped in the middle of this row
                torn(path, number, line)
                continue
            raise ConfigError(f"{path}:{number}: not a JSON record ({exc.msg}); fix or remove that line") from None
        missing = [key for key in required if not isinstance(row, dict) or key not in row]
        if missing:
            raise ConfigError(f"{path}:{number}: the row lacks {', '.join(missing)} (another record format?); "
                              f"valid rows have {', '.join(required)}")
        try:
            rows.append(make(row))
        except ValueError as exc:
            raise ConfigError(f"{path}:{number}: {exc}; fix or remove that line") from None
    return rows


def read_records(path: str, kind: type, torn: Callable[[str, int, str], None] = skip_torn) -> list:
    """The records of one file (through :func:`read_jsonl`); keys an earlier version wrote and this one does not
    know are ignored, and a row without a field that has no default is an error naming its line."""
    fields = dataclasses.fields(kind)
    required = [f.name for f in fields if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
    known = {f.name for f in fields}

    def make(row: dict) -> Record:
        record = kind(**{k: v for k, v in row.items() if k in known})
        if problem := record.out_of_range():
            raise ValueError(problem)
        return record

    return read_jsonl(path, required, make, torn)


def find_records(paths: list[str], name: str = LengthRecord.FILE, required: bool = True) -> list[str]:
    """Every ``name`` under the folders in ``paths`` (and the files so named; length records: any file a path's
    pattern matches), each once, oldest first; none is an error naming the paths when ``required``."""
    files = []
    for path in paths:
        if os.path.isdir(path):
            files += glob.glob(os.path.join(path, "**", name), recursive=True)
        elif os.path.basename(path) == name or name == LengthRecord.FILE:
            files += glob.glob(path)
    if not files and required:
        raise MissingFileError(f"no {name} under {', '.join(paths)}; train or validate a run first")
    return sorted(set(files), key=os.path.getmtime)  # the order they were written: later evaluations win


def complete_records(path: str, kind: type[Record]) -> list[Record]:
    """The records of ``path`` without an evaluation a writer stopped in the middle of: a file whose last line is
    torn (a run killed as it wrote an evaluation's rows) leaves out the rows of the evaluation that line ends (the
    last rows of one run and step), said in one line with the run's evaluation now taken as its latest. Kept, that
    evaluation was the run's latest with only the lengths written before the kill (an empty table, without a word).
    A torn line whose step shows that it began another evaluation leaves the one before it whole."""
    torn: list[tuple[int, str]] = []
    rows = read_records(path, kind, lambda _, number, text: torn.append((number, text)))
    if not torn:
        return rows
    (number, text), last = torn[0], rows[-1] if rows else None
    began = re.search(r'"step": (\d+)[,}]', text)
    if last is None or began is not None and int(began.group(1)) != last.step:
        print(f"{path}:{number}: skipping a torn last line (a writer stopped mid-row; it began an evaluation of "
              "which nothing else was written)", file=sys.stderr, flush=True)
        return rows
    cut = len(rows)
    while cut and (rows[cut - 1].run_key(), rows[cut - 1].step) == (last.run_key(), last.step):
        cut -= 1
    kept = [row.step for row in rows[:cut] if row.run_key() == last.run_key()]
    print(f"{path}:{number}: a torn last line (a writer stopped mid-row): the evaluation it ends, {last.run_name()} at "
          f"step {last.step}, is incomplete ({len(rows) - cut} whole row{'s' * (len(rows) - cut != 1)}) and left out; "
          + (f"this file's latest complete evaluation of that run is step {max(kept)}" if kept
             else "this file holds no complete evaluation of that run; validate its checkpoint again"),
          file=sys.stderr, flush=True)
    return rows[:cut]


def rows_by_step(files: list[str], kind: type[Record] = LengthRecord,
                 cell=lambda row: (row.length, row.mode)) -> dict[tuple, dict[int, list[Record]]]:
    """{run: {step: rows}}: every evaluation of every run; within one (run, step) the later line of a ``cell`` wins,
    so a re-validation replaces the end-of-fit numbers. Rows are read by :func:`read_records` (a bad row names its
    file and line)."""
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


def latest_rows(files: list[str], kind: type[Record] = LengthRecord,
                cell=lambda row: (row.length, row.mode)) -> list[Record]:
    """Each run's rows from its latest evaluation step (see :func:`rows_by_step`)."""
    return latest_step(rows_by_step(files, kind, cell))
