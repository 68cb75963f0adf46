"""``python -m cable_lightning gpu-check``: what a lent GPU must show, in the minutes it is lent (docs/speed.md, "On a
GPU"). Each result is a Markdown table row, written to ``--out`` and flushed as it is produced, so a run cut short
keeps what finished. An existing ``--out`` is replaced only when gpu-check wrote it (its first line) and
``--overwrite`` is given: a GPU run's rows cannot be made again without a GPU.

1. Real fits through the CLI, one per encoding, grouped into one part per attention backend (the group each encoding
   takes on CUDA, from the registry and ``attention.backends_for``): gpt2-small shape, 1024 tokens, 16 sequences a
   step, bf16-mixed, ``compile: true``, 3 warm-up steps (compilation among them), 10 steady steps, a validation at
   1024 tokens with the default diagnostics and a checkpoint, one more step, and the validation that ends every fit
   (the first validation compiles; the second's costs are reported). A step's time is the interval between
   consecutive ``on_train_batch_start`` hooks measured with CUDA events: the whole period of a step, loading, hooks
   and logging included, the rate a fit trains at (from a step's start to its own end would leave the loop's work
   between steps out). Validation, diagnostics and checkpoint saves are timed apart with the device synchronised
   (phases of seconds, some on the host; events add nothing there). The row gives the median steady step, tokens/s,
   MFU (``bench.peak_flops``), the steady steps' peak memory beside its estimate, Dynamo's compiles in the warm-up,
   the steady steps (0 unless something recompiles) and the validations, and graph breaks.
2. ``bench`` (run first): the bench's model-only evaluation at 16,384 tokens (eager, bf16, one sequence): seconds
   and peak memory against NoPE, for every chosen encoding except those on the chunked path (no target, and the slow
   part that ran the first GPU measurement out of time).

Dynamo's warning that a function hit its recompile limit (it then runs that function eagerly for the rest of the
process) is caught by a handler on the ``torch._dynamo`` logger: the run goes on, then exits 1 with a line naming
the function. A part that fails is a row too; the run then exits 1.

The plan for one H100 or H200, compile included (not yet measured on a GPU): ``bench`` first, 36 s (an encoding that
would start after it is a "skipped" row); then each fit has 24 s (it stops training at its budget, keeping the steps
it timed; the validation that ends a fit still runs) and each part 24 s per fit (a fit that would start after it is
a "skipped" row): sdpa 48 s, fold 72 s, flex 72 s, chunked 72 s. 300 s, plus about 20 s to import and start;
nothing starts after 330 s, so the run ends near 5.5 minutes even when compiling takes longer than planned.

Peak memory: the peak of the steady steps (CUDA's peak statistics reset at the first steady step, read at the first
validation's start), beside an estimate of what a bf16-mixed AdamW step holds (:func:`memory_estimate`). The fits
pass ``--throughput.log_peak_memory false``: that callback resets the peak statistics at every step's end, which is
why the old ``tools/gpu_acceptance.py`` reported 1.6 GiB for a 16 x 1024 batch of an 88M-parameter model (by its code
and the arithmetic: it read the peak at the end of training, after the last reset, so the figure was the final
validation and checkpoint over the weights, gradients and AdamW state, 1.3 GiB, not a training step).

``--rehearse-on-cpu``: the same parts on the CPU at toy sizes (2 layers, 32 tokens, 1 warm-up and 2 steady steps),
the first encoding of each part only, CPU clocks for the events, Dynamo's ``eager`` backend for inductor (compiling
is the GPU's part; Dynamo's counters and the recompile watch still run); its figures are not GPU figures.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import logging
import os
import re
import statistics
import time
import warnings
from contextlib import closing, contextmanager, nullcontext

import lightning as L
import torch

from .callbacks import AttentionDiagnostics
from .errors import ArgumentParser, ConfigError, RunFailedError, user_error
from .owned import check_replaceable

# The choice (issue 47): three encodings per backend where there are three, NoPE (the baseline) first.
ENCODINGS = ["nope", "rope", "cable", "alibi", "fox", "kerple_log", "fire", "t5", "cope", "dape_v2+cable",
             "stick_breaking"]
FIT_BUDGET_S = 24.0  # a fit's, and its part's per fit
BENCH_BUDGET_S = 36.0
RUN_BUDGET_S = 330.0  # nothing starts after it: the fit then in flight and its last validation end the run


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


GPU = Sizes("gpt2-small", {}, block=1024, micro=16, warmup=3, steady=10, eval_length=16384, repeats=2,
            precision="bf16-mixed")
# fp32: a CPU without bf16 instructions runs bf16 many times slower (the bf16 matmul peak took 129 s to measure on
# the shared 2-core machine); no logger: TensorBoard figures take seconds of matplotlib a validation on 2 cores, and
# say nothing of the command.
REHEARSAL = Sizes("gpt2-tiny", {"n_layer": 2, "n_head": 2, "n_embd": 32}, block=32, micro=2, warmup=1, steady=2,
                  eval_length=128, repeats=1, precision="32-true", extra=("--trainer.logger", "false"))


def backend_of(label: str) -> str:
    """The attention backend ``auto`` takes for an encoding on CUDA in a causal model: the first that
    ``backends_for`` lists after ``auto`` (sdpa, fold, flex or chunked)."""
    from .models.attention import backends_for
    from .positional import from_label

    return backends_for(from_label(label).scores, causal=True)[1]


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


def memory_estimate(model, rows: int, length: int) -> tuple[float, float, float]:
    """Bytes a bf16-mixed AdamW training step peaks near: (state, activations, logits). State: fp32 weights, their
    gradients and AdamW's two moments, 16 bytes a parameter. Activations: 34 bytes per token, width and layer (what
    autograd keeps of a transformer layer with 16-bit activations and a fused attention kernel, no T x T term;
    Korthikanti et al. 2022). Logits: their bf16 values and fp32 log-softmax, kept for the backward, 6 bytes per token
    and vocabulary entry."""
    c, tokens = model.config, rows * length
    state = 16 * sum(p.numel() for p in model.parameters())
    return state, 34 * tokens * c.n_embd * c.n_layer, 6 * tokens * c.vocab_size


class FitClock(L.Callback):
    """Times one fit: step periods (CUDA events, or the CPU's clock, at each ``on_train_batch_start``), validation,
    diagnostics and checkpoint seconds (device synchronised), the steady steps' peak memory, Dynamo's counters at each
    phase's start; stops the fit after the step that passes ``deadline`` (``time.monotonic``)."""

    def __init__(self, warmup: int, deadline: float, cuda: bool):
        self.warmup, self.deadline, self.cuda = warmup, deadline, cuda
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
        if len(self.marks) == self.warmup:
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
        if time.monotonic() >= self.deadline and not trainer.should_stop:
            trainer.should_stop, self.stopped = True, True

    def steady_done(self):
        """At the first validation (or the end of training): the steady steps' peak memory and counters."""
        if "validations" not in self.counts:
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

    def warmup_seconds(self) -> float:
        return self.elapsed(0, self.warmup) if len(self.marks) > self.warmup else float("nan")

    def phase(self, key: str, first: str, last: str) -> int:
        """How much a counter grew from phase ``first``'s start to ``last``'s (a phase never reached: no growth)."""
        later = self.counts.get(last) or self.counts.get("end") or self.counts["start"]
        return later[key] - (self.counts.get(first) or later)[key]


class Report:
    """The results file: each line written and flushed as it comes, and echoed. Its first line, the heading, marks it
    as gpu-check's (``owned.FILE_MARKS``): a later run replaces it only with ``--overwrite``."""

    def __init__(self, path: str, heading: str):
        try:
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
            self.path, self.file = path, open(path, "w", encoding="utf-8")
        except OSError as exc:
            raise ConfigError(f"--out {path} cannot be written ({type(exc).__name__}: {exc.strerror}); choose "
                              "another --out") from None
        self.line(heading)

    def close(self) -> None:
        self.file.close()

    def line(self, text: str = "") -> None:
        self.file.write(text + "\n")
        self.file.flush()
        print(f"[gpu-check] {text}", flush=True)

    def row(self, cells: list) -> None:
        self.line("| " + " | ".join(str(c) for c in cells) + " |")

    def table(self, head: list[str]) -> None:
        self.line()
        self.row(head)
        self.line("|" + "---|" * len(head))


FIT_HEAD = ["part", "encoding", "backend", "steady steps", "step ms (median)", "tokens/s", "x NoPE", "MFU",
            "warm-up s (compile)", "fit s (all)", "train peak GiB", "estimate GiB: state + activations + logits",
            "Dynamo compiles: warm-up / steady / validations", "graph breaks", "first validation s",
            "evaluation s", "diagnostics s (x evaluation)", "checkpoint s", "note"]


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

    def fit(self, part: str, label: str, deadline: float) -> None:
        from torch._dynamo.utils import counters

        from .cli import main

        args, sizes, backend = self.args, self.sizes, backend_of(label)
        data = (["--data.path", args.data_path] if args.data_path else
                ["--data.path", "data/pydocs-bpe4096", "--data.source", "python-docs", "--data.tokenizer", "bpe:4096"])
        budget = FIT_BUDGET_S * args.budget_scale
        clock = FitClock(sizes.warmup, min(deadline, time.monotonic() + budget), self.cuda)
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
        notes = [f"stopped at its {budget:.0f} s budget"] if clock.stopped else []
        notes += [f"RECOMPILE LIMIT: {function} ({reason})" for function, reason in self.watch.hits[hits:]]
        state, activations, logits = memory_estimate(clock.model, sizes.micro, sizes.block)
        compiles = " / ".join(str(clock.phase("compiles", a, b)) for a, b in
                              (("start", "steady"), ("steady", "validations"), ("validations", "end")))
        first = clock.validations[0][0] if clock.validations else 0.0
        _, evaluation, diagnostics = clock.validations[-1] if clock.validations else (0.0, 0.0, 0.0)
        if len(clock.validations) < 2:
            notes.append("one validation: its evaluation and diagnostics include compiling")
        self.report.row([
            part, label, backend, len(steps), f"{step * 1000:.1f}" if step else "-", f"{rate:,.0f}" if rate else "-",
            f"{rate / self.nope_rate:.2f}" if rate and self.nope_rate else "-",
            f"{rate * clock.flops / self.peak:.1%}" if rate and self.peak else "-", f"{clock.warmup_seconds():.1f}",
            f"{seconds:.1f}", gib(clock.train_peak),
            f"{gib(state)} + {gib(activations)} + {gib(logits)} = {gib(state + activations + logits)}",
            compiles, clock.phase("graph_breaks", "start", "end"), f"{first:.3f}", f"{evaluation:.3f}",
            f"{diagnostics:.3f}" + (f" ({diagnostics / evaluation:.2f})" if evaluation > 0 else ""),
            f"{clock.checkpoint:.3f}", "; ".join(notes)])

    def bench(self, part: str, labels: list[str], head: list[str], deadline: float) -> None:
        """The bench's model-only evaluation at ``eval_length``, eager (the preset's vocabulary, as the bench's)."""
        from . import bench
        from .models import build_backbone

        sizes, dtype = self.sizes, self.sizes.dtype
        shape = argparse.Namespace(**{"preset": sizes.preset, "vocab_size": None, "n_layer": None, "n_head": None,
                                      "n_embd": None, **sizes.shape})
        for label in labels:
            cells = [part, label, backend_of(label)]
            if time.monotonic() >= deadline:
                self.report.row(cells + ["skipped: its budget is spent"] + [""] * (len(head) - 4))
                continue
            try:
                torch._dynamo.reset()
                model = build_backbone(bench.make_config(shape, label, sizes.block)).to(self.device).eval()
                seconds = bench.eval_seconds(model, sizes.eval_length, self.device, dtype, sizes.repeats)
                mib = bench.eval_peak_mib(model, sizes.eval_length, self.device, dtype) if self.cuda else None
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
            self.report.row(cells + [f"{seconds:.3f}", f"{seconds / base_s:.2f}" if base_s else "-",
                                     "-" if mib is None else f"{mib:,.0f}",
                                     f"{mib / base_mib:.2f}" if mib and base_mib else "-",
                                     "CPU: no peak memory" if mib is None else ""])


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
    report = Report(args.out, f"## gpu-check: {device}, torch {torch.__version__}, {time.strftime('%Y-%m-%d')}")
    run = Run(args, sizes, cuda, report)
    shape = ", ".join(f"{name} {value}" for name, value in sizes.shape.items())
    report.line()
    report.line(f"{sizes.preset}{f' ({shape})' if shape else ''} at {sizes.block} tokens, {sizes.micro} sequences a "
                f"step, {sizes.precision}, compile true, {sizes.warmup} warm-up and {sizes.steady} steady steps; MFU "
                f"against {run.peak_source}" + (f" ({run.peak / 1e12:.3g} TFLOP/s)" if run.peak else ""))
    scale, run_deadline = args.budget_scale, started + RUN_BUDGET_S * args.budget_scale
    with run.watch.watching(), (eager_dynamo() if args.rehearse_on_cpu else nullcontext()), closing(report):
        # the bench first: bounded and cheap, so a fit that overruns cannot take the evaluation targets with it
        head = ["part", "encoding", "backend", f"eval s @{sizes.eval_length}", "x NoPE",
                f"eval peak MiB @{sizes.eval_length}", "x NoPE", "note"]
        report.table(head)
        benched = [label for labels in parts.values() for label in labels if backend_of(label) != "chunked"]
        run.bench("bench", ["nope"] + [label for label in benched if label != "nope"], head,
                  min(time.monotonic() + BENCH_BUDGET_S * scale, run_deadline))
        report.table(FIT_HEAD)
        for part, labels in parts.items():
            deadline = min(time.monotonic() + FIT_BUDGET_S * scale * len(labels), run_deadline)
            for label in labels:
                if time.monotonic() < deadline:
                    run.fit(part, label, deadline)
                else:
                    report.row([part, label, backend_of(label), "skipped: its budget is spent"]
                               + [""] * (len(FIT_HEAD) - 4))
        report.line()
        report.line(f"finished in {time.monotonic() - started:.0f} s")
    problems = [f"Dynamo hit its recompile limit in {function}: {reason}" for function, reason in run.watch.hits]
    if problems or run.failures:
        raise RunFailedError(f"gpu-check: {'; '.join(problems + run.failures)} (results so far in {args.out})")


if __name__ == "__main__":  # a verb's module: say which verb runs it, never exit 0 having done nothing
    from cable_lightning.verbs import replaced_entry_point

    replaced_entry_point(__spec__.name)
