"""The fit part: a real fit through the CLI per encoding, its steps timed by :class:`FitClock`, and its row."""

from __future__ import annotations

import gc
import json
import os
import statistics
import time
import warnings

import lightning as L
import torch

from ..callbacks import AttentionDiagnostics
from ..positional import ENCODING_FLAG
from ..timing import StepClock, synced_time
from .bare import bare_seconds, ratio_cell
from .dynamo import dynamo_counts
from .memory import memory_estimate
from .plan import COMPILE_BUDGET_S, STEADY_BUDGET_S, Sizes, backend_of
from .rows import gib, seconds_or_dash
from .targets import GPT2_VOCAB, LLMC_RATE, PAPER_RATE, target_of, widened

FIT_HEAD = ["part", "encoding", "backend", "vocab", "steady steps", "step ms (median)", "bare step ms",
            "fit / bare step", "tokens/s", "x NoPE", "MFU",
            "x paper 238k / llm.c 460k", "target", "compile s (warm-up) / budget", "steady s / budget",
            "fit s (all)", "train peak GiB", "estimate GiB: state + activations + logits + tables",
            "Dynamo compiles: warm-up / steady / validations", "graph breaks", "first validation s", "evaluation s",
            "diagnostics s (x evaluation)", "checkpoint s", "note"]


class FitClock(StepClock):
    """Times one fit: step periods (:class:`timing.StepClock`'s marks at each ``on_train_batch_start``), validation,
    diagnostics and checkpoint seconds (device synchronised), the steady steps' peak memory, Dynamo's counters at each
    phase's start, and on the host's clock (``time.monotonic``) the warm-up (compiling) and the steady phase. Stops
    the fit after the step that passes ``steady_budget`` seconds from the first steady step's start, however long
    compiling took, once a steady step was timed (a recompile in the first steady step still leaves one)."""

    def __init__(self, warmup: int, steady_budget: float, device: torch.device):
        super().__init__(device)
        self.warmup, self.steady_budget = warmup, steady_budget
        self.host: dict[str, float] = {}  # time.monotonic at the first step's start, the first steady step's, the end
        self.counts, self.interrupted = {}, set()  # interrupted: marks whose period holds a validation
        self.validations: list[tuple[float, float, float]] = []  # (seconds, evaluation, diagnostics) of each
        self.diagnostics = self.checkpoint = 0.0
        self.train_peak, self.stopped, self.model, self.tokens, self.flops = None, False, None, 0, 0.0

    def now(self) -> float:
        return synced_time(self.device)

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
        self.mark()
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

    def steps(self) -> list[float]:
        """Seconds of each steady step: each period from a step's start to the next's, but one holding a
        validation."""
        return [seconds for i, seconds in enumerate(self.periods(self.warmup), self.warmup)
                if i not in self.interrupted]

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


def encoding_argument(label: str) -> str:
    """The CLI's value for an encoding label (``dape_v2+cable``: DAPEv2 over CABLE), as ``sweep`` passes it."""
    from ..positional import from_label
    from ..sweep import set_settings

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


def shape_data(run, shape: str) -> list[str]:
    """A fit's data arguments: the prepared folder (``--data_path``, else the offline python-docs corpus, prepared on
    first use), or for the paper's shape that folder widened to GPT-2's vocabulary (:func:`targets.widened`, made once
    a run under ``--runs_dir``)."""
    args = run.args
    prepared = args.data_path or "data/pydocs-bpe4096"
    data = (["--data.path", args.data_path] if args.data_path else
            ["--data.path", prepared, "--data.source", "python-docs", "--data.tokenizer", "bpe:4096"])
    if shape == "prepared":
        return data
    if run.widened is None:
        if not args.data_path:  # prepared here as the CLI would for a prepared-data fit
            from ..data.datamodule import TokenDataModule
            from ..run_setup import prepare_first

            prepare_first(TokenDataModule(path=prepared, source="python-docs", tokenizer="bpe:4096"))
        run.widened = widened(prepared, os.path.join(args.runs_dir, f"data-vocab{GPT2_VOCAB}"))
    return ["--data.path", run.widened]


