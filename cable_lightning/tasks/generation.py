"""Synthetic long-context tasks, generated from a seed: what small models can learn at the training length, so that
their accuracy at longer lengths says whether distant tokens are used.

Each task makes an :class:`Example` of exactly the requested number of tokens from a NumPy generator seeded by
(seed, split, index), so example ``index`` is the same on every machine, rank and worker, and a resumed run asks for
the same indices again. The answer tokens are marked; the distance between a fact and its question grows with the
length (more filler in between, the number of facts stays fixed).

Tokens come from a :class:`TaskVocabulary`: four marker ids, ``SYMBOLS`` ids for keys, values and variables, and
filler ids that are never a key or an answer. With a prepared corpus it is carved out of the run's tokenizer (its
non-special ids in order); without one, the tasks have a vocabulary of their own (:data:`OWN_VOCABULARY` ids, id 0
the end-of-text id, the last the mask id a masked LM reads in place of an answer). The tasks
(``--data.tasks '{"needle": {"keys": 4}}'``):

- ``associative_recall`` (multi-query associative recall, Zoology): ``pairs`` key-value pairs at the start, filler,
  then ``queries`` of them asked for, ``QUERY key -> value``.
- ``needle`` (RULER's needle in a haystack; ``keys`` > 1 is the multi-key variant): needles ``NEEDLE key value...``
  in filler, the queried one at a given depth (0: the start, 1: just before the question), ``QUERY key -> value...``.
- ``variable_tracking`` (RULER): ``ASSIGN x1 v``, ``ASSIGN x2 x1``, ... (``hops`` assignments) spread through filler
  in order; ``QUERY v -> x1 ... x_hops``, every variable that holds v.
- ``copy`` (induction): ``COPY span`` at the start, filler, ``COPY -> span``.
- ``passkey`` (Mohtashami & Jaggi 2023): text in the run's tokenizer, a 5-digit key in plain filler sentences at a
  given depth, then ``What is the pass key? The pass key is`` and the answer `` <key>.`` (the full stop is part of the
  answer, so an answer that runs on into a sixth digit is wrong). It needs a prepared corpus's tokenizer.
"""

from __future__ import annotations

import dataclasses
import functools
import typing
from dataclasses import dataclass
from typing import Any, ClassVar, Optional

import numpy as np

from ..errors import ConfigError

SYMBOLS = 64  # ids that can be keys, values or variables; chance of guessing one is 1/64
MARKERS = ("QUERY", "NEEDLE", "ASSIGN", "COPY")
OWN_VOCABULARY = 2 + len(MARKERS) + 2 * SYMBOLS  # end of text, markers, symbols, as many filler ids, mask
OWN_MASK_ID = OWN_VOCABULARY - 1  # last, so that the other ids keep their roles whether a model masks or not
TRAIN, EVAL = 0, 1  # the split in an example's seed: training rows never repeat evaluation examples


@dataclass(frozen=True)
class TaskVocabulary:
    """Which token ids a task may use for what: markers, symbols (keys, values, variables) and filler."""

    markers: dict
    symbols: np.ndarray
    filler: np.ndarray
    tokenizer: Any = None  # the run's tokenizer (``encode_batch``), for tasks written in text; None: ids only

    @classmethod
    def from_ids(cls, vocab_size: int, special_ids=(), tokenizer=None) -> "TaskVocabulary":
        """The first non-special ids become markers, the next ``SYMBOLS`` symbols, the rest filler."""
        usable = np.array([i for i in range(vocab_size) if i not in set(special_ids)], dtype=np.int64)
        if len(usable) < len(MARKERS) + 2 * SYMBOLS:
            raise ConfigError(f"tasks need at least {len(MARKERS) + 2 * SYMBOLS} non-special token ids; the vocabulary "
                              f"has {len(usable)}: use a larger tokenizer, or data.path null for the tasks' own")
        k = len(MARKERS)
        return cls(dict(zip(MARKERS, usable[:k].tolist())), usable[k:k + SYMBOLS], usable[k + SYMBOLS:], tokenizer)

    @classmethod
    def own(cls) -> "TaskVocabulary":
        return cls.from_ids(OWN_VOCABULARY, special_ids=(0, OWN_MASK_ID))


