"""``python -m cable_lightning gpu-check``: what a lent GPU must show, in the minutes it is lent (docs/speed.md, "On a
GPU"). Each result is a Markdown table row, written to ``--out`` and flushed as it is produced, so a run cut short
keeps what finished. An existing ``--out`` is replaced only when gpu-check wrote it (its first line) and
``--overwrite`` is given, and only once the new run has written its first row: a GPU run's rows cannot be made again
without a GPU. SIGTERM or Ctrl-C ends it in one line saying what ``--out`` holds (exit 143 or 130).

1. Real fits through the CLI, one per encoding, grouped into one part per attention backend (the group each encoding
   takes on CUDA, from the registry and ``attention.backends_for``): gpt2-small shape, 1024 tokens, 16 sequences a
   step, bf16-mixed, ``compile: true``, 3 warm-up steps (compilation among them), 10 steady steps, a validation at
   1024 tokens with the default diagnostics and a checkpoint, one more step, and the validation that ends every fit
   (the first validation compiles; the second's costs are reported). A step's time is the interval between
   consecutive ``on_train_batch_start`` hooks measured with CUDA events: the whole period of a step, loading, hooks
   and logging included, the rate a fit trains at (from a step's start to its own end would leave the loop's work
   between steps out). Validation, diagnostics and checkpoint saves are timed apart with the device synchronised
   (phases of seconds, some on the host; events add nothing there). The row gives the median steady step, tokens/s,
   MFU (``bench.peak_flops``), the warm-up's and the steady phase's seconds beside their budgets, the steady steps'
   peak memory beside its estimate, Dynamo's compiles in the warm-up, the steady steps (0 unless something
   recompiles) and the validations, and graph breaks. A fit that timed no steady step says why.
2. ``bench`` (run first): the bench's model-only evaluation at 16,384 tokens (eager, bf16, one sequence): the first
   forward's seconds (FlexAttention compiles there on CUDA), then seconds and peak memory against NoPE from forwards
   that reuse that compile (the row counts Dynamo's compiles in both), for every chosen encoding except those on the
   chunked path (no target, and the slow part that ran the first GPU measurement out of time); with any on the flex
   path, ``nope:flex`` too (no bias on FlexAttention: what the kernel costs without a score_mod).
3. ``pytest`` (run last): ``FLEX_TESTS``, FlexAttention's values and gradients on CUDA, from the source tree.

Dynamo's warning that a function hit its recompile limit (it then runs that function eagerly for the rest of the
process) is caught by a handler on the ``torch._dynamo`` logger: the run goes on, then exits 1 with a line naming
the function. A part that fails is a row too; the run then exits 1.

The plan for one H100 or H200 (the ``*_BUDGET_S`` constants, sized by two runs on H100s): compiling has budgets of its
own, apart from the timed work, so that a slow compile costs time but never the steady steps. ``bench`` first: 24 s
for the timed forwards plus 30 s for each encoding on the flex path's first forward, ``nope:flex`` included (144 s
for the default encodings). Then each fit: 20 s for its warm-up and 8 s for its steady steps, counted from the
first steady step's start whatever the warm-up took (a fit stops training once that passes and a steady step was
timed; the warm-up is never cut; the validations that follow still run), and 20 s for its start, validations and
checkpoints, 40 s more on the flex path (its first validation compiles): a part's budget is its fits' (48 s a fit,
88 s a flex fit). Then the FlexAttention tests, 60 s. For the default encodings that is 852 s, more than a lent
GPU's 15 minutes: nothing starts after 425 s (plus about 20 s to import and start), what would start after its part's
budget or after that is a "skipped" row, so the run ends within one fit (or the tests' 60 s) of 425 s;
``--encodings`` picks what matters.

Peak memory: the peak of the steady steps (CUDA's peak statistics reset at the first steady step, read at the first
validation's start), beside an estimate of what a bf16-mixed AdamW step holds (:func:`memory_estimate`, the
encoding's own position tables included). The fits pass ``--throughput.log_peak_memory false``: that callback resets
the peak statistics (at each logging step; at every step's end when the old ``tools/gpu_acceptance.py`` ran), which is
why that script reported 1.6 GiB for a 16 x 1024 batch of an 88M-parameter model (by its code and the arithmetic: it
read the peak at the end of training, after the last reset, so the figure was the final validation and checkpoint
over the weights, gradients and AdamW state, 1.3 GiB, not a training step).

``--rehearse-on-cpu``: the same parts on the CPU at toy sizes (2 layers, 32 tokens, 1 warm-up and 2 steady steps),
the first encoding of each part only, CPU clocks for the events, Dynamo's ``eager`` backend for inductor (compiling
is the GPU's part; Dynamo's counters and the recompile watch still run), the FlexAttention tests collected, not run;
its figures are not GPU figures.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import logging
import os
import re
import signal
import statistics
import subprocess
import sys
import time
import warnings
from contextlib import closing, contextmanager, nullcontext

import lightning as L
import torch
from lightning.pytorch.utilities.exceptions import SIGTERMException

from .callbacks import AttentionDiagnostics
from .callbacks.throughput import WARMUP_STEPS
from .errors import ArgumentParser, ConfigError, RunFailedError, user_error
from .owned import check_replaceable

# The choice (issue 47): three encodings per backend where there are three, NoPE (the baseline) first.
ENCODINGS = ["nope", "rope", "cable", "alibi", "fox", "kerple_log", "fire", "t5", "cope", "dape_v2+cable",
             "stick_breaking"]
# The plan's budgets (seconds on one H100 or H200; two runs on H100s measured what is noted), all times --budget-scale:
COMPILE_BUDGET_S = 20.0  # a fit's warm-up steps, where Dynamo and inductor compile (4-18 s measured)
STEADY_BUDGET_S = 8.0  # a fit's steady steps, from the first one's start, whatever compiling took
# What else a fit takes, charged to its part: its start, two validations with diagnostics, two checkpoints (14-23 s
# measured for sdpa and fold fits); a flex fit's first validation compiles FlexAttention's evaluation kernels too
# (40-54 s measured, against 3.5 s). Without them a part's budget ran out inside its first flex fit: T5 skipped twice.
FIT_OTHER_BUDGET_S = 20.0
FLEX_EVAL_COMPILE_BUDGET_S = 40.0
BENCH_BUDGET_S = 24.0  # the bench's timed forwards, all encodings together
BENCH_COMPILE_BUDGET_S = 30.0  # the bench's first forward of an encoding on the flex path (compiling: 11-34 s measured)
PYTEST_BUDGET_S = 60.0  # the CUDA FlexAttention tests (FLEX_TESTS)
RUN_BUDGET_S = 425.0  # nothing starts after it (a run then ends within one fit of it, inside a 600 s device call)
FLEX_TESTS = ("tests/test_attention.py", "-k", "flex")  # FlexAttention's values and gradients on CUDA


def fit_budget(label: str) -> float:
    """The seconds a fit of ``label`` adds to its part's budget (before ``--budget-scale``)."""
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
    from .models.attention import backends_for
    from .positional import from_label

    name, _, backend = label.partition(":")
    return backend or backends_for(from_label(name).scores, causal=True)[1]


