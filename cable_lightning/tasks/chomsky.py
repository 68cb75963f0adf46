"""The algorithmic tasks of "Neural Networks and the Chomsky Hierarchy" (Delétang et al., ICLR 2023), as Ruoss et al.
(ACL 2023) and DAPE (Zheng et al., 2024) use them to rank positional encodings by length generalization.

An example of input length n (the papers' length: the number of input symbols) is a leading filler token (never
read, as in every task here), the n input symbols, then the output: an encoder reads the input followed by one mask
token per output token (its "empty" tokens) and predicts every output token at once. Input symbol i is
``vocab.symbols[i]``, output class c is ``vocab.symbols[OUTPUT_OFFSET + c]``: inputs and outputs never share an id,
as the papers' separate one-hot input and output layers do not. Tasks whose output ends at a terminator
(``terminated``) score only the tokens up to it (the papers' ``accuracy_mask``); the loss covers the whole output.

Definitions follow the authors' code (google-deepmind/neural_networks_chomsky_hierarchy, ``tasks/``); where it
differs from the paper text the code is followed (docs/chomsky.md lists where). Each draws from the example's own
NumPy generator, so an example is a function of (seed, split, index, length).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar, Optional

import numpy as np

from ..errors import ConfigError
from .generation import SYMBOLS, Example, Task, TaskVocabulary

OUTPUT_OFFSET = SYMBOLS // 2  # output class c is symbol OUTPUT_OFFSET + c: no input symbol shares its id


@dataclass(frozen=True)
class AlgorithmicTask(Task):
    """A Chomsky-hierarchy task: ``sample`` draws (input symbols, output classes) for an input length."""

    length_is_input: ClassVar[bool] = True
    level: ClassVar[str]  # R (regular), DCF (deterministic context-free) or CS (context-sensitive)
    inputs: ClassVar[int]  # input alphabet size
    outputs: ClassVar[int]  # output classes (the last one is the terminator where ``terminated``)
    terminated: ClassVar[bool] = False

    def output_length(self, length: int) -> int:
        return 1

    def sample(self, rng: np.random.Generator, length: int) -> tuple[list[int], list[int]]:
        raise NotImplementedError

    def tokens_read(self, length: int) -> int:
        """Tokens the model reads for an input of ``length`` symbols (input and empty output tokens)."""
        return len(self.sample(np.random.default_rng(0), length)[0]) + self.output_length(length)

    def fixed_tokens(self, vocab) -> Optional[int]:
        return None

    def check_length(self, length: int, vocab: Optional[TaskVocabulary]) -> None:
        if length < 1:
            raise ConfigError(f"task {self.name} needs an input length of at least 1 symbol, got {length}")

    def example(self, length: int, rng: np.random.Generator, vocab: TaskVocabulary,
                depth: Optional[float] = None) -> Example:
        """``length`` input symbols (modular arithmetic: the odd length at or below it), then the output."""
        self.check_length(length, vocab)
        x, y = self.sample(rng, length)
        assert len(y) == self.output_length(length) and max(x) < self.inputs and max(y) < self.outputs
        ids = np.concatenate([rng.choice(vocab.filler, 1), vocab.symbols[np.array(x)],
                              vocab.symbols[OUTPUT_OFFSET + np.array(y)]])
        answer = np.arange(len(ids)) > len(x)
        scored = answer.copy()
        if self.terminated:  # only the output up to its terminator counts
            end = len(x) + 1 + y.index(self.outputs - 1)
            scored[end + 1:] = False
        return Example(ids, answer, scored=scored)


def bits(rng: np.random.Generator, n: int) -> list[int]:
    return rng.integers(0, 2, n).tolist()


@dataclass(frozen=True)
class EvenPairs(AlgorithmicTask):
    """Whether the number of unequal adjacent pairs ("ab", "ba") is even: equivalently, first == last."""

    name: ClassVar[str] = "even_pairs"
    level, inputs, outputs = "R", 2, 2

    def sample(self, rng, length):
        x = bits(rng, length)
        return x, [int(x[0] == x[-1])]


@dataclass(frozen=True)
class ModularArithmetic(AlgorithmicTask):
    """digit op digit op ... digit (mod 5), ``*`` before ``+``/``-``; input 0-4 digits, 5-8 the operators ``+ - *``
    and a blank. An even length is cut to the odd one below it (the authors' code; the paper says one above)."""

    name: ClassVar[str] = "modular_arithmetic"
    level, inputs, outputs = "R", 9, 5
    MODULUS: ClassVar[int] = 5
    OPERATORS: ClassVar[tuple] = ("+", "-", "*")  # symbols 5, 6, 7; 8 is the blank, never drawn

    def sample(self, rng, length):
        n = length if length % 2 else length - 1
        digits = rng.integers(0, self.MODULUS, n // 2 + 1)
        ops = rng.integers(0, len(self.OPERATORS), n // 2)
        x = [0] * n
        x[::2], x[1::2] = digits.tolist(), (self.MODULUS + ops).tolist()
        terms, product, sign = [], int(digits[0]), 1  # evaluated left to right, products first
        for op, digit in zip(ops.tolist(), digits[1:].tolist()):
            if self.OPERATORS[op] == "*":
                product *= digit
            else:
                terms.append(sign * product)
                product, sign = digit, 1 if self.OPERATORS[op] == "+" else -1
        terms.append(sign * product)
        return x, [sum(terms) % self.MODULUS]


@dataclass(frozen=True)
class ParityCheck(AlgorithmicTask):
    """Whether the number of ones is odd."""

    name: ClassVar[str] = "parity_check"
    level, inputs, outputs = "R", 2, 2

    def sample(self, rng, length):
        x = bits(rng, length)
        return x, [sum(x) % 2]


@dataclass(frozen=True)
class CycleNavigation(AlgorithmicTask):
    """The final state on a cycle of 5 states from state 0: symbol 0 moves back one, 1 stays, 2 moves forward one."""

    name: ClassVar[str] = "cycle_navigation"
    level, inputs, outputs = "R", 3, 5

    def sample(self, rng, length):
        x = rng.integers(0, 3, length).tolist()
        return x, [sum(a - 1 for a in x) % 5]


@dataclass(frozen=True)
class StackManipulation(AlgorithmicTask):
    """A stack given bottom to top (bits, at least one), then actions 2 POP (ignored on an empty stack), 3 PUSH 0,
    4 PUSH 1; output the final stack top to bottom, the terminator (2), then zeros up to ``length + 1`` tokens."""

    name: ClassVar[str] = "stack_manipulation"
    level, inputs, outputs, terminated = "DCF", 5, 3, True

    def output_length(self, length):
        return length + 1

    def sample(self, rng, length):
        if length == 1:
            x = bits(rng, 1)
            return x, x + [2]
        size = int(rng.integers(1, length))
        stack = bits(rng, size)
        actions = rng.integers(2, 5, length - size).tolist()
        final = list(stack)
        for action in actions:
            if action == 2:
                if final:
                    final.pop()
            else:
                final.append(action - 3)
        out = final[::-1] + [2]
        return stack + actions, out + [0] * (length + 1 - len(out))


@dataclass(frozen=True)
class ReverseString(AlgorithmicTask):
    name: ClassVar[str] = "reverse_string"
    level, inputs, outputs = "DCF", 2, 2

    def output_length(self, length):
        return length

    def sample(self, rng, length):
        x = bits(rng, length)
        return x, x[::-1]


def bracket_expression(rng: np.random.Generator, length: int, operators: str) -> tuple[str, int]:
    """An arithmetic expression of exactly ``length`` characters over the digits 0-4 and its value mod 5: a digit, -d,
    (d) and (-d) at lengths 1-4, else (left op right) split at a uniform point (the authors' recursive grammar)."""
    if length <= 4:
        digit = int(rng.integers(0, 5))
        sign = -1 if length in (2, 4) else 1
        text = ("-" if sign < 0 else "") + str(digit)
        return (f"({text})" if length > 2 else text), sign * digit % 5
    left_length = int(rng.integers(1, length - 3))
    left, a = bracket_expression(rng, left_length, operators)
    right, b = bracket_expression(rng, length - 3 - left_length, operators)
    op = operators[int(rng.integers(0, len(operators)))]
    value = {"+": a + b, "-": a - b, "*": a * b}[op]
    return f"({left}{op}{right})", value % 5


@dataclass(frozen=True)
class ModularArithmeticBrackets(AlgorithmicTask):
    """A bracketed expression of exactly ``length`` characters with ``+ - *`` (the papers' ``mult=True``), mod 5;
    input 0-4 digits, 5-9 ``+ - * ( )`` (10 and 11, the ``x`` and ``=`` of solve equation, are never drawn)."""

    name: ClassVar[str] = "modular_arithmetic_brackets"
    level, inputs, outputs = "DCF", 11, 5
    ALPHABET: ClassVar[str] = "01234+-*()"

    def sample(self, rng, length):
        text, value = bracket_expression(rng, length, "+-*")
        return [self.ALPHABET.index(c) for c in text], [value]


@dataclass(frozen=True)
class SolveEquation(AlgorithmicTask):
    """A bracketed ``+ -`` expression of ``length - 2`` characters with one digit replaced by ``x``, then ``=`` and its
    value mod 5; output the replaced digit (unique: x enters with coefficient +-1). Input 0-4 digits, 5-10
    ``+ - ( ) x =``. The digit is the first one at or after a uniform position, wrapping round; lengths 1-2 are all
    zeros with the answer 0 (the authors' code)."""

    name: ClassVar[str] = "solve_equation"
    level, inputs, outputs = "DCF", 11, 5
    ALPHABET: ClassVar[str] = "01234+-()x="

    def sample(self, rng, length):
        if length < 3:
            return [0] * length, [0]
        text, value = bracket_expression(rng, length - 2, "+-")
        at = int(rng.integers(0, len(text)))
        while not text[at].isdigit():
            at = (at + 1) % len(text)
        equation = f"{text[:at]}x{text[at + 1:]}={value}"
        return [self.ALPHABET.index(c) for c in equation], [int(text[at])]


@dataclass(frozen=True)
class DuplicateString(AlgorithmicTask):
    name: ClassVar[str] = "duplicate_string"
    level, inputs, outputs = "CS", 2, 2

    def output_length(self, length):
        return 2 * length

    def sample(self, rng, length):
        x = bits(rng, length)
        return x, x + x


@dataclass(frozen=True)
class MissingDuplicate(AlgorithmicTask):
    """ww (w of length//2 bits) with one symbol replaced by 2, padded with a 3 when the length is odd; output the
    replaced bit. Length 1 is the input 1 and the output 1 (the authors' code)."""

    name: ClassVar[str] = "missing_duplicate"
    level, inputs, outputs = "CS", 4, 2

    def sample(self, rng, length):
        if length == 1:
            return [1], [1]
        w = bits(rng, length // 2)
        x = w + w
        at = int(rng.integers(0, len(x)))
        answer, x[at] = x[at], 2
        return x + [3] * (length % 2), [answer]


@dataclass(frozen=True)
class OddsFirst(AlgorithmicTask):
    """The symbols at odd (0-based) indices, then those at even ones."""

    name: ClassVar[str] = "odds_first"
    level, inputs, outputs = "CS", 2, 2

    def output_length(self, length):
        return length

    def sample(self, rng, length):
        x = bits(rng, length)
        return x, x[1::2] + x[0::2]


@dataclass(frozen=True)
class BinaryAddition(AlgorithmicTask):
    """n+m in little-endian binary (the ``+`` is symbol 2); output the sum little-endian without trailing zeros, the
    terminator (2), then zeros up to ``length + 1`` tokens. Lengths 1 and 2: one number below 2**length - 1 and
    itself (the authors' code)."""

    name: ClassVar[str] = "binary_addition"
    level, inputs, outputs, terminated = "CS", 3, 3, True

    def output_length(self, length):
        return length + 1

    def sample(self, rng, length):
        if length <= 2:
            n = int(rng.integers(0, 2 ** length - 1))
            x, total = little_endian(n, length), n
        else:
            size_n = int(rng.integers(1, length - 1))
            size_m = length - 1 - size_n
            n, m = random_number(rng, size_n), random_number(rng, size_m)
            x, total = little_endian(n, size_n) + [2] + little_endian(m, size_m), n + m
        out = little_endian(total, 0) + [2]
        return x, out + [0] * (length + 1 - len(out))


def random_number(rng: np.random.Generator, size: int) -> int:
    """Uniform in [1, 2**size - 1] for any size (``size`` random bits, drawn again while all are 0)."""
    while True:
        value = int("".join(map(str, bits(rng, size))), 2)
        if value >= 1:
            return value


def little_endian(value: int, width: int) -> list[int]:
    """``value``'s bits, least significant first, at least ``width`` of them (0 is one bit, ``[0]``, at width 0)."""
    return [int(b) for b in reversed(f"{value:b}".zfill(width))]


@dataclass(frozen=True)
class BinaryMultiplication(AlgorithmicTask):
    """n*m in little-endian binary (the ``*`` is symbol 2); output the product as binary addition does, in ``length``
    tokens. Lengths 1 and 2: one number below 2**length - 1 and the output [] or [0] before the terminator (the
    authors' code)."""

    name: ClassVar[str] = "binary_multiplication"
    level, inputs, outputs, terminated = "CS", 3, 3, True

    def output_length(self, length):
        return length

    def sample(self, rng, length):
        if length <= 2:
            x, out = little_endian(int(rng.integers(0, 2 ** length - 1)), length), [0] * (length - 1)
        else:
            size_n = int(rng.integers(1, length - 1))
            size_m = length - 1 - size_n
            n, m = random_number(rng, size_n), random_number(rng, size_m)
            x, out = little_endian(n, size_n) + [2] + little_endian(m, size_m), little_endian(n * m, 0)
        return x, out + [2] + [0] * (length - 1 - len(out))


@dataclass(frozen=True)
class ComputeSqrt(AlgorithmicTask):
    """A number in [1, 2**length - 1], big-endian in ``length`` bits; output the floor of its square root, big-endian in
    ceil(length / 2) bits (the authors' code; the paper says little-endian)."""

    name: ClassVar[str] = "compute_sqrt"
    level, inputs, outputs = "CS", 2, 2

    def output_length(self, length):
        return (length + 1) // 2

    def sample(self, rng, length):
        n = random_number(rng, length)
        root = math.isqrt(n)
        return little_endian(n, length)[::-1], little_endian(root, self.output_length(length))[::-1]


@dataclass(frozen=True)
class BucketSort(AlgorithmicTask):
    name: ClassVar[str] = "bucket_sort"
    level, inputs, outputs = "CS", 5, 5

    def output_length(self, length):
        return length

    def sample(self, rng, length):
        x = rng.integers(0, 5, length).tolist()
        return x, sorted(x)