@dataclass(frozen=True)
class Example:
    ids: np.ndarray  # (length,) int64
    answer: np.ndarray  # (length,) bool: the tokens to predict (never the first)
    depth: Optional[float] = None  # where the queried fact sits in the filler, for tasks that place it
    scored: Optional[np.ndarray] = None  # (length,) bool: the answer tokens accuracy counts (None: every one)


def example_rng(seed: int, split: int, index: int) -> np.random.Generator:
    return np.random.default_rng([seed, split, index])


@dataclass(frozen=True)
class Task:
    """A task's settings; subclasses register by ``name`` and say how an example is laid out."""

    name: ClassVar[str]
    has_depth: ClassVar[bool] = False  # evaluated per depth of the queried fact
    needs_text: ClassVar[bool] = False  # written in the run's tokenizer's text (not available with the own vocabulary)
    # ``length`` counts input symbols, not tokens read, and accuracy is per answer token (the algorithmic tasks)
    length_is_input: ClassVar[bool] = False
    registry: ClassVar[dict[str, type["Task"]]] = {}

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        if "name" in cls.__dict__:  # a family's base class (no name of its own) is not a task
            Task.registry[cls.name] = cls

    def fixed_tokens(self, vocab: Optional[TaskVocabulary]) -> Optional[int]:
        """Tokens an example needs besides filler (None when that depends on a tokenizer not known yet)."""
        raise NotImplementedError

    def layout(self, rng: np.random.Generator, vocab: TaskVocabulary, filler: int, depth: Optional[float]):
        """(pieces, answer pieces): token pieces in order, and for each whether it is answer; ``filler`` tokens
        are spread as the task says."""
        raise NotImplementedError

    def check_length(self, length: int, vocab: Optional[TaskVocabulary]) -> None:
        """``length``: the tokens a model reads (an example has one more, the last answer token's target)."""
        fixed = self.fixed_tokens(vocab)
        if fixed is not None and length < fixed:
            settings = ", ".join(f"{f.name}={getattr(self, f.name)}" for f in dataclasses.fields(self))
            raise ConfigError(f"task {self.name} ({settings or 'no settings'}) needs a length of at least {fixed} "
                              f"tokens, got {length}; use a longer length or fewer facts")

    def example(self, length: int, rng: np.random.Generator, vocab: TaskVocabulary,
                depth: Optional[float] = None) -> Example:
        """Exactly ``length`` tokens: a leading filler token (the first position is never predicted), then the
        task's pieces with ``length - 1 - fixed_tokens()`` filler tokens placed among them."""
        self.check_length(length - 1, vocab)
        if depth is None and self.has_depth:
            depth = float(rng.random())
        pieces = self.layout(rng, vocab, length - 1 - self.fixed_tokens(vocab), depth)
        ids = np.concatenate([rng.choice(vocab.filler, 1)] + [p for p, _ in pieces])
        answer = np.concatenate([np.zeros(1, bool)] + [np.full(len(p), a) for p, a in pieces])
        assert len(ids) == length
        return Example(ids, answer, depth if self.has_depth else None)


def spread(rng: np.random.Generator, vocab: TaskVocabulary, filler: int, items: list, at: list[int]):
    """Filler of ``filler`` random tokens with ``items`` (lists of pieces) inserted at offsets ``at``."""
    noise = rng.choice(vocab.filler, filler)
    order = np.argsort(at, kind="stable")
    pieces, start = [], 0
    for i in order:
        pieces.append((noise[start:at[i]], False))
        pieces += items[i]
        start = at[i]
    pieces.append((noise[start:], False))
    return pieces


def ids(*values) -> np.ndarray:
    return np.array(values, dtype=np.int64)