def parts_of(encodings: list[str]) -> dict[str, list[str]]:
    """``{"fit <backend>": [encodings]}`` in the order the encodings first name each backend."""
    parts: dict[str, list[str]] = {}
    for label in encodings:
        parts.setdefault(f"fit {backend_of(label)}", []).append(label)
    return parts


def dynamo_counts() -> dict[str, int]:
    """Dynamo's counters: frames compiled (a recompile is one more), graphs produced, graph breaks."""
    from torch._dynamo.utils import counters

    return {"compiles": counters["frames"]["ok"], "graphs": counters["stats"]["unique_graphs"],
            "graph_breaks": sum(counters["graph_break"].values())}


LIMIT_HIT = re.compile(r"hit config\.(\w*(?:recompile|cache_size)_limit)")


class RecompileWatch(logging.Handler):
    """Dynamo's warning that a function hit its recompile limit (``recompile_limit``; ``cache_size_limit`` before
    torch 2.6): after it that function runs eagerly, silently slow. ``hits``: (function, last reason) of each."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.hits: list[tuple[str, str]] = []

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if LIMIT_HIT.search(message):
            function = re.search(r"function: (.*)", message)
            reason = re.search(r"last reason: (.*)", message)
            self.hits.append((function.group(1) if function else "(unnamed)", reason.group(1) if reason else "?"))

    @contextmanager
    def watching(self):
        logger = logging.getLogger("torch._dynamo")
        logger.addHandler(self)
        try:
            yield self
        finally:
            logger.removeHandler(self)


@contextmanager
def eager_dynamo():
    """The rehearsal's compile: Dynamo traces as on a GPU (its counters and warnings are real), its ``eager`` backend
    runs the graphs (inductor takes 17-25 s a model on 2 cores)."""
    compile_ = torch.compile

    def eager(*args, **kwargs):
        kwargs = {name: value for name, value in kwargs.items() if name not in ("mode", "options")}  # inductor's
        return compile_(*args, **{**kwargs, "backend": "eager"})

    torch.compile = eager
    try:
        yield
    finally:
        torch.compile = compile_


def memory_estimate(model, rows: int, length: int) -> tuple[float, float, float, float]:
    """Bytes a bf16-mixed AdamW training step peaks near: (state, activations, logits, tables). State: fp32 weights,
    their gradients and AdamW's two moments, 16 bytes a parameter. Activations: 34 bytes per token, width and layer
    (what autograd keeps of a transformer layer with 16-bit activations and a fused attention kernel, no T x T term;
    Korthikanti et al. 2022). Logits: their bf16 values and fp32 log-softmax, kept for the backward, 6 bytes per token
    and vocabulary entry. Tables: the encoding's own position tables (:func:`table_bytes`)."""
    c, tokens = model.config, rows * length
    state = 16 * sum(p.numel() for p in model.parameters())
    return state, 34 * tokens * c.n_embd * c.n_layer, 6 * tokens * c.vocab_size, table_bytes(c, length)


