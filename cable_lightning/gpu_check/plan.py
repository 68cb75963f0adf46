"""gpu-check's plan: which encodings, at which sizes, in which parts (one per attention backend), and the seconds
each may take (the ``*_BUDGET_S`` constants, sized by two runs on H100s; docs/speed.md, "On a GPU")."""

from __future__ import annotations

import dataclasses

import torch

from ..callbacks.throughput import WARMUP_STEPS

# Three encodings per backend where there are three, NoPE (the baseline) first.
ENCODINGS = ["nope", "rope", "cable", "alibi", "fox", "kerple_log", "fire", "t5", "cope", "dape_v2+cable",
             "stick_breaking"]
# The plan's budgets (seconds on one H100 or H200; two runs on H100s measured what is noted), all times --budget_scale:
COMPILE_BUDGET_S = 20.0  # a fit's warm-up steps, where Dynamo and inductor compile (4-18 s measured)
STEADY_BUDGET_S = 8.0  # a fit's steady steps, from the first one's start, whatever compiling took
# What else a fit takes, charged to its part: its start, two validations with diagnostics, two checkpoints (14-23 s
# measured for sdpa and fold fits); a flex fit's first validation compiles FlexAttention's evaluation kernels too
# (40-54 s measured, against 3.5 s). Without them a part's budget ran out inside its first flex fit: T5 skipped twice.
FIT_OTHER_BUDGET_S = 20.0
FLEX_EVAL_COMPILE_BUDGET_S = 40.0
BENCH_BUDGET_S = 24.0  # the bench's timed forwards, all encodings together
BENCH_COMPILE_BUDGET_S = 30.0  # the bench's first forward of an encoding on the flex path (compiling: 11-34 s measured)
FLEX_CHECK_BUDGET_S = 60.0  # FlexAttention's values and gradients against the reference (FLEX_CHECK)
RUN_BUDGET_S = 425.0  # --time_budget's default: nothing starts after it (a run ends within one fit of it, in 600 s)
FLEX_CHECK = ("-m", "cable_lightning.gpu_check.flex")  # the package's own check (gpu_check/flex.py), run by python


def fit_budget(label: str) -> float:
    """The seconds a fit of ``label`` adds to its part's budget (before ``--budget_scale``)."""
    flex = FLEX_EVAL_COMPILE_BUDGET_S if backend_of(label) == "flex" else 0.0
    return COMPILE_BUDGET_S + STEADY_BUDGET_S + FIT_OTHER_BUDGET_S + flex


@dataclasses.dataclass(frozen=True)
class Sizes:
    """A run's shapes: gpt2-small at 1024 tokens on a GPU, a toy model in the CPU rehearsal."""

    preset: str
    shape: dict  # backbone overrides of the preset's layers, heads and width
    block: int
    micro: int
    warmup: int
    steady: int
    eval_length: int  # the bench part's evaluation length
    repeats: int
    precision: str
    extra: tuple = ()  # more fit arguments

    @property
    def dtype(self) -> torch.dtype:
        return torch.bfloat16 if self.precision.startswith("bf16") else torch.float32


GPU = Sizes("gpt2-small", {}, block=1024, micro=16, warmup=WARMUP_STEPS, steady=10, eval_length=16384, repeats=2,
            precision="bf16-mixed")
# fp32: a CPU without bf16 instructions runs bf16 many times slower (the bf16 matmul peak took 129 s to measure on
# the shared 2-core machine); no logger: TensorBoard figures take seconds of matplotlib a validation on 2 cores, and
# say nothing of the command.
REHEARSAL = Sizes("gpt2-tiny", {"n_layer": 2, "n_head": 2, "n_embd": 32}, block=32, micro=2, warmup=1, steady=2,
                  eval_length=128, repeats=1, precision="32-true", extra=("--trainer.logger", "false"))


def backend_of(label: str) -> str:
    """The attention backend of a label: the one it names (``nope:flex``), else the one ``auto`` takes for the
    encoding on CUDA in a causal model, the first that ``backends_for`` lists after ``auto`` (sdpa, fold, flex or
    chunked)."""
    from ..models.attention import backends_for
    from ..positional import from_label

    name, _, backend = label.partition(":")
    return backend or backends_for(from_label(name).scores, causal=True)[1]


def parts_of(encodings: list[str]) -> dict[str, list[str]]:
    """``{"fit <backend>": [encodings]}`` in the order the encodings first name each backend."""
    parts: dict[str, list[str]] = {}
    for label in encodings:
        parts.setdefault(f"fit {backend_of(label)}", []).append(label)
    return parts