@dataclass(frozen=True)
class AssociativeRecall(Task):
    name: ClassVar[str] = "associative_recall"
    pairs: int = 8
    queries: int = 4

    def __post_init__(self):
        if not 1 <= self.queries <= self.pairs <= SYMBOLS:
            raise ConfigError(f"associative_recall needs 1 <= queries <= pairs <= {SYMBOLS}, got pairs={self.pairs}, "
                              f"queries={self.queries}")

    def fixed_tokens(self, vocab) -> int:
        return 2 * self.pairs + 3 * self.queries

    def layout(self, rng, vocab, filler, depth):
        keys = rng.choice(vocab.symbols, self.pairs, replace=False)
        values = rng.choice(vocab.symbols, self.pairs)
        asked = rng.choice(self.pairs, self.queries, replace=False)
        pieces = [(np.stack([keys, values], 1).ravel(), False), (rng.choice(vocab.filler, filler), False)]
        for i in asked:
            pieces += [(ids(vocab.markers["QUERY"], keys[i]), False), (values[i:i + 1], True)]
        return pieces


@dataclass(frozen=True)
class Needle(Task):
    name: ClassVar[str] = "needle"
    has_depth: ClassVar[bool] = True
    keys: int = 1
    value_tokens: int = 2

    def __post_init__(self):
        if not 1 <= self.keys <= SYMBOLS or self.value_tokens < 1:
            raise ConfigError(f"needle needs 1 <= keys <= {SYMBOLS} and value_tokens >= 1, got keys={self.keys}, "
                              f"value_tokens={self.value_tokens}")

    def fixed_tokens(self, vocab) -> int:
        return (self.keys + 1) * (2 + self.value_tokens)

    def layout(self, rng, vocab, filler, depth):
        keys = rng.choice(vocab.symbols, self.keys, replace=False)
        values = rng.choice(vocab.symbols, (self.keys, self.value_tokens))
        needles = [[(ids(vocab.markers["NEEDLE"], k), False), (v, False)] for k, v in zip(keys, values)]
        at = [round(depth * filler)] + rng.integers(0, filler + 1, self.keys - 1).tolist()  # needle 0 is asked
        question = [(ids(vocab.markers["QUERY"], keys[0]), False), (values[0], True)]
        return spread(rng, vocab, filler, needles, at) + question


@dataclass(frozen=True)
class VariableTracking(Task):
    name: ClassVar[str] = "variable_tracking"
    hops: int = 3

    def __post_init__(self):
        if not 1 <= self.hops < SYMBOLS:
            raise ConfigError(f"variable_tracking needs 1 <= hops < {SYMBOLS}, got hops={self.hops}")

    def fixed_tokens(self, vocab) -> int:
        return 3 * self.hops + 2 + self.hops

    def layout(self, rng, vocab, filler, depth):
        value, *names = rng.choice(vocab.symbols, self.hops + 1, replace=False)
        assign = vocab.markers["ASSIGN"]
        chain = [[(ids(assign, name, source), False)] for name, source in zip(names, [value] + names[:-1])]
        at = np.sort(rng.integers(0, filler + 1, self.hops)).tolist()  # in order: each reads an earlier variable
        return spread(rng, vocab, filler, chain, at) + [(ids(vocab.markers["QUERY"], value), False),
                                                         (np.array(names, dtype=np.int64), True)]


@dataclass(frozen=True)
class Copy(Task):
    name: ClassVar[str] = "copy"
    span: int = 8

    def __post_init__(self):
        if self.span < 1:
            raise ConfigError(f"copy needs span >= 1, got span={self.span}")

    def fixed_tokens(self, vocab) -> int:
        return 2 * (1 + self.span)

    def layout(self, rng, vocab, filler, depth):
        span, mark = rng.choice(vocab.symbols, self.span), ids(vocab.markers["COPY"])
        return [(mark, False), (span, False), (rng.choice(vocab.filler, filler), False), (mark, False), (span, True)]