def table_bytes(config, length: int) -> int:
    """Bytes an encoding's own position tables hold through a training step on CUDA: in each layer whose bias is a
    function of positions alone on the flex path, the (heads, length, length) fp32 table FlexAttention's score_mod
    reads (``attention.flex_score_mod``), kept for the backward, and what autograd keeps to differentiate it (eager:
    FIRE keeps its MLP's hidden units over the whole table; a compiled block may keep less). Each layer's encoding
    module (the registry's) is asked: which bias it adds (at 2 tokens on the CPU), then its tables on the meta
    device, where nothing is allocated."""
    from .models.attention import FLEX_TABLE_ELEMENTS, resolve_backend
    from .positional.base import PositionalBias
    from .positional.registry import build_positional

    heads, probe = config.n_head, build_positional(config)
    with torch.device("meta"):
        pe, h = build_positional(config), torch.empty(1, length, config.n_embd)
    tables, saved = {}, {}
    with torch.no_grad():
        kinds = [probe.score_bias(torch.zeros(1, 2, config.n_embd), layer, 0, None) for layer in range(config.n_layer)]
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.setdefault(id(t), t), lambda t: t):
        for layer, kind in enumerate(kinds):
            if (isinstance(kind, PositionalBias) and heads * length**2 <= FLEX_TABLE_ELEMENTS
                    and resolve_backend(config.attention_backend, kind, torch.device("cuda"),
                                        head_dim=config.head_dim) == "flex"):
                table = pe.score_bias(h, layer, 0, None).position_table(heads, length, "meta")
                tables[id(table)] = table
    kept = {**saved, **tables}.values()  # not the parameters: the state counts them
    return sum(t.numel() * t.element_size() for t in kept if not (t.is_leaf and t.requires_grad))


