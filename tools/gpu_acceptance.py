"""The GPU acceptance run: one command for whoever has a CUDA GPU, sized for about 10 minutes on one H100 (not yet
timed on one), that runs what the CPU test suite cannot and writes the "Measured on a GPU" tables (docs/speed.md)
with the device named.

    python tools/gpu_acceptance.py --out runs/gpu_acceptance.md

1. the CUDA-only tests (FlexAttention's gradients) with the fold's precision tests;
2. short bf16-mixed fits (gpt2-small shape at 1024 tokens on the offline corpus, prepared on first use) of nope, cable,
   alibi, fox, kerple_log, rope, dape_v2+cable and cope, each with compile off and on: tokens/s, MFU against the
   device's datasheet bf16 peak, peak memory, final training loss;
3. FSDP2 (configs/trainer/fsdp8_bf16.yaml on one device): a fit, and a resume from its middle checkpoint whose losses
   must equal the fit's;
4. evaluation peak memory and time at 4096, 8192 and 15360 tokens (the bench verb's measurement).

Without CUDA it stops at once with one line: its CPU counterparts are in the test suite (tests/test_fsdp.py,
tests/test_precision.py, tests/test_configs.py).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
ENCODINGS = ["nope", "cable", "alibi", "fox", "kerple_log", "rope", "dape_v2+cable", "cope"]
EVAL_LENGTHS = [4096, 8192, 15360]


def require_cuda() -> None:
    from cable_lightning.errors import ConfigError

    if not torch.cuda.is_available():
        raise ConfigError("tools/gpu_acceptance.py needs a CUDA GPU and torch.cuda.is_available() is False here; "
                          "on CPU the test suite runs its counterparts (python -m pytest tests/test_fsdp.py "
                          "tests/test_precision.py tests/test_configs.py)")


def make_clock(warmup: int):
    """A Lightning callback: tokens/s over the optimizer steps after ``warmup`` (compilation happens in the first; the
    loss read each step syncs the device), model FLOPs per token, CUDA peak memory from then on, and every step's
    training loss."""
    import lightning as L

    class StepClock(L.Callback):
        def __init__(self):
            self.start, self.tokens, self.losses, self.flops_per_token = None, 0, {}, 0.0

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            self.losses[trainer.global_step] = float(outputs["loss"])  # a host sync
            if trainer.global_step == warmup:
                self.start, self.tokens = time.perf_counter(), 0
                if torch.cuda.is_available():
                    torch.cuda.reset_peak_memory_stats()
            elif self.start is not None:
                tokens = batch["tokens"] if isinstance(batch, dict) else batch
                self.tokens += tokens[:, :-1].numel()
                self.flops_per_token = pl_module.backbone.training_flops_per_token(tokens.shape[1] - 1)

        def on_train_end(self, trainer, pl_module):
            self.seconds = time.perf_counter() - self.start
            self.peak_mib = torch.cuda.max_memory_allocated() / 2**20 if torch.cuda.is_available() else None

    return StepClock()


def fit_with_clock(common: list[str], extra: list[str], warmup: int):
    """A fit through the project's CLI with the clock in its Trainer's callbacks."""
    from cable_lightning.cli import CableCLI, LanguageModel, TerseParser, TokenDataModule

    clock = make_clock(warmup)

    class ClockedCLI(CableCLI):
        def instantiate_trainer(self, **kwargs):
            trainer = super().instantiate_trainer(**kwargs)
            trainer.callbacks.append(clock)
            return trainer

    ClockedCLI(LanguageModel, TokenDataModule, subclass_mode_model=True, args=["fit", *common, *extra],
               save_config_kwargs={"overwrite": True}, parser_class=TerseParser)
    return clock


def run_tests() -> str:
    """The tests that need CUDA or check what it changes (FlexAttention's gradients, the fold against fp64 and in
    bf16); their summary line."""
    done = subprocess.run([sys.executable, "-m", "pytest", "tests", "-q", "-k", "flex or fold", "-p",
                           "no:cacheprovider"], capture_output=True, text=True, cwd=ROOT)
    return done.stdout.strip().splitlines()[-1] if done.stdout.strip() else f"exit {done.returncode}"


def sizes(rehearse: bool) -> dict:
    """The fits' shape: gpt2-small at 1024 tokens on a GPU; a toy one in the CPU rehearsal."""
    if rehearse:
        return dict(n_layer=2, n_head=2, n_embd=64, block=64, micro=4, steps=8, warmup=2, preset="gpt2-tiny",
                    bench_train=[64], bench_eval=[128, 256])
    return dict(n_layer=12, n_head=12, n_embd=768, block=1024, micro=16, steps=40, warmup=5, preset="gpt2-small",
                bench_train=[1024], bench_eval=EVAL_LENGTHS)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="runs/gpu_acceptance.md", help="the Markdown tables are written here")
    parser.add_argument("--runs-dir", default="runs/gpu_acceptance")
    parser.add_argument("--data-path", help="an already prepared data folder (default: the offline corpus of "
                        "configs/quickstart.yaml, prepared on first use)")
    parser.add_argument("--rehearse-on-cpu", action="store_true",
                        help="run every step on the CPU at toy sizes, to check this command itself (no CUDA tests; "
                        "its figures are not GPU figures)")
    args = parser.parse_args(argv)
    if not args.rehearse_on_cpu:
        require_cuda()
    from cable_lightning import bench

    size, cuda = sizes(args.rehearse_on_cpu), not args.rehearse_on_cpu
    device = torch.device("cuda" if cuda else "cpu")
    name = torch.cuda.get_device_name(device) if cuda else "CPU rehearsal (not GPU figures)"
    peak, peak_source = bench.peak_flops(device, torch.bfloat16)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    lines = [f"## Measured on a GPU: {name}", "",
             f"{time.strftime('%Y-%m-%d')}, torch {torch.__version__}, `python tools/gpu_acceptance.py`; MFU against "
             f"the {peak_source} ({peak / 1e12:.3g} TFLOP/s)", ""]

    print("1/4 CUDA-only tests", flush=True)
    lines += [f"`python -m pytest tests -q -k \"flex or fold\"`: {run_tests() if cuda else 'not run (no CUDA)'}", ""]

    print("2/4 bf16 fits, compile off and on", flush=True)
    data = (["--data.path", args.data_path, "--data.source", "null", "--data.tokenizer", "null"] if args.data_path
            else [])
    common = ["--config", os.path.join(ROOT, "configs", "quickstart.yaml"), *data,
              "--trainer.accelerator", device.type, "--trainer.devices", "1", "--trainer.precision", "bf16-mixed",
              "--model.init_args.backbone.n_layer", str(size["n_layer"]),
              "--model.init_args.backbone.n_head", str(size["n_head"]),
              "--model.init_args.backbone.n_embd", str(size["n_embd"]), "--data.block_size", str(size["block"]),
              "--data.micro_batch_size", str(size["micro"]), "--data.eval_lengths", f"[{size['block']}]",
              "--data.eval_tokens", str(16 * size["block"]), "--trainer.max_steps", str(size["steps"]),
              "--checkpoint.every_n_train_steps", str(size["steps"]), "--trainer.enable_progress_bar", "false",
              "--runs_dir", args.runs_dir]
    lines += ["| encoding | compile | tokens/s | MFU | peak memory GiB | final loss |", "|---|---|---|---|---|---|"]
    for pe in ENCODINGS:
        for compiled in ("false", "true"):
            # dape_v2's default base is cable
            clock = fit_with_clock(common, ["--model.init_args.backbone.pos_encoding", pe.partition("+")[0],
                                            "--model.init_args.compile", compiled,
                                            "--experiment", f"{stamp}-compile-{compiled}"], size["warmup"])
            rate = clock.tokens / clock.seconds
            mfu = f"{rate * clock.flops_per_token / peak:.1%}"
            lines.append(f"| {pe} | {compiled} | {rate:,.0f} | {mfu} | {fmt_gib(clock.peak_mib)} | "
                         f"{clock.losses[max(clock.losses)]:.3f} |")
            print(lines[-1], flush=True)
    lines.append("")

    print("3/4 FSDP2 fit and resume on one device", flush=True)
    middle = size["steps"] // 2
    fsdp = [*common, "--config", os.path.join(ROOT, "configs", "trainer", "fsdp8_bf16.yaml"),
            "--trainer.accelerator", device.type, "--trainer.devices", "1", "--experiment", f"{stamp}-fsdp",
            "--checkpoint.every_n_train_steps", str(middle)]
    whole = fit_with_clock(fsdp, [], size["warmup"])
    checkpoint = os.path.join(args.runs_dir, f"{stamp}-fsdp", "cable", "checkpoints", f"step{middle:07d}.ckpt")
    resumed = fit_with_clock(fsdp, ["--ckpt_path", checkpoint], middle + 1)
    gap = max(abs(resumed.losses[s] - whole.losses[s]) for s in resumed.losses)
    lines += [f"FSDP2 on one device: {size['steps']} steps at {whole.tokens / whole.seconds:,.0f} tokens/s, peak "
              f"memory {fmt_gib(whole.peak_mib)} GiB; resumed from step {middle}, the losses of the later steps are "
              + ("equal to the uninterrupted run's" if gap == 0 else f"at most {gap:.1e} from the uninterrupted run's "
                 "(CUDA kernels need not be deterministic)"), ""]
    print(lines[-2], flush=True)

    print("4/4 evaluation time and memory", flush=True)
    result = bench.run(argparse.Namespace(
        preset=size["preset"], n_layer=None, n_head=None, n_embd=None, vocab_size=None, pes=ENCODINGS,
        naive_max_length=8192, train_lengths=size["bench_train"], eval_lengths=size["bench_eval"],
        tokens_per_step=16 * size["bench_train"][0], repeats=3, device=device.type, dtype="bf16",
        skip_memory=not cuda, padded_batch=0, padded_longest=512))
    lines += [f"{size['preset']} shape, bf16, evaluation batch 1 (python -m cable_lightning bench):", "",
              bench.table(result), ""]

    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        f.write("\n".join(lines) + "\n")
    print(f"tables written to {args.out} (paste them into docs/speed.md, section On a GPU)", flush=True)


def fmt_gib(mib: float | None) -> str:
    return "-" if mib is None else f"{mib / 1024:.1f}"


if __name__ == "__main__":
    sys.path.insert(0, ROOT)
    from cable_lightning.errors import error_boundary

    with error_boundary():
        main()