PASSKEY_INTRO = "There is a pass key in this text. Remember it."
PASSKEY_FILLER = (
    " The river runs past the old mill.",
    " A cold wind came down from the hills.",
    " The market opens early on Saturdays.",
    " Two boats were tied up at the pier.",
    " Rain fell on the roofs of the town.",
    " The baker lit the oven before dawn.",
    " A dog slept in the shade of a wall.",
    " The road turned north after the bridge.",
)
PASSKEY_NEEDLE = " The pass key is {key}. Remember {key}."
PASSKEY_QUESTION = " What is the pass key? The pass key is"
PASSKEY_ANSWER = " {key}."
PROBE_KEYS = 64  # keys tokenized to bound a key's length in tokens; a key longer than all of them is drawn again


@dataclass(frozen=True)
class PasskeyText:
    """The passkey's fixed text in one tokenizer's ids, encoded once per tokenizer (what follows the intro continues
    the text, so every piece starts with a space)."""

    tokenizer: Any
    intro: tuple
    question: tuple
    sentences: tuple
    longest_key: int  # the most tokens a needle and answer may take (over the probe keys)

    @classmethod
    def encode(cls, tokenizer) -> "PasskeyText":
        intro, question, *sentences = tokenizer.encode_batch([PASSKEY_INTRO, PASSKEY_QUESTION, *PASSKEY_FILLER])
        if not all(sentences):
            raise ConfigError("the tokenizer turned a passkey filler sentence into no tokens; it cannot make passkeys")
        text = cls(tokenizer, tuple(intro), tuple(question), tuple(map(tuple, sentences)), 0)
        probe = np.random.default_rng(0).integers(10_000, 100_000, PROBE_KEYS)
        longest = max(sum(map(len, text.key_pieces(str(k)))) for k in probe)
        return dataclasses.replace(text, longest_key=longest)

    def key_pieces(self, key: str) -> tuple[list, list]:
        """(needle ids, answer ids) for ``key``."""
        needle, answer = self.tokenizer.encode_batch([PASSKEY_NEEDLE.format(key=key), PASSKEY_ANSWER.format(key=key)])
        return needle, answer


@functools.lru_cache(maxsize=4)
def passkey_text(tokenizer) -> PasskeyText:
    return PasskeyText.encode(tokenizer)


@dataclass(frozen=True)
class Passkey(Task):
    """The passkey in text: the one task a corpus model can be asked without training on it (the fine-tuning recipe,
    configs/passkey_finetune.yaml, trains on it as a share of each batch)."""

    name: ClassVar[str] = "passkey"
    has_depth: ClassVar[bool] = True
    needs_text: ClassVar[bool] = True

    def fixed_tokens(self, vocab) -> Optional[int]:
        """Intro, needle, question and answer, less one: the intro's first token is the example's first token, which
        other tasks spend on filler."""
        if vocab is None or vocab.tokenizer is None:
            return None
        text = passkey_text(vocab.tokenizer)
        return len(text.intro) + text.longest_key + len(text.question) - 1

    def check_length(self, length: int, vocab) -> None:
        if vocab is not None and vocab.tokenizer is None:
            raise ConfigError("task passkey is written in text and needs a prepared corpus's tokenizer (data.path); "
                              "the tasks' own vocabulary has none")
        super().check_length(length, vocab)

    def example(self, length: int, rng: np.random.Generator, vocab: TaskVocabulary,
                depth: Optional[float] = None) -> Example:
        """Exactly ``length`` tokens; the key sits at the sentence boundary of the filler nearest to ``depth``."""
        self.check_length(length - 1, vocab)
        text = passkey_text(vocab.tokenizer)
        depth = float(rng.random()) if depth is None else depth
        while True:  # a key longer in tokens than every probe key would not fit the checked length: draw again
            key = str(rng.integers(10_000, 100_000))
            needle, answer = text.key_pieces(key)
            if len(needle) + len(answer) <= text.longest_key:
                break
        budget = length - len(text.intro) - len(needle) - len(text.question) - len(answer)
        filler, boundaries, unit = [], [0], int(rng.integers(len(text.sentences)))
        while len(filler) < budget:
            filler += text.sentences[unit % len(text.sentences)]
            boundaries.append(min(len(filler), budget))
            unit += 1
        filler = filler[:budget]  # the last sentence is cut to fit
        cut = min(boundaries, key=lambda b: abs(b - depth * budget))
        prompt = list(text.intro) + filler[:cut] + needle + filler[cut:] + list(text.question)
        ids = np.array(prompt + answer, dtype=np.int64)
        return Example(ids, np.arange(len(ids)) >= len(prompt), depth)