class FitClock(L.Callback):
    """Times one fit: step periods (CUDA events, or the CPU's clock, at each ``on_train_batch_start``), validation,
    diagnostics and checkpoint seconds (device synchronised), the steady steps' peak memory, Dynamo's counters at each
    phase's start, and on the host's clock (``time.monotonic``) the warm-up (compiling) and the steady phase. Stops
    the fit after the step that passes ``steady_budget`` seconds from the first steady step's start, however long
    compiling took, once a steady step was timed (a recompile in the first steady step still leaves one)."""

    def __init__(self, warmup: int, steady_budget: float, cuda: bool):
        self.warmup, self.steady_budget, self.cuda = warmup, steady_budget, cuda
        self.host: dict[str, float] = {}  # time.monotonic at the first step's start, the first steady step's, the end
        self.marks, self.counts, self.interrupted = [], {}, set()  # interrupted: marks whose period holds a validation
        self.validations: list[tuple[float, float, float]] = []  # (seconds, evaluation, diagnostics) of each
        self.diagnostics = self.checkpoint = 0.0
        self.train_peak, self.stopped, self.model, self.tokens, self.flops = None, False, None, 0, 0.0

    def now(self) -> float:
        if self.cuda:
            torch.cuda.synchronize()
        return time.perf_counter()

    def timed(self, fn, bucket: str):
        def run(*args, **kwargs):
            start = self.now()
            try:
                return fn(*args, **kwargs)
            finally:
                setattr(self, bucket, getattr(self, bucket) + self.now() - start)

        return run

    def setup(self, trainer, pl_module, stage):
        if self.model is not None:  # again for the fit's last validation (CableCLI.after_fit)
            return
        self.model, self.counts["start"] = pl_module, dynamo_counts()
        trainer.save_checkpoint = self.timed(trainer.save_checkpoint, "checkpoint")
        for callback in trainer.callbacks:  # every hook the diagnostics define, wherever their work moves
            if isinstance(callback, AttentionDiagnostics):
                for name in dir(type(callback)):
                    if name.startswith("on_") and getattr(type(callback), name) is not getattr(L.Callback, name, None):
                        setattr(callback, name, self.timed(getattr(callback, name), "diagnostics"))

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.host.setdefault("first step", time.monotonic())
        if len(self.marks) == self.warmup:
            self.host["steady"] = time.monotonic()
            self.counts["steady"] = dynamo_counts()
            if self.cuda:
                torch.cuda.reset_peak_memory_stats()
        if self.cuda:
            self.marks.append(torch.cuda.Event(enable_timing=True))
            self.marks[-1].record()
        else:
            self.marks.append(time.perf_counter())
        tokens = batch["tokens"] if isinstance(batch, dict) else batch
        self.tokens = tokens.shape[0] * (tokens.shape[1] - 1)
        self.flops = pl_module.backbone.training_flops_per_token(tokens.shape[1] - 1)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        timed = len(self.marks) >= self.warmup + 2  # the first steady step's period has closed
        if timed and time.monotonic() >= self.host["steady"] + self.steady_budget and not trainer.should_stop:
            trainer.should_stop, self.stopped = True, True

    def steady_done(self):
        """At the first validation (or the end of training): the steady steps' peak memory and counters."""
        if "validations" not in self.counts:
            self.host["end"] = time.monotonic()
            self.counts["validations"] = dynamo_counts()
            if self.cuda and len(self.marks) > self.warmup:
                self.train_peak = torch.cuda.max_memory_allocated()

    def on_train_end(self, trainer, pl_module):
        self.steady_done()

    def on_validation_start(self, trainer, pl_module):
        self.steady_done()
        if trainer.state.fn == "fit":  # inside fit: the period of the step before it is no steady step
            self.interrupted.add(len(self.marks) - 1)
        self.window = (self.now(), self.diagnostics, self.checkpoint)

    def on_validation_end(self, trainer, pl_module):
        start, diagnostics, checkpoint = self.window
        seconds, diagnostics = self.now() - start, self.diagnostics - diagnostics
        # the evaluation: what the validation spent besides the diagnostics and checkpoint saves
        self.validations.append((seconds, seconds - diagnostics - (self.checkpoint - checkpoint), diagnostics))

    def teardown(self, trainer, pl_module, stage):
        self.counts["end"] = dynamo_counts()

    def elapsed(self, first: int, last: int) -> float:
        if self.cuda:
            torch.cuda.synchronize()  # both events done
            return self.marks[first].elapsed_time(self.marks[last]) / 1000
        return self.marks[last] - self.marks[first]

    def steps(self) -> list[float]:
        """Seconds of each steady step: each period from a step's start to the next's, but one holding a
        validation."""
        return [self.elapsed(i, i + 1) for i in range(self.warmup, len(self.marks) - 1) if i not in self.interrupted]

    def compile_seconds(self) -> float | None:
        """The warm-up steps' host seconds, from the first step's start to the first steady step's."""
        return self.host["steady"] - self.host["first step"] if "steady" in self.host else None

    def steady_seconds(self) -> float | None:
        """From the first steady step's start to the first validation (or the end of training)."""
        return self.host["end"] - self.host["steady"] if "steady" in self.host and "end" in self.host else None

    def no_steps(self) -> str:
        """Why no steady step was timed (for a fit that did not fail)."""
        if len(self.marks) <= self.warmup:
            return f"no steady step: training ended after {len(self.marks)} of its {self.warmup} warm-up steps"
        if len(self.marks) == self.warmup + 1:
            return "no steady step: training ended in the first steady step, whose period never closed"
        return "no steady step: a validation fell in each steady step's period"

    def phase(self, key: str, first: str, last: str) -> int:
        """How much a counter grew from phase ``first``'s start to ``last``'s (a phase never reached: no growth)."""
        later = self.counts.get(last) or self.counts.get("end") or self.counts["start"]
        return later[key] - (self.counts.get(first) or later)[key]


class Report:
    """The results file: each line written and flushed as it comes, and echoed. Its first line, the heading, marks it
    as gpu-check's (``owned.FILE_MARKS``): a later run replaces it only with ``--overwrite``. Until its first row it is
    written beside ``path`` (``.<name>.partial``) and then renamed over it, so that an earlier file (a lent GPU's rows)
    stays whole when the new run stops before it has a row to show; closed before that, the partial file is removed."""

    def __init__(self, path: str, heading: str):
        folder, name = os.path.split(os.path.abspath(path))
        self.path, self.partial, self.placed = path, os.path.join(folder, f".{name}.partial"), False
        try:
            os.makedirs(folder, exist_ok=True)
            self.file = open(self.partial, "w", encoding="utf-8")
        except OSError as exc:
            raise ConfigError(f"--out {path} cannot be written ({type(exc).__name__}: {exc.strerror}); choose "
                              "another --out") from None
        self.line(heading)

    def close(self) -> None:
        self.file.close()
        if not self.placed:
            os.remove(self.partial)

    def kept(self) -> str:
        """What ``--out`` holds, for the line that ends a stopped run."""
        if self.placed:
            return f"the rows so far are in {self.path}"
        return (f"it had no row yet: the earlier {self.path} is kept as it was" if os.path.exists(self.path) else
                f"it had no row yet: nothing was written to {self.path}")

    def line(self, text: str = "") -> None:
        self.file.write(text + "\n")
        self.file.flush()
        print(f"[gpu-check] {text}", flush=True)

    def row(self, cells: list) -> None:
        """A result (a part's row, skipped or failed too): the first puts the file in ``path``'s place."""
        self.line(table_row(cells))
        if not self.placed:
            os.replace(self.partial, self.path)
            self.placed = True

    def table(self, head: list[str]) -> None:
        self.line()
        self.line(table_row(head))
        self.line("|" + "---|" * len(head))


