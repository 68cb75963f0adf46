"""Passkey retrieval: a 5-digit key hidden at a chosen depth of filler text, asked for at the end.

A prompt is ``intro + filler[:d] + needle + filler[d:] + question``, assembled from token ids of pieces that
are tokenized once, so every prompt has exactly the requested number of tokens whatever the tokenizer; the filler
is a fixed set of plain sentences cycled and cut to fit, and the needle sits at the sentence boundary nearest to
the requested depth (so within one filler sentence of it). The model answers by greedy decoding with the KV
cache; an answer is right when the first number in it is exactly the key.
"""

from __future__ import annotations

import random
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from ..errors import ConfigError
from ..positional import UnsupportedLengthError

INTRO = "There is a pass key in this text. Remember it."
FILLER = (
    "The river runs past the old mill.",
    "A cold wind came down from the hills.",
    "The market opens early on Saturdays.",
    "Two boats were tied up at the pier.",
    "Rain fell on the roofs of the town.",
    "The baker lit the oven before dawn.",
    "A dog slept in the shade of a wall.",
    "The road turned north after the bridge.",
)
NEEDLE = "The pass key is {key}. Remember {key}."
QUESTION = "What is the pass key? The pass key is"
ANSWER = " {key}"
DEFAULT_DEPTHS = (0.0, 0.25, 0.5, 0.75, 1.0)


@dataclass(frozen=True)
class PasskeyPrompt:
    ids: list[int]
    key: str
    answer_ids: list[int]  # the tokens that answer the question: " <key>"
    needle_start: int  # index in ``ids`` of the needle's first token
    needle_length: int
    depth: float


def random_key(rng: random.Random) -> str:
    return str(rng.randint(10_000, 99_999))


class PasskeyPrompts:
    """Builds passkey prompts for one tokenizer (anything with ``encode_batch`` and ``decode``)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        # What follows the intro continues the text, so it starts with a space (one word per token boundary).
        self.intro, self.question, *self.units = tokenizer.encode_batch(
            [INTRO, " " + QUESTION] + [" " + s for s in FILLER]
        )
        if not all(self.units):
            raise ConfigError("the tokenizer turned a filler sentence into no tokens; it cannot make passkey prompts")

    def needle_ids(self, key: str) -> list[int]:
        return self.tokenizer.encode_batch([" " + NEEDLE.format(key=key)])[0]

    def answer_ids(self, key: str) -> list[int]:
        return self.tokenizer.encode_batch([ANSWER.format(key=key)])[0]

    def fixed_tokens(self, key: str) -> int:
        """Tokens a prompt for ``key`` needs besides filler."""
        return len(self.intro) + len(self.needle_ids(key)) + len(self.question)

    def build(self, length: int, depth: float, key: str, first_unit: int = 0) -> PasskeyPrompt:
        """A prompt of exactly ``length`` tokens with the needle at ``depth`` (0: right after the intro, 1: right
        before the question) of the filler; ``first_unit`` picks the filler sentence it starts with."""
        if not 0.0 <= depth <= 1.0:
            raise ConfigError(f"passkey depth {depth} is outside [0, 1] (0 = start of the text, 1 = end)")
        needle, fixed = self.needle_ids(key), self.fixed_tokens(key)
        budget = length - fixed
        if budget < 0:
            raise ConfigError(
                f"passkey prompt length {length} is too short: intro, key sentence and question take {fixed} "
                f"tokens with this tokenizer; use a length of at least {fixed}"
            )
        filler, boundaries, unit = [], [0], first_unit
        while len(filler) < budget:
            filler += self.units[unit % len(self.units)]
            boundaries.append(min(len(filler), budget))
            unit += 1
        filler = filler[:budget]  # the last sentence is cut to fit
        cut = min(boundaries, key=lambda b: abs(b - depth * budget))
        ids = self.intro + filler[:cut] + needle + filler[cut:] + self.question
        return PasskeyPrompt(ids, key, self.answer_ids(key), len(self.intro) + cut, len(needle), depth)

    def sample(self, length: int, depth: float, trial: int, seed: int = 0) -> PasskeyPrompt:
        """Trial ``trial`` of a fixed-seed series: the same key and filler start at every length and depth, so
        cells of a grid differ only in length and depth."""
        rng = random.Random(seed * 1_000_003 + trial)
        return self.build(length, depth, random_key(rng), first_unit=rng.randrange(len(self.units)))

    def max_unit_tokens(self) -> int:
        return max(len(u) for u in self.units)


def first_number(text: str) -> str | None:
    match = re.search(r"\d+", text)
    return match.group(0) if match else None


def is_correct(answer_text: str, key: str) -> bool:
    """Exact match: the first number in the model's answer is the key (no more, no fewer digits)."""
    return first_number(answer_text) == key


Complete = Callable[[torch.Tensor, int], torch.Tensor]  # (prompts (n, L), new tokens) -> (n, new tokens)


def greedy_completion(backbone) -> Complete:
    """Greedy decoding with the backbone's KV cache: the tokens generated after each prompt."""

    def complete(prompts: torch.Tensor, new_tokens: int) -> torch.Tensor:
        return backbone.generate(prompts, max_new_tokens=new_tokens, temperature=0)[:, prompts.shape[1] :]

    return complete


def score_prompts(complete: Complete, prompts: Sequence[PasskeyPrompt], tokenizer, device="cpu") -> list[bool]:
    """Whether each prompt is answered with its key. Prompts of one length run as one batch; one token more than
    the longest answer is generated, so an answer that runs on into a sixth digit counts as wrong."""
    ids = torch.tensor([p.ids for p in prompts], dtype=torch.long, device=device)
    generated = complete(ids, max(len(p.answer_ids) for p in prompts) + 1)
    return [is_correct(tokenizer.decode(row.tolist()), p.key) for row, p in zip(generated, prompts)]


def passkey_grid(
    complete: Complete,
    builder: PasskeyPrompts,
    lengths: Sequence[int],
    depths: Sequence[float] = DEFAULT_DEPTHS,
    trials: int = 5,
    seed: int = 0,
    device="cpu",
) -> list[dict]:
    """One row per (length, depth): trials, correct answers and accuracy; accuracy None where the model cannot
    take that length (a learnable position table)."""
    rows = []
    for length in lengths:
        for depth in depths:
            prompts = [builder.sample(length, depth, trial, seed) for trial in range(trials)]
            try:
                correct = sum(score_prompts(complete, prompts, builder.tokenizer, device))
            except UnsupportedLengthError:
                rows.append({"length": length, "depth": depth, "trials": trials, "correct": None, "accuracy": None})
                continue
            rows.append(
                {"length": length, "depth": depth, "trials": trials, "correct": correct, "accuracy": correct / trials}
            )
    return rows


def training_sequence(builder: PasskeyPrompts, tokens: int, rng: random.Random) -> list[int]:
    """``tokens`` ids: a prompt with a random key at a random depth followed by its answer, for fine-tuning the
    retrieval skill at the training length (a training window holds block_size + 1 tokens)."""
    key = random_key(rng)
    answer = builder.answer_ids(key)
    prompt = builder.build(tokens - len(answer), rng.random(), key, first_unit=rng.randrange(len(builder.units)))
    return prompt.ids + answer
