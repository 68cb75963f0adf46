"""Scoring synthetic tasks (:mod:`.generation`): exact match of every answer token, per-token accuracy for the
algorithmic tasks (:mod:`.chomsky`: the share of an example's scored answer tokens that are right, the papers'
measure), and the effective length.

An example is right when the model's most likely token is the answer at every answer position. A decoder predicts
each answer token after the example's own tokens before it (teacher forcing). That is what greedy decoding would
produce: while every answer token so far is right, the decoder's input is the example itself, so one forward pass
scores an answer of any length without a KV cache. A masked LM reads the example with every answer token replaced by
its mask token and fills them all in at once, from context on both sides.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Optional

import numpy as np
import torch

from ..positional import UnsupportedLengthError
from .generation import EVAL, Example, TaskMix

DEFAULT_DEPTHS = (0.0, 0.25, 0.5, 0.75, 1.0)
DEFAULT_THRESHOLD = 0.85  # RULER's: the accuracy a length must keep to count as effective

# (ids (B, L + 1), answer (B, L): which of ids[:, 1:] are answer tokens) -> the model's token for each of
# ids[:, 1:] (B, L); the model reads L tokens.
Predict = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def decoder_inputs(ids: torch.Tensor, answer: torch.Tensor) -> torch.Tensor:
    """What a decoder reads of examples ``ids`` (B, L + 1): ids[:, :-1]; position t predicts ids[:, t + 1], an answer
    token where ``answer[:, t]``."""
    return ids[:, :-1]


def masked_inputs(ids: torch.Tensor, answer: torch.Tensor, mask_id: int) -> torch.Tensor:
    """What a masked LM reads: ids[:, 1:] with the answer tokens masked (the example's first token, filler, is
    dropped so that it reads as many tokens as a decoder); position t predicts ids[:, t + 1]."""
    return ids[:, 1:].masked_fill(answer, mask_id)


def argmax_predictions(backbone, chunk: int = 512) -> Predict:
    """A decoder's most likely next token after each of ids[:, :-1]; the head runs ``chunk`` positions at a time."""

    return lambda ids, answer: backbone.argmax_tokens(decoder_inputs(ids, answer), chunk)


def masked_predictions(backbone, mask_id: int, chunk: int = 512, layout: Callable = lambda inputs: None) -> Predict:
    """A masked LM's most likely token at each position, read as :func:`masked_inputs`; ``layout(inputs)``: the
    positions it reads them at (None: 0, 1, 2, ...)."""

    def predict(ids, answer):
        inputs = masked_inputs(ids, answer, mask_id)
        return backbone.argmax_tokens(inputs, chunk, layout=layout(inputs))

    return predict


def exact_match(predicted: torch.Tensor, targets: torch.Tensor, answer: torch.Tensor) -> torch.Tensor:
    """(B,) True where every answer target is predicted; other positions do not count."""
    return ((predicted == targets) | ~answer).all(dim=1)


def token_accuracy(predicted: torch.Tensor, targets: torch.Tensor, scored: torch.Tensor) -> torch.Tensor:
    """(B,) the share of each row's scored targets that are predicted."""
    return ((predicted == targets) & scored).sum(1) / scored.sum(1).clamp(min=1)


def score_examples(predict: Predict, examples: Sequence[Example], batch_size: int = 16, device="cpu",
                   per_token: bool = False) -> list:
    """Whether each example is answered exactly (or, ``per_token``, the share of its scored answer tokens that are
    right), ``batch_size`` examples at a time."""
    ids = torch.from_numpy(np.stack([e.ids for e in examples])).to(device)
    answer = torch.from_numpy(np.stack([e.answer for e in examples]))[:, 1:].to(device)
    scored = torch.from_numpy(np.stack([e.answer if e.scored is None else e.scored for e in examples]))[:, 1:]
    scored = scored.to(device)
    score = token_accuracy if per_token else exact_match
    right = []
    for start in range(0, len(examples), batch_size):
        rows = slice(start, start + batch_size)
        right += score(predict(ids[rows], answer[rows]), ids[rows, 1:], scored[rows]).tolist()
    return right


def task_grid(predict: Predict, mix: TaskMix, lengths: Sequence[int], depths: Sequence[float] = DEFAULT_DEPTHS,
              trials: int = 32, seed: int = 0, batch_size: int = 16, device="cpu") -> list[dict]:
    """One row per (task, length, depth; depth None for tasks that do not place their fact): trials, correct (answered
    exactly) and accuracy (None where the model cannot take the length): the exact-match share, or for an algorithmic
    task the mean per-token accuracy (``scoring``). ``length`` is what the model reads, or for an algorithmic task
    its input symbols; trial t is evaluation example t of ``seed`` in every cell, so cells differ only in length and
    depth."""
    rows = []
    for task in mix.tasks:
        scoring = "per_token" if task.length_is_input else "exact_match"
        for length in lengths:
            for depth in depths if task.has_depth else [None]:
                size = length if task.length_is_input else length + 1
                examples = [mix.example(size, seed, EVAL, t, task=task, depth=depth) for t in range(trials)]
                try:
                    shares = score_examples(predict, examples, batch_size, device, per_token=task.length_is_input)
                except UnsupportedLengthError:
                    shares = None
                rows.append({"task": task.name, "length": length, "depth": depth, "trials": trials,
                             "correct": None if shares is None else sum(share == 1 for share in shares),
                             "accuracy": None if shares is None else sum(shares) / trials, "scoring": scoring})
    return rows


def effective_length(accuracy: dict[int, Optional[float]], train_length: int,
                     threshold: float = DEFAULT_THRESHOLD) -> Optional[int]:
    """The longest evaluated length up to which accuracy stays at or above ``threshold``, counting from the training
    length (lengths below it do not count); None when the training length itself falls short or was not evaluated."""
    effective = None
    for length in sorted(n for n in accuracy if n >= train_length):
        if (length == train_length or effective is not None) and (accuracy[length] or 0.0) >= threshold:
            effective = length
        else:
            break
    return effective
