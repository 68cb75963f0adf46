"""``python -m cable_lightning gpu-check``: on one CUDA GPU, timed bf16 compiled fits of every attention backend, their
recompiles and memory, and the evaluation at 16,384 tokens, within ``--time_budget`` seconds. docs/speed.md ("On a
GPU") tells the plan whole: the parts, their budgets, how steps, memory and compiles are measured.

Each result is a Markdown table row, written to ``--out`` and flushed as it is produced, so a run cut short keeps what
finished; an existing ``--out`` is replaced only when gpu-check wrote it and ``--overwrite`` is given, and only once
the new run has written its first row. The parts: ``bench`` first (the model-only evaluation at 16,384 tokens against
NoPE); then real fits through the CLI, one per encoding, grouped by attention backend, at each of ``--shapes`` (the
paper's GPT-2 vocabulary first, with its targets), each followed by its bare step without Lightning; then ``pytest``
(FlexAttention's values and gradients on CUDA). Compiling has budgets of its own (``plan.*_BUDGET_S``), so a slow
compile costs time but never the steady steps; nothing starts after the plan's last start. A part that fails is a row
too, and a function that hits Dynamo's recompile limit is named; either ends the run with exit 1, SIGTERM or Ctrl-C
in one line saying what ``--out`` holds. ``--rehearse_on_cpu``: the same parts on the CPU at toy sizes, Dynamo's
``eager`` backend for inductor; its figures are not GPU figures.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from contextlib import closing, nullcontext

import torch

from ..errors import ArgumentParser, ConfigError, RunFailedError, user_error
from ..owned import check_replaceable
from . import evaluation, fits
from .dynamo import RecompileWatch, eager_dynamo
from .fits import FIT_HEAD
from .plan import (
    BENCH_BUDGET_S,
    BENCH_COMPILE_BUDGET_S,
    ENCODINGS,
    FLEX_TESTS,
    GPU,
    PYTEST_BUDGET_S,
    REHEARSAL,
    RUN_BUDGET_S,
    Sizes,
    backend_of,
    fit_budget,
    parts_of,
)
from .rows import Report, stopped_by_signals
from .targets import GPT2_VOCAB, LLMC_RATE, PAPER_RATE, SHAPES

PYTEST_HEAD = ["part", "command", "exit", "result", "s", "note"]


class Run:
    """One gpu-check: its report, device, recompile watch, NoPE's figures (the ratios' base) and what failed."""

    def __init__(self, args, sizes: Sizes, cuda: bool, report: Report):
        from ..hardware import peak_flops

        self.args, self.sizes, self.cuda = args, sizes, cuda
        self.device = torch.device("cuda" if cuda else "cpu")
        self.report, self.watch = report, RecompileWatch()
        self.failures: list[str] = []
        self.nope_rate, self.nope_eval, self.widened = {}, None, None  # NoPE's tokens/s at each shape
        self.stamp = time.strftime("%Y%m%d-%H%M%S")
        try:
            self.peak, self.peak_source = peak_flops(self.device, sizes.dtype)
        except ConfigError as exc:  # a GPU without a known peak: no MFU, everything else measured
            self.peak, self.peak_source = None, f"no peak ({exc})"

    def failed(self, cells: list, exc: Exception, width: int) -> None:
        exc = user_error(exc) or exc  # the user error a wrapper (jsonargparse's link) holds
        first = (str(exc).strip().splitlines() or [""])[0][:200]
        self.failures.append(f"{cells[0]} {cells[1]}: {type(exc).__name__}: {first}")
        self.report.row(cells + [f"failed: {type(exc).__name__}: {first}"] + [""] * (width - len(cells) - 1))

    fit = fits.fit
    bench = evaluation.bench

    def pytest(self, part: str, deadline: float) -> None:
        """``FLEX_TESTS`` in a child process from the source tree (the GPU machine carries it), stopped at its budget;
        the CPU rehearsal only collects them (their CUDA tests skip on a CPU, the rest take minutes)."""
        root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the source tree
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



def run_parts(args, parts: dict[str, list[str]], sizes: Sizes, cuda: bool, report: Report, started: float) -> Run:
    """The bench, the fits part by part and the tests, each a row of ``report`` (or a skipped one past its budget)."""
    run = Run(args, sizes, cuda, report)
    shape = ", ".join(f"{name} {value}" for name, value in sizes.shape.items())
    report.line()
    report.line(f"{sizes.preset}{f' ({shape})' if shape else ''} at {sizes.block} tokens, {sizes.micro} sequences a "
                f"step, {sizes.precision}, compile true, {sizes.warmup} warm-up and {sizes.steady} steady steps; MFU "
                f"against {run.peak_source}" + (f" ({run.peak / 1e12:.3g} TFLOP/s)" if run.peak else ""))
    scale, run_deadline = args.budget_scale, started + args.time_budget
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
        report.line()
        report.line(f"{SHAPES['gpt2-vocab']}: GPT-2's {GPT2_VOCAB}-entry vocabulary over the prepared ids (the paper's "
                    f"shape: {PAPER_RATE / 1e3:.0f}k tokens/s a GPU in the paper, about {LLMC_RATE / 1e3:.0f}k in "
                    "llm.c), with their targets; fit: the prepared data's own vocabulary")
        report.table(FIT_HEAD)
        for part, labels in parts.items():  # each backend's part at each shape, the paper's first
            for shape in args.shapes:
                named = part.replace("fit", SHAPES[shape], 1)
                deadline = min(time.monotonic() + sum(map(fit_budget, labels)) * scale, run_deadline)
                for label in labels:
                    if time.monotonic() < deadline:
                        run.fit(named, label, shape)
                    else:
                        vocab = GPT2_VOCAB if shape == "gpt2-vocab" else "-"
                        report.row([named, label, backend_of(label), vocab, "skipped: its budget is spent"]
                                   + [""] * (len(FIT_HEAD) - 5))
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
    parser.add_argument("--runs_dir", default="runs/gpu_check", help="the fits' runs (TensorBoard, checkpoints)")
    parser.add_argument("--data_path", help="a prepared data folder (default: the offline python-docs corpus with a "
                        "4096-token BPE, prepared on first use into data/pydocs-bpe4096)")
    parser.add_argument("--encodings", nargs="+", default=ENCODINGS, help="encoding labels (default: %(default)s)")
    parser.add_argument("--shapes", nargs="+", choices=list(SHAPES), default=list(SHAPES),
                        help="the fits' shapes: GPT-2's vocabulary (the paper's, with their targets) and the "
                        "prepared data's own (default: %(default)s)")
    parser.add_argument("--time_budget", type=float, default=None, metavar="SECONDS",
                        help=f"nothing starts after this many seconds from the start (default: {RUN_BUDGET_S:.0f} x "
                        "--budget_scale; a run ends within one fit of it)")
    parser.add_argument("--budget_scale", type=float, default=1.0,
                        help="multiplies every part's time budget (a slower GPU, or a longer time budget)")
    parser.add_argument("--rehearse_on_cpu", action="store_true",
                        help="every part on the CPU at toy sizes, to check this command (not GPU figures)")
    args = parser.parse_args(argv)
    args.shapes = list(dict.fromkeys(args.shapes))  # each shape once
    started, cuda = time.monotonic(), not args.rehearse_on_cpu
    if not args.budget_scale > 0:
        raise ConfigError(f"--budget_scale must be > 0, got {args.budget_scale}")
    if args.time_budget is None:
        args.time_budget = RUN_BUDGET_S * args.budget_scale
    if not args.time_budget > 0:
        raise ConfigError(f"--time_budget must be > 0 seconds, got {args.time_budget}")
    if cuda and not torch.cuda.is_available():
        raise ConfigError("gpu-check needs a CUDA GPU and torch.cuda.is_available() is False here; "
                          "--rehearse_on_cpu runs its parts on the CPU at toy sizes")
    parts = parts_of(args.encodings)  # an unknown label: one line, before anything runs
    if args.rehearse_on_cpu:
        parts = {part: labels[:1] for part, labels in parts.items()}
    check_replaceable(args.out, "gpu-check", args.overwrite)  # an earlier GPU run's rows cannot be made again
    if args.data_path:  # every fit would fail on it, after the bench
        from ..data.datamodule import TokenDataModule

        try:
            TokenDataModule(path=args.data_path).describe()
        except ConfigError as exc:
            raise type(exc)(f"--data_path {args.data_path}: {exc}") from None
    from ..console import quiet_library_chatter

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
