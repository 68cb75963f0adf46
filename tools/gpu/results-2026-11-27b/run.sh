#!/usr/bin/env bash
# A prepared GPU run: the project's own `gpu-check` verb (docs/speed.md's targets), then the first run's model-only bench
# comparison at the same shape (NoPE, kerple_log, CABLE, Hugging Face GPT-2 as the peer; then NoPE's bare compiled
# step with fused AdamW, and FIRE, if time is left), then the epoch-boundary resume check. One script, under 520 s of wall time, each part with its own `timeout`, every result line written to
# a file under $OUT as it is produced (at most 8 files come back: this writes 5).
#
# On the device machine, from the root of a copy of the project, with `.whl` (bash ../shared/gpu/fetch_wheels.sh)
# and `data/pydocs-bpe4096` (python -m cable_lightning prepare) prepared here and carried, and this file copied into
# the git-ignored .whl/ so that it travels with the wheels:
#     device run, carry [".whl", "data/pydocs-bpe4096"], timeout_s 590:   bash .whl/run.sh
# From a folder that holds a copy of the project at cl/ (carried whole, its .whl and data inside):
#     device run, carry ["cl"]:   PROJECT=cl bash run.sh
#
# CPU rehearsal (every step at toy sizes, to prove that each command line parses and each file is written; no GPU
# figures): REHEARSE=1 PY=<python of a virtualenv installed from the lock> [OUT=<folder>] bash run.sh
#
# Knobs (environment): GC_ENCODINGS, GC_SCALE (gpu-check's --encodings and --budget-scale), BENCH_PES, TOTAL_S (the
# wall-time cap, 520), SITE (where the wheels go, /tmp/site), RUNS (the fits' run folders, outside $OUT).
#
# Why not gpu-check's defaults (11 encodings, --budget-scale 1, planned at 5.5 min): a fit's 24 s budget starts before
# the CLI builds the model and includes inductor's compilation on a fresh machine's cold cache (the first GPU run's
# compiled CABLE fit took 19 s longer than the eager one); a fit whose budget runs out in its warm-up steps times no
# steady step. So: 8 encodings, one or more per target of docs/speed.md (rope, dape_v2+cable and stick_breaking left
# out), each budget x1.75 (a fit 42 s, the bench 63 s); fits end at their 15 steps well before a budget when compiling
# is quick, and the outer timeout, not the verb's run deadline (578 s at x1.75), ends the run if it is slow (the
# chunked part, last, is then the part lost).
set -uo pipefail

REHEARSE=${REHEARSE:-0}
START_DIR=$PWD
cd "${PROJECT:-.}" || { echo "error: no project folder ${PROJECT:-.}"; exit 2; }
if [ "$REHEARSE" = 1 ]; then
    PY=${PY:-python3}
    OUT=${OUT:-$(mktemp -d -t run3-out.XXXXXX)}
    WORK=$(mktemp -d -t run3-work.XXXXXX)
    SITE=${SITE:-$WORK/site}
    RUNS=${RUNS:-$WORK/runs}
else
    PY=${PY:-python3}
    : "${OUT:?OUT must name the folder whose files come back}"
    WORK=$(mktemp -d -t run3-work.XXXXXX)
    SITE=${SITE:-/tmp/site}
    RUNS=${RUNS:-/tmp/run3-runs}
fi
mkdir -p "$OUT" "$RUNS"
GC_ENCODINGS=${GC_ENCODINGS:-nope kerple_log t5 cope dape_v2+cable stick_breaking cable}
GC_SCALE=${GC_SCALE:-1}
BENCH_PES=${BENCH_PES:-}
if [ "$REHEARSE" = 1 ]; then TOTAL_S=${TOTAL_S:-1200}; else TOTAL_S=${TOTAL_S:-530}; fi
export OUT REHEARSE BENCH_PES
T0=$(date +%s)
elapsed() { echo $(( $(date +%s) - T0 )); }
el() { echo "=== $1 at +$(elapsed)s"; }
# cap C R: a part's timeout, at most C seconds and leaving R seconds of TOTAL_S for the parts after it
cap() { local left=$(( TOTAL_S - $(elapsed) - $2 )); [ "$left" -lt "$1" ] && echo "$left" || echo "$1"; }