def fit(run, part: str, label: str, shape: str = "prepared") -> None:
    """``Run.fit``: a fit of ``label`` at ``shape`` (``targets.SHAPES``) through the CLI, timed by a
    :class:`FitClock`, and its row in ``run.report``."""
    from torch._dynamo.utils import counters

    from ..cli import main

    args, sizes, backend, scale = run.args, run.sizes, backend_of(label), run.args.budget_scale
    clock = FitClock(sizes.warmup, STEADY_BUDGET_S * scale, run.device)
    torch._dynamo.reset()  # each fit compiles afresh: one fit's cache entries must not count against the next's
    counters.clear()
    hits, started = len(run.watch.hits), time.perf_counter()
    vocab = GPT2_VOCAB if shape == "gpt2-vocab" else "-"
    try:
        data = shape_data(run, shape)
        with warnings.catch_warnings():  # Lightning's note that this process's argv is not the fit's: it is not
            warnings.filterwarnings("ignore", message="LightningCLI's args parameter is intended")
            experiment = run.stamp if shape == "prepared" else f"{run.stamp}-{shape}"  # a run folder per shape
            main([*fit_arguments(sizes, run.device.type, data, args.runs_dir, experiment),
                  ENCODING_FLAG, encoding_argument(label)], extra_callbacks=[clock])
    except Exception as exc:  # a fit that fails is a row; the other parts still run
        return run.failed([part, label, backend, vocab], exc, len(FIT_HEAD))
    finally:
        gc.collect()
        if run.cuda:
            torch.cuda.empty_cache()
    seconds = time.perf_counter() - started
    steps = clock.steps()
    step = statistics.median(steps) if steps else None
    bare = None
    if step:  # the bare step beside it, on the fit's own compiled model
        try:
            bare, bare_compiles = bare_seconds(clock.model, sizes)
        except Exception as exc:  # its failure fails the run, and the fit's row still comes
            bare_failed = f"{type(exc).__name__}: {(str(exc).strip().splitlines() or [''])[0][:200]}"
            run.failures.append(f"{part} {label}: the bare step: {bare_failed}")
        finally:
            gc.collect()
            if run.cuda:
                torch.cuda.empty_cache()
    rate = clock.tokens / step if step else None
    if label == "nope":
        run.nope_rate[shape] = rate
    base = run.nope_rate.get(shape)
    x_nope = rate / base if rate and base else None
    mfu = rate * clock.flops / run.peak if rate and run.peak else None
    target = target_of(label, backend) if shape == "gpt2-vocab" else None
    compiled, steady = clock.compile_seconds(), clock.steady_seconds()
    notes = [] if steps else [clock.no_steps()]
    if compiled is not None and compiled > COMPILE_BUDGET_S * scale:
        notes.append(f"compiling took {compiled:.0f} s, past its {COMPILE_BUDGET_S * scale:.0f} s budget")
    if step and bare is None:
        notes.append(f"the bare step failed: {bare_failed}")
    elif bare is not None and bare_compiles:
        notes.append(f"the bare step compiled {bare_compiles} more times")
    if clock.stopped:
        notes.append(f"stopped at its {STEADY_BUDGET_S * scale:.0f} s steady budget")
    notes += [f"RECOMPILE LIMIT: {function} ({reason})" for function, reason in run.watch.hits[hits:]]
    estimate = memory_estimate(clock.model, sizes.micro, sizes.block)
    compiles = " / ".join(str(clock.phase("compiles", a, b)) for a, b in
                          (("start", "steady"), ("steady", "validations"), ("validations", "end")))
    first = clock.validations[0][0] if clock.validations else 0.0
    _, evaluation, diagnostics = clock.validations[-1] if clock.validations else (0.0, 0.0, 0.0)
    if len(clock.validations) < 2:
        notes.append("one validation: its evaluation and diagnostics include compiling")
    run.report.row([
        part, label, backend, clock.model.config.vocab_size, len(steps), f"{step * 1000:.1f}" if step else "-",
        f"{bare * 1000:.1f}" if bare else "-", ratio_cell(step, bare),
        f"{rate:,.0f}" if rate else "-", f"{x_nope:.2f}" if x_nope else "-", f"{mfu:.1%}" if mfu else "-",
        f"{rate / PAPER_RATE:.2f} / {rate / LLMC_RATE:.2f}" if rate and shape == "gpt2-vocab" else "-",
        target.verdict(mfu, rate, x_nope) if target else "-",
        f"{seconds_or_dash(compiled)} / {COMPILE_BUDGET_S * scale:.0f}",
        f"{seconds_or_dash(steady)} / {STEADY_BUDGET_S * scale:.0f}", f"{seconds:.1f}", gib(clock.train_peak),
        " + ".join(gib(term) for term in estimate) + f" = {gib(sum(estimate))}",
        compiles, clock.phase("graph_breaks", "start", "end"), f"{first:.3f}", f"{evaluation:.3f}",
        f"{diagnostics:.3f}" + (f" ({diagnostics / evaluation:.2f})" if evaluation > 0 else ""),
        f"{clock.checkpoint:.3f}", "; ".join(notes)])