def build_task(name: str, settings: Optional[dict] = None) -> Task:
    """A task by name with its settings; an unknown name or setting is one line naming what is valid."""
    if name not in Task.registry:
        raise ConfigError(f"unknown task {name!r}; valid tasks: {', '.join(sorted(Task.registry))}")
    cls = Task.registry[name]
    valid = [f.name for f in dataclasses.fields(cls)]
    if settings is not None and not isinstance(settings, dict):
        raise ConfigError(f"task {name}: settings must be a mapping ({{setting: value}}), got {settings!r}; its "
                          f"settings: {', '.join(valid) or 'none'}")
    unknown = sorted(set(settings or {}) - set(valid))
    if unknown:
        raise ConfigError(f"task {name} has no setting {unknown[0]!r} (its settings: {', '.join(valid) or 'none'})")
    types = typing.get_type_hints(cls)
    for setting, value in (settings or {}).items():  # every setting is a number: a string would fail in a comparison
        number = int if types[setting] is int else (int, float)
        if types[setting] in (int, float) and (isinstance(value, bool) or not isinstance(value, number)):
            raise ConfigError(f"task {name} setting {setting} must be {'an integer' if number is int else 'a number'}"
                              f", got {value!r}")
    return cls(**(settings or {}))


class TaskMix:
    """The tasks of a run, taken in turn: example ``index`` is task ``index % len(tasks)`` (deterministic per
    (seed, split, index), so every rank, worker and resumed run agrees on it). ``vocab`` may be set later (a prepared
    corpus's tokenizer is known only once it is read); the tasks and their settings are checked at once."""

    def __init__(self, tasks: dict[str, Optional[dict]], vocab: Optional[TaskVocabulary] = None):
        if not tasks:
            raise ConfigError("data.tasks is empty; name at least one task: " + ", ".join(sorted(Task.registry)))
        self.tasks = [build_task(name, settings) for name, settings in tasks.items()]
        self.vocab = vocab
        self.algorithmic = any(task.length_is_input for task in self.tasks)
        if self.algorithmic and len(self.tasks) > 1:  # a batch has one input length, and tasks' outputs differ
            raise ConfigError(f"an algorithmic task trains alone; data.tasks names {', '.join(tasks)}: give one")

    def settings(self) -> dict[str, dict]:
        """{name: every setting, defaults included}: two spellings of one task compare equal."""
        return {task.name: dataclasses.asdict(task) for task in self.tasks}

    def check_length(self, length: int) -> None:
        """Every task fits ``length`` (a text task is checked once the tokenizer is known)."""
        for task in self.tasks:
            task.check_length(length, self.vocab)

    def example(self, length: int, seed: int, split: int, index: int, task: Optional[Task] = None,
                depth: Optional[float] = None) -> Example:
        task = task or self.tasks[index % len(self.tasks)]
        return task.example(length, example_rng(seed, split, index), self.vocab, depth)

    def training_rows(self, length: int, seed: int, batch_number: int, rank: int, world_size: int,
                      rows: int) -> tuple[np.ndarray, np.ndarray]:
        """(ids, answer mask), each (rows, length): the task rows of one rank's training batch. Row r of batch b on
        rank k is example ((b * world_size + k) * rows + r), so ranks never share one and a run resumed at batch b
        makes the rows the uninterrupted run made."""
        first = (batch_number * world_size + rank) * rows
        examples = [self.example(length, seed, TRAIN, first + r) for r in range(rows)]
        return np.stack([e.ids for e in examples]), np.stack([e.answer for e in examples])

    @staticmethod
    def training_length(seed: int, batch_number: int, longest: int) -> int:
        """An algorithmic task's input length for one training batch, uniform in [1, ``longest``] (the papers': one
        length per batch), the same on every rank and after a resume."""
        return int(np.random.default_rng([seed, TRAIN, batch_number, longest]).integers(1, longest + 1))