main() {
    el "start (rehearse=$REHEARSE, project $(pwd | sed "s|^$HOME|~|"), python $PY, OUT $OUT)"
    git log --oneline -1 2>/dev/null || echo "(no git log: the copy has no .git)"

    el "wheels"
    local whl=""
    for d in "${WHL:-}" .whl "$START_DIR/.whl"; do
        if [ -n "$d" ] && compgen -G "$d/*.whl" >/dev/null; then whl=$d; break; fi
    done
    if [ -n "$whl" ]; then
        echo "$(ls "$whl"/*.whl | wc -l) wheels in $whl ($(du -sh "$whl" | cut -f1)), into $SITE"
        # the device's Python is 3.12, the wheels' (multiprocess ships one wheel per Python); a rehearsal on another
        # Python installs them as for 3.12 and leaves them off the path (its imports are the virtualenv's)
        local as312=()
        "$PY" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 12))' || as312=(--python-version 3.12
            --implementation cp --only-binary=:all:)
        timeout 120 "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
            "${as312[@]}" --target "$SITE" "$whl"/*.whl && echo "installed $(ls "$SITE" | wc -l) entries" \
            || echo "WHEELS FAILED (rc $?)"
        [ ${#as312[@]} -gt 0 ] && { echo "(not Python 3.12: the wheels stay off PYTHONPATH)"; SITE=$WORK/none; }
    else
        echo "NO WHEELS (.whl/*.whl): the packages the image lacks will not import"
    fi
    export PYTHONPATH="$SITE:$PWD" PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
    [ -f data/pydocs-bpe4096/manifest.json ] || { echo "NO DATA: data/pydocs-bpe4096 was not carried"; return 2; }

    el "env"
    command -v nvidia-smi >/dev/null && timeout 20 nvidia-smi \
        --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv
    timeout 90 "$PY" "$WORK/env3.py" || { echo "IMPORTS FAILED: nothing else can run"; return 1; }

    local t
    el "gpu-check"
    t=$(cap 490 0)
    local rehearse_flag=()
    [ "$REHEARSE" = 1 ] && rehearse_flag=(--rehearse-on-cpu)
    echo "timeout ${t}s; encodings: $GC_ENCODINGS; budget scale $GC_SCALE"
    # shellcheck disable=SC2086
    timeout -k 20 "$t" "$PY" -m cable_lightning gpu-check "${rehearse_flag[@]}" --data-path data/pydocs-bpe4096 \
        --out "$OUT/gpu_check.md" --runs-dir "$RUNS/gpu_check" --budget-scale "$GC_SCALE" --encodings $GC_ENCODINGS \
        2>&1 | tee "$OUT/gpu_check-console.txt" \
        | grep --line-buffered -E '^\[gpu-check\]|^error|Error|Traceback|RECOMPILE|hit config'
    echo "gpu-check rc ${PIPESTATUS[0]} (124: its timeout; 1: a failed part or a recompile-limit hit)"

    el "bench (the first run's model-only comparison)"
    t=$(cap 0 210)
    if [ "$t" -ge 30 ]; then
        timeout -k 10 "$t" "$PY" "$WORK/bench3.py" 2>&1 | grep -v -E 'UserWarning|warnings.warn'
        echo "bench rc ${PIPESTATUS[0]} (124: its timeout ${t}s)"
    else
        echo "SKIPPED: ${t}s left"
    fi

    el "epoch-boundary resume (plain: eager, fp32 as configured)"
    t=$(cap 90 120)
    if [ "$t" -ge 30 ]; then
        EPOCH_VARIANT=plain timeout -k 10 "$t" "$PY" "$WORK/epoch3.py" 2>&1 | tee -a "$OUT/epoch3.txt"
        echo "epoch check rc ${PIPESTATUS[0]} (124: its timeout ${t}s)"
    else
        echo "SKIPPED: ${t}s left"
    fi
    el "epoch-boundary resume (accumulation 2, compile, bf16-mixed)"
    t=$(cap 120 0)
    if [ "$t" -ge 40 ]; then
        EPOCH_VARIANT=accum timeout -k 10 "$t" "$PY" "$WORK/epoch3.py" 2>&1 | tee -a "$OUT/epoch3.txt"
        echo "epoch check rc ${PIPESTATUS[0]} (124: its timeout ${t}s)"
    else
        echo "SKIPPED: ${t}s left"
    fi
    el "done"
    ls -la "$OUT"
}

# ---------------------------------------------------------------------------------------------------------------
cat > "$WORK/env3.py" <<'EOF'
"""The device, torch, and every package the runs import: version and where it came from (the carried wheels
or the image)."""
import importlib
import os
import sys

import torch

site = (os.environ.get("PYTHONPATH") or "").split(":")[0]
print(f"python {sys.version.split()[0]}, torch {torch.__version__} (CUDA {torch.version.cuda}), "
      f"cuda available {torch.cuda.is_available()}")
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    print(f"device: {p.name}, {p.total_memory / 2**30:.1f} GiB, capability {p.major}.{p.minor}, "
          f"{p.multi_processor_count} SMs")
missing = []
for name in ["litdata", "jsonargparse", "docstring_parser", "typeshed_client", "datasets", "dill", "multiprocess",
             "boto3", "botocore", "s3transfer", "jmespath", "obstore", "lightning", "torchmetrics", "tensorboard",
             "transformers", "tokenizers", "tiktoken", "matplotlib", "scipy", "numpy", "yaml", "pyarrow",
             "huggingface_hub", "fsspec", "safetensors"]:
    try:
        module = importlib.import_module(name)
    except Exception as err:  # noqa: BLE001 - every failure is a line
        missing.append(name)
        print(f"IMPORT FAILED {name}: {type(err).__name__}: {str(err).splitlines()[0][:200] if str(err) else ''}")
        continue
    where = "carried" if site and (getattr(module, "__file__", "") or "").startswith(site) else "image"
    print(f"  {name} {getattr(module, '__version__', '?')} ({where})")
import cable_lightning.cli  # noqa: E402,F401 - what fit, gpu-check and the epoch check import
import cable_lightning.gpu_check  # noqa: E402,F401
from cable_lightning import bench  # noqa: E402

device = torch.device("cuda" if torch.cuda.is_available() and os.environ.get("REHEARSE") != "1" else "cpu")
if device.type == "cuda":
    flops, source = bench.peak_flops(device)
    print(f"MFU peak: {flops / 1e12:.1f} TFLOP/s ({source})")
print(f"cable_lightning imports: ok, from {os.path.dirname(cable_lightning.cli.__file__)}"
      + (f"; missing: {' '.join(missing)}" if missing else ""))
EOF

cat > "$WORK/bench3.py" <<'EOF'
"""The first GPU run's model-only comparison (its probe.py bench part) on this code: the bench's own functions,
forward + backward of one step, eager model (FlexAttention compiled inside, as the bench runs it), bf16 autocast,
gpt2-small shape (12 layers, 12 heads, width 768, the preset's vocabulary 50257), 1024 tokens, 16 sequences a step,
median of 3 after a warm-up; evaluation at 16384 tokens (the first run's 4096 left out: each length compiles
FlexAttention again); Hugging Face's GPT2LMHeadModel with SDPA as the peer. Two rows the first run did not have:
``bare``, NoPE's whole training step as a fit runs it but without Lightning (compiled blocks, fused AdamW, clipping by
the measured norm; compare its step with gpu-check's NoPE fit step: the loop's overhead on a GPU), and ``fire``
(its position table is built eagerly here, as in a fit without compile). Each row is a JSON line in
$OUT/bench3.jsonl, written as it comes, with its ratio to NoPE now and in the first run."""
import argparse
import contextlib
import json
import os
import time
import traceback

import torch
from torch._dynamo.utils import counters

from cable_lightning import bench
from cable_lightning.gpu_check import backend_of, eager_dynamo
from cable_lightning.lit.optim import build_optimizer
from cable_lightning.models import build_backbone

OUT, REHEARSE = os.environ["OUT"], os.environ.get("REHEARSE") == "1"
# The first run (2026-11-26, one NVIDIA H200, torch 2.11.0+cu130, tools/gpu/results-2026-11-26/run1-probe.jsonl)
BEFORE = {"nope": 224169, "cable": 186325, "kerple_log": 6674, "hf": 150100}
if REHEARSE:  # toy sizes on the CPU: proves the script, not a figure
    DEV, DTYPE = torch.device("cpu"), torch.float32
    SHAPE = dict(preset="gpt2-tiny", n_layer=2, n_head=2, n_embd=32, vocab_size=512)
    TRAIN_LEN, TOKENS, EVAL_LENS, REPEATS = 64, 128, [128], 1
else:
    DEV, DTYPE = torch.device("cuda"), torch.bfloat16
    SHAPE = dict(preset="gpt2-small", n_layer=12, n_head=12, n_embd=768, vocab_size=None)
    TRAIN_LEN, TOKENS, EVAL_LENS, REPEATS = 1024, 16384, [16384], 3
CUDA = DEV.type == "cuda"
ROWS = max(1, TOKENS // TRAIN_LEN)
rates = {}


def emit(row):
    line = json.dumps({"part": "bench3", **row}, default=str)
    print(line, flush=True)
    with open(os.path.join(OUT, "bench3.jsonl"), "a") as f:
        f.write(line + "\n")


def done(row, t0):
    pe, rate = row["pe"], row.get("train_tok_s")
    if rate:
        rates[pe] = rate
        if "nope" in rates:
            row["x_nope"] = round(rate / rates["nope"], 3)
        if pe in BEFORE:
            row["x_nope_first_run_h200"] = round(BEFORE[pe] / BEFORE["nope"], 3)
    row["wall_s"] = round(time.time() - t0, 1)
    emit(row)
    if CUDA:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def new_backbone(pe):
    torch.manual_seed(0)
    return build_backbone(bench.make_config(argparse.Namespace(**SHAPE), pe, TRAIN_LEN)).to(DEV)


def backbone_row(pe, peak):
    t0, row = time.time(), {"pe": pe, "cuda_backend": backend_of(pe)}
    try:
        frames = counters["frames"]["ok"]
        model = new_backbone(pe)
        rate = bench.train_tokens_per_second(model, TRAIN_LEN, TOKENS, DEV, DTYPE, REPEATS)
        row.update(train_tok_s=round(rate), mfu=round(rate * model.training_flops_per_token(TRAIN_LEN) / peak, 4),
                   dynamo_frames_in_training=counters["frames"]["ok"] - frames)
        if CUDA:
            row["train_peak_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
        model.eval()
        for t in EVAL_LENS:
            try:
                row[f"eval_s@{t}"] = round(bench.eval_seconds(model, t, DEV, DTYPE, REPEATS), 4)
                if CUDA:
                    row[f"eval_mib@{t}"] = round(bench.eval_peak_mib(model, t, DEV, DTYPE))
            except Exception as err:  # noqa: BLE001 - OOM or otherwise: a cell
                row[f"eval@{t}"] = repr(err)[:200]
        del model
    except Exception as err:  # noqa: BLE001 - a row, and the next encoding runs
        row["error"] = repr(err)[:600]
        row["tb"] = traceback.format_exc()[-1500:]
    done(row, t0)


def bare_row(peak):
    """NoPE's training step without Lightning: compiled blocks (Backbone.compile_blocks), the fit's fused AdamW,
    clipping at 1.0 by the norm measured once (CausalLM.on_before_optimizer_step / configure_gradient_clipping)."""
    t0, row = time.time(), {"pe": "bare", "what": "nope, compiled blocks + fused AdamW + clipping, no Lightning"}
    try:
        model = new_backbone("nope")
        with eager_dynamo() if REHEARSE else contextlib.nullcontext():  # the rehearsal: Dynamo without inductor
            model.compile_blocks()
        optimizer = build_optimizer(model, 6e-4, 6e-5, 10, 1000, (0.9, 0.95), 1e-8, 0.1)["optimizer"]
        x = torch.randint(0, model.config.vocab_size, (ROWS, TRAIN_LEN + 1), device=DEV)

        def step():
            with torch.autocast(DEV.type, dtype=DTYPE, enabled=DTYPE != torch.float32):
                loss = model.loss(x[:, :-1], x[:, 1:])
            loss.backward()
            params = [p for p in model.parameters() if p.grad is not None]
            norm = torch.nn.utils.get_total_norm([p.grad for p in params], 2.0)
            torch.nn.utils.clip_grads_with_norm_(params, 1.0, norm)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

        start = time.time()
        for _ in range(3):  # compilation, then the optimizer's state
            step()
        bench.sync(DEV)
        row["warmup_s"] = round(time.time() - start, 1)
        seconds = bench.timed(step, DEV, max(REPEATS, 5))
        rate = ROWS * TRAIN_LEN / seconds
        row.update(step_ms=round(seconds * 1000, 2), train_tok_s=round(rate),
                   mfu=round(rate * model.training_flops_per_token(TRAIN_LEN) / peak, 4))
        del model, optimizer
    except Exception as err:  # noqa: BLE001
        row["error"] = repr(err)[:600]
        row["tb"] = traceback.format_exc()[-1500:]
    done(row, t0)


def hf_row(peak):
    t0, row = time.time(), {"pe": "hf", "what": "Hugging Face GPT2LMHeadModel, SDPA (a peer)"}
    try:
        from transformers import GPT2Config, GPT2LMHeadModel

        cfg = GPT2Config(n_positions=TRAIN_LEN, vocab_size=SHAPE["vocab_size"] or 50257, n_embd=SHAPE["n_embd"],
                         n_layer=SHAPE["n_layer"], n_head=SHAPE["n_head"])
        cfg._attn_implementation = "sdpa"
        model = GPT2LMHeadModel(cfg).to(DEV)
        x = torch.randint(0, cfg.vocab_size, (ROWS, TRAIN_LEN), device=DEV)

        def step():
            with torch.autocast(DEV.type, dtype=DTYPE, enabled=DTYPE != torch.float32):
                loss = model(input_ids=x, labels=x).loss
            loss.backward()
            model.zero_grad(set_to_none=True)

        seconds = bench.timed(step, DEV, REPEATS)
        n = sum(p.numel() for p in model.parameters())
        row.update(train_tok_s=round(ROWS * TRAIN_LEN / seconds), params=n,
                   mfu_6N_only=round(6 * n * ROWS * TRAIN_LEN / seconds / peak, 4),
                   attn=getattr(model.config, "_attn_implementation", "?"))
        del model
    except Exception as err:  # noqa: BLE001
        row["error"] = repr(err)[:600]
    done(row, t0)


peak, source = bench.peak_flops(DEV, DTYPE)
emit({"pe": "meta", "device": torch.cuda.get_device_name() if CUDA else "cpu (rehearsal)", "torch": torch.__version__,
      "shape": SHAPE, "train_len": TRAIN_LEN, "tokens_per_step": TOKENS, "repeats": REPEATS, "dtype": str(DTYPE),
      "peak_tflops": round(peak / 1e12, 1), "peak_source": source, "first_run_h200_tok_s": BEFORE})
for pe in os.environ.get("BENCH_PES", "nope kerple_log cable hf bare fire").split():
    {"hf": hf_row, "bare": bare_row}.get(pe, lambda peak: backbone_row(pe, peak))(peak)
EOF

cat > "$WORK/epoch3.py" <<'EOF'
"""Resume exactness across an epoch boundary (as docs/faults.md promises, on the device's GPU), through
the CLI only: a 34-step fit of a 1-layer model (1024-token blocks, 16 a step: about 29 steps an epoch on the
quickstart corpus) with a checkpoint every 15 steps, then a resume from step 15 in a second run folder. Prints the
gap (resumed loss - uninterrupted loss, TensorBoard's train/loss, logged every step) at each step, and the largest
before and from the first step of the second epoch. The first GPU run saw 0 before it and 0.067 at it."""
import glob
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

accelerator = "cpu" if os.environ.get("REHEARSE") == "1" else "cuda"
root = tempfile.mkdtemp(prefix="epoch3-")
common = ["--config", "configs/quickstart.yaml", "--trainer.accelerator", accelerator,
          "--model.init_args.backbone.n_layer", "1", "--model.init_args.backbone.n_head", "2",
          "--model.init_args.backbone.n_embd", "32", "--data.path", "data/pydocs-bpe4096",
          "--data.block_size", "1024", "--data.micro_batch_size", "16", "--data.eval_lengths", "[1024]",
          "--data.eval_tokens", "2048", "--trainer.max_steps", "34", "--trainer.log_every_n_steps", "1",
          "--checkpoint.every_n_train_steps", "15", "--trainer.enable_progress_bar", "false",
          "--diagnostics.enabled", "false"]
variant = os.environ.get("EPOCH_VARIANT", "plain")
if variant == "accum":  # the long run's path: accumulation, compiled blocks, bf16 (fp32 on the CPU rehearsal)
    common += ["--trainer.accumulate_grad_batches", "2", "--model.init_args.compile", "true",
               "--trainer.precision", "32-true" if accelerator == "cpu" else "bf16-mixed"]
print(f"variant {variant}: {' '.join(common[2:])}", flush=True)


def fit(runs, extra):
    t0 = time.time()
    done = subprocess.run([sys.executable, "-m", "cable_lightning", "fit", *common, "--runs_dir", runs,
                           "--experiment", "e", *extra], capture_output=True, text=True)
    print(f"fit {os.path.basename(runs)}: rc {done.returncode}, {time.time() - t0:.1f} s", flush=True)
    if done.returncode != 0:
        print((done.stderr or done.stdout)[-3000:], flush=True)
        sys.exit(f"fit failed: {(done.stderr or done.stdout).strip().splitlines()[-1]}")


def scalars(runs, tag):
    out = {}
    for path in glob.glob(os.path.join(runs, "**", "events.out.tfevents.*"), recursive=True):
        acc = EventAccumulator(path, size_guidance={"scalars": 0})
        acc.Reload()
        if tag in acc.Tags()["scalars"]:
            out.update({e.step: e.value for e in acc.Scalars(tag)})
    return out


try:
    whole_dir, resumed_dir = os.path.join(root, "whole"), os.path.join(root, "resumed")
    fit(whole_dir, [])
    ckpt = glob.glob(os.path.join(whole_dir, "**", "step0000015.ckpt"), recursive=True)
    if not ckpt:
        sys.exit("no step-15 checkpoint")
    fit(resumed_dir, ["--ckpt_path", ckpt[0]])
    whole, resumed = scalars(whole_dir, "train/loss"), scalars(resumed_dir, "train/loss")
    epochs = scalars(whole_dir, "epoch")
    boundary = min((s for s, e in epochs.items() if e >= 1), default=None)
    steps = sorted(s for s in resumed if s in whole and s >= 15)
    if not steps:
        sys.exit(f"no common logged steps (whole {sorted(whole)[:5]}..., resumed {sorted(resumed)[:5]}...)")
    gaps = {s: resumed[s] - whole[s] for s in steps}
    print("GAPS", json.dumps({str(s): round(g, 6) for s, g in gaps.items()}))
    before = [abs(g) for s, g in gaps.items() if boundary is None or s < boundary]
    after = [abs(g) for s, g in gaps.items() if boundary is not None and s >= boundary]
    print(f"RESULT ({accelerator}, {variant}): first step of epoch 1 (as logged) {boundary}; max |gap| before it "
          f"{max(before, default=float('nan')):.3g} over {len(before)} steps, from it on "
          f"{max(after, default=float('nan')):.3g} over {len(after)} steps")
finally:
    shutil.rmtree(root, ignore_errors=True)
EOF

main 2>&1 | tee -a "$OUT/run3-log.txt"
rc=${PIPESTATUS[0]}
rm -rf "$WORK"
exit "$rc"