def table_row(cells: list) -> str:
    return "| " + " | ".join(str(c) for c in cells) + " |"


@contextmanager
def stopped_by_signals(report_of):
    """SIGTERM (a scheduler's stop) and Ctrl-C end gpu-check in one line saying what ``--out`` holds (``report_of()``:
    the Report, None before it exists), with 128 + the signal's number. A stop inside a fit comes as the fit's own
    ``SIGTERMException`` (PreemptionCheckpoint), elsewhere from this handler (by default SIGTERM ended the process
    with nothing said), or the data's preparation's ``PrepareStopped``. The earlier handler is restored."""

    def stop(signum, frame):
        stopped = SIGTERMException()
        stopped.signum = signum
        raise stopped

    earlier = signal.signal(signal.SIGTERM, stop)
    try:
        yield
    except BaseException as exc:  # a stop carries its signal: SIGTERMException, a fit's prepare's PrepareStopped
        signum = getattr(exc, "signum", signal.SIGINT if isinstance(exc, KeyboardInterrupt) else None)
        if signum is None:
            raise
        report = report_of()
        said = report.kept() if report is not None else "nothing was written"
        print(f"error: gpu-check stopped by {signal.Signals(signum).name}; {said}", file=sys.stderr, flush=True)
        sys.exit(128 + signum)
    finally:
        signal.signal(signal.SIGTERM, earlier)


FIT_HEAD = ["part", "encoding", "backend", "steady steps", "step ms (median)", "tokens/s", "x NoPE", "MFU",
            "compile s (warm-up) / budget", "steady s / budget", "fit s (all)", "train peak GiB",
            "estimate GiB: state + activations + logits + tables", "Dynamo compiles: warm-up / steady / validations",
            "graph breaks", "first validation s", "evaluation s", "diagnostics s (x evaluation)", "checkpoint s",
            "note"]
PYTEST_HEAD = ["part", "command", "exit", "result", "s", "note"]


def gib(n: float | None) -> str:
    return "-" if n is None else f"{n / 2**30:.1f}"


def encoding_argument(label: str) -> str:
    """The CLI's value for an encoding label (``dape_v2+cable``: DAPEv2 over CABLE), as ``sweep`` passes it."""
    from .positional import from_label
    from .sweep import set_settings

    return json.dumps(set_settings(from_label(label).to_dict()))


def fit_arguments(sizes: Sizes, device: str, data: list[str], runs_dir: str, experiment: str) -> list[str]:
    """A fit's command line, complete without a config file (a pip install has no configs/). Its records go under
    ``runs_dir`` also without a logger (the rehearsal's), not into the working directory."""
    # validation after the steady steps, then one more step, then CableCLI's validation at the end of fit: the
    # first validation compiles, the second shows what a validation costs once compiled (the diagnostics at every
    # validation: their default schedule may skip the second, whose cost the row reports)
    steps = sizes.warmup + sizes.steady + 1
    shape = [arg for name, value in sizes.shape.items() for arg in (f"--model.init_args.backbone.{name}", str(value))]
    return ["fit", "--model.class_path", "cable_lightning.lit.CausalLM", "--model.init_args.compile", "true",
            "--model.init_args.backbone.preset", sizes.preset, *shape, *data,
            "--data.block_size", str(sizes.block), "--data.micro_batch_size", str(sizes.micro),
            "--data.eval_lengths", f"[{sizes.block}]", "--data.eval_tokens", str(sizes.micro * sizes.block),
            "--trainer.accelerator", device, "--trainer.devices", "1", "--trainer.precision", sizes.precision,
            "--trainer.max_steps", str(steps + 1), "--trainer.num_sanity_val_steps", "0",
            "--trainer.enable_progress_bar", "false", "--checkpoint.every_n_train_steps", str(steps),
            "--throughput.log_peak_memory", "false", "--diagnostics.budget", "null", "--seed_everything", "0",
            "--runs_dir", runs_dir, "--experiment", experiment,
            "--trainer.default_root_dir", os.path.join(runs_dir, experiment), *sizes.extra]


