"""What a record is: one dataclass per kind, with its file name (``FILE``) and the ranges its measured values must
lie in (``RANGES``, checked on reading), and :class:`RunKey`, what makes a run as its records name it.

Every record carries its run's context (the encoding's label, the training length, the stage that wrote it) and
the step and checkpoint it measured, so a file can be read on its own. ``run_seed`` is the run's ``seed_everything``
(None in rows an earlier version wrote): runs of one encoding with different seeds are different runs, which
the report (``python -m cable_lightning report``) aggregates into a mean and an interval.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any, ClassVar, NamedTuple, Optional


class RunKey(NamedTuple):
    """What makes a run, as its records name it (:meth:`Record.run_key`): the encoding's label (with its training
    layout and extension), training length, seed, peak learning rate, backbone, the corpus it measured and the recipe
    it was trained by (sorted JSON), and for an algorithmic task, the task. Two runs that differ in any of these never
    share a key, so a report keeps both (and refuses to put runs of different corpora or recipes in one table:
    :func:`eval.comparable.incomparable`)."""

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
    # The set's content (:func:`records.io.content_hash` of its corpus, queries and qrels; None: MLDR, and rows an
    # earlier version wrote), and the contrastive fine-tuning the evaluated encoder had (``retrieval finetune``'s
    # settings: max_steps, batch_size, lr, warmup_ratio, seed, max_seq_length, mini_batch_size, and the triples'
    # content hash or "msmarco"; None: an encoder not fine-tuned here, and rows an earlier version wrote)
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
