"""``--loop_overhead``: a fit's training step over the bare step of the same module, shape and batch, both timed in
this process by one clock: what Lightning's loop, the data stream, the callbacks and logging add to a step."""

from __future__ import annotations

import statistics

import torch

from ..positional import ENCODING_FLAG
from ..timing import BareStep, StepClock, step_periods


def loop_overhead(data_path: str, pe: str = "cable", steps: int = 40, warmup: int = 10, repeats: int = 40,
                  shape: tuple[int, int, int] = (2, 4, 128), block_size: int = 128, batch: int = 8,
                  compile: bool = False) -> dict:
    """The fit runs through the CLI (LitData's stream of ``data_path``, Lightning's loop, the project's callbacks
    and logging, no validation inside the steps timed); the bare step (:class:`timing.BareStep`) is the fit's module
    on one fixed batch with the fit's loss, precision, accumulation, clipping and optimizer, read from its trainer and
    module. Both are medians of :class:`timing.StepClock` periods after ``warmup`` steps (``repeats`` bare steps), so
    the fit's step also counts the gap to the next batch (loading, callbacks). With ``compile``, both run the compiled
    blocks, and ``warmup_s`` (the fit's first ``warmup`` steps) holds the compilation."""
    import tempfile

    from ..cli import main as cli_main

    n_layer, n_head, n_embd = shape
    clock = StepClock()
    with tempfile.TemporaryDirectory() as runs:
        cli = cli_main(["fit", "--model", "cable_lightning.lit.CausalLM",
                        ENCODING_FLAG, pe,
                        "--model.init_args.backbone.n_layer", str(n_layer),
                        "--model.init_args.backbone.n_head", str(n_head),
                        "--model.init_args.backbone.n_embd", str(n_embd),
                        "--data.path", data_path, "--data.block_size", str(block_size),
                        "--data.micro_batch_size", str(batch), "--data.eval_lengths", f"[{block_size}]",
                        "--trainer.max_steps", str(steps), "--trainer.val_check_interval", str(steps),
                        "--trainer.num_sanity_val_steps", "0", "--trainer.enable_progress_bar", "false",
                        "--checkpoint.every_n_train_steps", str(steps), "--runs_dir", runs,
                        "--experiment", "loop_overhead", "--model.init_args.compile", str(compile).lower()],
                       extra_callbacks=[clock])
    fit_step = statistics.median(clock.periods(warmup))
    step = BareStep(cli.model, cli.trainer, batch, block_size)
    bare_step = statistics.median(step_periods(step, warmup, repeats, step.device))
    return {"pe": pe, "shape": shape, "block_size": block_size, "batch": batch, "compile": compile,
            "gradient_clip": step.clip, "warmup_s": clock.elapsed(0, warmup), "fit_step_s": fit_step,
            "bare_step_s": bare_step, "ratio": fit_step / bare_step, "fit_steps_timed": len(clock.periods(warmup)),
            "threads": torch.get_num_threads(), "device": str(step.device)}


def summary(result: dict) -> str:
    """The line the verb prints."""
    return (f"loop overhead ({result['pe']}, layers/heads/width {result['shape']}, {result['batch']} x "
            f"{result['block_size']} tokens, {result['threads']} threads, compile {result['compile']}): fit step "
            f"{result['fit_step_s'] * 1e3:.1f} ms, bare step {result['bare_step_s'] * 1e3:.1f} ms, ratio "
            f"{result['ratio']:.3f}; the fit's first steps {result['warmup_s']:.1f} s")