class Run:
    """One gpu-check: its report, device, recompile watch, NoPE's figures (the ratios' base) and what failed."""

    def __init__(self, args, sizes: Sizes, cuda: bool, report: Report):
        from . import bench

        self.args, self.sizes, self.cuda = args, sizes, cuda
        self.device = torch.device("cuda" if cuda else "cpu")
        self.report, self.watch = report, RecompileWatch()
        self.failures: list[str] = []
        self.nope_rate = self.nope_eval = None
        self.stamp = time.strftime("%Y%m%d-%H%M%S")
        try:
            self.peak, self.peak_source = bench.peak_flops(self.device, sizes.dtype)
        except ConfigError as exc:  # a GPU without a known peak: no MFU, everything else measured
            self.peak, self.peak_source = None, f"no peak ({exc})"

    def failed(self, cells: list, exc: Exception, width: int) -> None:
        exc = user_error(exc) or exc  # the user error a wrapper (jsonargparse's link) holds
        first = (str(exc).strip().splitlines() or [""])[0][:200]
        self.failures.append(f"{cells[0]} {cells[1]}: {type(exc).__name__}: {first}")
        self.report.row(cells + [f"failed: {type(exc).__name__}: {first}"] + [""] * (width - len(cells) - 1))

    def fit(self, part: str, label: str) -> None:
        from torch._dynamo.utils import counters

        from .cli import main

        args, sizes, backend, scale = self.args, self.sizes, backend_of(label), self.args.budget_scale
        data = (["--data.path", args.data_path] if args.data_path else
                ["--data.path", "data/pydocs-bpe4096", "--data.source", "python-docs", "--data.tokenizer", "bpe:4096"])
        clock = FitClock(sizes.warmup, STEADY_BUDGET_S * scale, self.cuda)
        torch._dynamo.reset()  # each fit compiles afresh: one fit's cache entries must not count against the next's
        counters.clear()
        hits, started = len(self.watch.hits), time.perf_counter()
        try:
            with warnings.catch_warnings():  # Lightning's note that this process's argv is not the fit's: it is not
                warnings.filterwarnings("ignore", message="LightningCLI's args parameter is intended")
                main([*fit_arguments(sizes, self.device.type, data, args.runs_dir, self.stamp),
                      "--model.init_args.backbone.pos_encoding", encoding_argument(label)], extra_callbacks=[clock])
        except Exception as exc:  # a fit that fails is a row; the other parts still run
            return self.failed([part, label, backend], exc, len(FIT_HEAD))
        finally:
            gc.collect()
            if self.cuda:
                torch.cuda.empty_cache()
        seconds = time.perf_counter() - started
        steps = clock.steps()
        step = statistics.median(steps) if steps else None
        rate = clock.tokens / step if step else None
        if label == "nope":
            self.nope_rate = rate
        compiled, steady = clock.compile_seconds(), clock.steady_seconds()
        notes = [] if steps else [clock.no_steps()]
        if compiled is not None and compiled > COMPILE_BUDGET_S * scale:
            notes.append(f"compiling took {compiled:.0f} s, past its {COMPILE_BUDGET_S * scale:.0f} s budget")
        if clock.stopped:
            notes.append(f"stopped at its {STEADY_BUDGET_S * scale:.0f} s steady budget")
        notes += [f"RECOMPILE LIMIT: {function} ({reason})" for function, reason in self.watch.hits[hits:]]
        estimate = memory_estimate(clock.model, sizes.micro, sizes.block)
        compiles = " / ".join(str(clock.phase("compiles", a, b)) for a, b in
                              (("start", "steady"), ("steady", "validations"), ("validations", "end")))
        first = clock.validations[0][0] if clock.validations else 0.0
        _, evaluation, diagnostics = clock.validations[-1] if clock.validations else (0.0, 0.0, 0.0)
        if len(clock.validations) < 2:
            notes.append("one validation: its evaluation and diagnostics include compiling")
        self.report.row([
            part, label, backend, len(steps), f"{step * 1000:.1f}" if step else "-", f"{rate:,.0f}" if rate else "-",
            f"{rate / self.nope_rate:.2f}" if rate and self.nope_rate else "-",
            f"{rate * clock.flops / self.peak:.1%}" if rate and self.peak else "-",
            f"{seconds_or_dash(compiled)} / {COMPILE_BUDGET_S * scale:.0f}",
            f"{seconds_or_dash(steady)} / {STEADY_BUDGET_S * scale:.0f}", f"{seconds:.1f}", gib(clock.train_peak),
            " + ".join(gib(term) for term in estimate) + f" = {gib(sum(estimate))}",
            compiles, clock.phase("graph_breaks", "start", "end"), f"{first:.3f}", f"{evaluation:.3f}",
            f"{diagnostics:.3f}" + (f" ({diagnostics / evaluation:.2f})" if evaluation > 0 else ""),
            f"{clock.checkpoint:.3f}", "; ".join(notes)])

    def bench(self, part: str, labels: list[str], head: list[str], deadline: float) -> None:
        """The bench's model-only evaluation at ``eval_length``, eager (the preset's vocabulary, as the bench's). The
        first forward, where FlexAttention compiles on CUDA, is timed apart; the timed forwards and the peak memory's
        reuse what it compiled (Dynamo's counts of each are in the row)."""
        from torch._dynamo.utils import counters

        from . import bench
        from .hardware import sync
        from .models import build_backbone

        sizes, dtype = self.sizes, self.sizes.dtype
        shape = argparse.Namespace(**{"preset": sizes.preset, "vocab_size": None, "n_layer": None, "n_head": None,
                                      "n_embd": None, **sizes.shape})
        budget = BENCH_COMPILE_BUDGET_S * self.args.budget_scale
        for label in labels:
            cells = [part, label, backend_of(label)]
            if time.monotonic() >= deadline:
                self.report.row(cells + ["skipped: its budget is spent"] + [""] * (len(head) - 4))
                continue
            try:
                torch._dynamo.reset()
                counters.clear()
                model = build_backbone(bench.make_config(shape, label, sizes.block)).to(self.device).eval()
                start = time.perf_counter()
                bench.eval_forward(model, sizes.eval_length, self.device, dtype)()  # FlexAttention compiles here
                sync(self.device)
                compiled, warm = time.perf_counter() - start, dynamo_counts()["compiles"]
                seconds = bench.eval_seconds(model, sizes.eval_length, self.device, dtype, sizes.repeats)
                mib = bench.eval_peak_mib(model, sizes.eval_length, self.device, dtype) if self.cuda else None
                timed = dynamo_counts()["compiles"] - warm
            except Exception as exc:
                self.failed(cells, exc, len(head))
                continue
            finally:
                model = None
                gc.collect()
                if self.cuda:
                    torch.cuda.empty_cache()
            if label == "nope":
                self.nope_eval = (seconds, mib)
            base_s, base_mib = self.nope_eval or (None, None)
            notes = ["CPU: no peak memory"] if mib is None else []
            if compiled > budget and backend_of(label) == "flex":
                notes.append(f"its first forward took {compiled:.0f} s, past its {budget:.0f} s compile budget")
            self.report.row(cells + [f"{compiled:.3f}", f"{seconds:.3f}", f"{seconds / base_s:.2f}" if base_s else "-",
                                     "-" if mib is None else f"{mib:,.0f}",
                                     f"{mib / base_mib:.2f}" if mib and base_mib else "-", f"{warm} / {timed}",
                                     "; ".join(notes)])

    def pytest(self, part: str, deadline: float) -> None:
        """``FLEX_TESTS`` in a child process from the source tree (the GPU machine carries it), stopped at its budget;
        the CPU rehearsal only collects them (their CUDA tests skip on a CPU, the rest take minutes)."""
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        command = [sys.executable, "-m", "pytest", "-q", *FLEX_TESTS] + (["--collect-only"] if not self.cuda else [])
        cells = [part, " ".join(FLEX_TESTS)]
        if time.monotonic() >= deadline:
            return self.report.row(cells + ["", "skipped: its budget is spent", "", ""])
        if not os.path.isfile(os.path.join(root, FLEX_TESTS[0])):
            return self.report.row(cells + ["", f"not run: no {FLEX_TESTS[0]} beside the package (a source tree has "
                                            "it)", "", ""])
        budget, started = PYTEST_BUDGET_S * self.args.budget_scale, time.perf_counter()
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
        try:
            done = subprocess.run(command, cwd=root, env=env, capture_output=True, text=True, timeout=budget)
            code, out = done.returncode, done.stdout
            notes = [] if self.cuda else ["CPU rehearsal: collected, not run"]
        except subprocess.TimeoutExpired as exc:
            out = exc.stdout.decode() if isinstance(exc.stdout, bytes) else exc.stdout or ""
            code, notes = "-", [f"stopped at its {budget:.0f} s budget"]
        result = (out.strip().splitlines() or ["(no output)"])[-1].strip()
        if code not in (0, "-"):
            self.failures.append(f"{part}: {' '.join(FLEX_TESTS)}: {result}")
        self.report.row(cells + [code, result, f"{time.perf_counter() - started:.1f}", "; ".join(notes)])


def seconds_or_dash(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds:.1f}"


def run_parts(args, parts: dict[str, list[str]], sizes: Sizes, cuda: bool, report: Report, started: float) -> Run:
    """The bench, the fits part by part and the tests, each a row of ``report`` (or a skipped one past its budget)."""
    run = Run(args, sizes, cuda, report)
    shape = ", ".join(f"{name} {value}" for name, value in sizes.shape.items())
    report.line()
    report.line(f"{sizes.preset}{f' ({shape})' if shape else ''} at {sizes.block} tokens, {sizes.micro} sequences a "
                f"step, {sizes.precision}, compile true, {sizes.warmup} warm-up and {sizes.steady} steady steps; MFU "
                f"against {run.peak_source}" + (f" ({run.peak / 1e12:.3g} TFLOP/s)" if run.peak else ""))
    scale, run_deadline = args.budget_scale, started + RUN_BUDGET_S * args.budget_scale
    with run.watch.watching(), (eager_dynamo() if args.rehearse_on_cpu else nullcontext()):
        # the bench first: bounded and cheap, so a fit that overruns cannot take the evaluation targets with it
        head = ["part", "encoding", "backend", "compile s (first forward)", f"eval s @{sizes.eval_length}", "x NoPE",
                f"eval peak MiB @{sizes.eval_length}", "x NoPE", "Dynamo compiles: first forward / timed", "note"]
        report.table(head)
        benched = [label for labels in parts.values() for label in labels if backend_of(label) != "chunked"]
        # NoPE on FlexAttention beside the flex encodings: how much of their time is the kernel's, how much the bias's
        benched = ["nope"] + ["nope:flex"] * any(backend_of(label) == "flex" for label in benched) + \
            [label for label in benched if label != "nope"]
        compiling = sum(backend_of(label) == "flex" for label in benched)
        run.bench("bench", benched, head,
                  min(time.monotonic() + (BENCH_BUDGET_S + BENCH_COMPILE_BUDGET_S * compiling) * scale, run_deadline))
        report.table(FIT_HEAD)
        for part, labels in parts.items():
            deadline = min(time.monotonic() + sum(map(fit_budget, labels)) * scale, run_deadline)
            for label in labels:
                if time.monotonic() < deadline:
                    run.fit(part, label)
                else:
                    report.row([part, label, backend_of(label), "skipped: its budget is spent"]
                               + [""] * (len(FIT_HEAD) - 4))
        report.table(PYTEST_HEAD)
        run.pytest("pytest", run_deadline)
        report.line()
        report.line(f"finished in {time.monotonic() - started:.0f} s")
    return run


def main(argv: list[str] | None = None) -> None:
    parser = ArgumentParser(prog="python -m cable_lightning gpu-check", description=__doc__,
                            formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="runs/gpu_check.md", help="the results, a Markdown row at a time")
    parser.add_argument("--overwrite", action="store_true", help="replace an --out file an earlier gpu-check wrote")
    parser.add_argument("--runs-dir", default="runs/gpu_check", help="the fits' runs (TensorBoard, checkpoints)")
    parser.add_argument("--data-path", help="a prepared data folder (default: the offline python-docs corpus with a "
                        "4096-token BPE, prepared on first use into data/pydocs-bpe4096)")
    parser.add_argument("--encodings", nargs="+", default=ENCODINGS, help="encoding labels (default: %(default)s)")
    parser.add_argument("--budget-scale", type=float, default=1.0,
                        help="multiplies every time budget (a slower GPU, or a longer loan)")
    parser.add_argument("--rehearse-on-cpu", action="store_true",
                        help="every part on the CPU at toy sizes, to check this command (not GPU figures)")
    args = parser.parse_args(argv)
    started, cuda = time.monotonic(), not args.rehearse_on_cpu
    if not args.budget_scale > 0:
        raise ConfigError(f"--budget-scale must be > 0, got {args.budget_scale}")
    if cuda and not torch.cuda.is_available():
        raise ConfigError("gpu-check needs a CUDA GPU and torch.cuda.is_available() is False here; "
                          "--rehearse-on-cpu runs its parts on the CPU at toy sizes")
    parts = parts_of(args.encodings)  # an unknown label: one line, before anything runs
    if args.rehearse_on_cpu:
        parts = {part: labels[:1] for part, labels in parts.items()}
    check_replaceable(args.out, "gpu-check", args.overwrite)  # an earlier GPU run's rows cannot be made again
    if args.data_path:  # every fit would fail on it, after the bench
        from .data.datamodule import TokenDataModule

        try:
            TokenDataModule(path=args.data_path).describe()
        except ConfigError as exc:
            raise type(exc)(f"--data-path {args.data_path}: {exc}") from None
    from .console import quiet_library_chatter

    quiet_library_chatter()
    sizes = REHEARSAL if args.rehearse_on_cpu else GPU
    device = torch.cuda.get_device_name() if cuda else "CPU rehearsal (not GPU figures)"
    report = None
    with stopped_by_signals(lambda: report):
        report = Report(args.out, f"## gpu-check: {device}, torch {torch.__version__}, {time.strftime('%Y-%m-%d')}")
        with closing(report):
            run = run_parts(args, parts, sizes, cuda, report, started)
    problems = [f"Dynamo hit its recompile limit in {function}: {reason}" for function, reason in run.watch.hits]
    if problems or run.failures:
        raise RunFailedError(f"gpu-check: {'; '.join(problems + run.failures)} (results so far in {args.out})")


if __name__ == "__main__":  # a verb's module: say which verb runs it, never exit 0 having done nothing
    from cable_lightning.verbs import replaced_entry_point

    replaced_entry_point(__spec__.name)
