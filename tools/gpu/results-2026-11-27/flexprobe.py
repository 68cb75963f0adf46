"""GPU probe: why a compiled block with FlexAttention fails inductor's shared-memory check on an H100 (gpu-check,
2026-11-27: kerple_log and fire fits, 'triton_tem_fused_flex_attention_0 Required: 245760 Hardware limit:232448').
Variant (argv[1]): 'dtypes' (eager forward, records q/k/v dtypes into _flex), 'opts' (compiled blocks, kernel_options
with smaller blocks and stages), 'cast' (compiled blocks, q/k/v cast to the autocast dtype before FlexAttention),
'default' (compiled blocks as they are), 'nope' (compiled blocks, NoPE, for the ratio)."""
import argparse
import json
import os
import sys
import time
import traceback

import torch

from cable_lightning import bench
from cable_lightning.models import attention, build_backbone

variant = sys.argv[1]
pe = sys.argv[2] if len(sys.argv) > 2 else "kerple_log"
REH = os.environ.get("REHEARSE") == "1"
DEV = torch.device("cpu" if REH else "cuda")
DTYPE = torch.bfloat16
shape = dict(preset="gpt2-tiny", n_layer=2, n_head=2, n_embd=32, vocab_size=512) if REH else \
    dict(preset="gpt2-small", n_layer=12, n_head=12, n_embd=768, vocab_size=4096)
T, ROWS = (64, 2) if REH else (1024, 16)
out = open(os.path.join(os.environ.get("OUT", "/tmp"), "flexprobe.jsonl"), "a")


def log(**row):
    line = json.dumps({"variant": variant, "pe": pe, **row}, default=str)
    print(line, flush=True)
    out.write(line + "\n")
    out.flush()


seen = []
OPTS = {"opts": {"BLOCK_M": 64, "BLOCK_N": 64, "num_stages": 2},
        "small": {"BLOCK_M": 32, "BLOCK_N": 32, "num_stages": 1}}.get(variant)


def probe_flex(q, k, v, bias, causal, q_offset, window=None, documents=None, block_mask=None):
    seen.append([str(q.dtype), str(k.dtype), str(v.dtype), list(q.shape)])
    tq, tk = q.shape[-2], k.shape[-2]
    if block_mask is None:
        block_mask = attention.flex_block_mask(tq, tk, q_offset, causal, window, documents, q.device)
    extent = bias.layout.extent if bias is not None and bias.layout is not None else tk
    score_mod = attention.flex_score_mod(bias, q.shape[1], extent, q.device)
    dtype = q.dtype
    if variant == "cast" and torch.is_autocast_enabled(q.device.type):
        low = torch.get_autocast_dtype(q.device.type)
        q, k, v = q.to(low), k.to(low), v.to(low)
    fn = attention.flex_kernel(q.device)
    kw = {"kernel_options": OPTS} if OPTS else {}
    return fn(q, k, v, score_mod=score_mod, block_mask=block_mask, **kw).to(dtype)


attention._flex = probe_flex
torch.manual_seed(0)
t0 = time.time()
try:
    cfg = bench.make_config(argparse.Namespace(**shape), "nope" if variant == "nope" else pe + ":flex", T)
    model = build_backbone(cfg).to(DEV)
    x = torch.randint(0, model.config.vocab_size, (ROWS, T + 1), device=DEV)
    if variant == "dtypes":
        with torch.no_grad(), torch.autocast(DEV.type, dtype=DTYPE):
            model.loss(x[:, :-1], x[:, 1:])
        log(seen=seen[:2], s=round(time.time() - t0, 1))
        sys.exit(0)
    model.compile_blocks()

    def step():
        with torch.autocast(DEV.type, dtype=DTYPE):
            loss = model.loss(x[:, :-1], x[:, 1:])
        if not REH:
            loss.backward()
        model.zero_grad(set_to_none=True)
        return loss

    w0 = time.time()
    for _ in range(2):
        loss = step()
    bench.sync(DEV)
    warm = time.time() - w0
    seconds = bench.timed(step, DEV, 1 if REH else 5)
    log(ok=True, opts=OPTS, seen=seen[:1], warmup_s=round(warm, 1), step_ms=round(seconds * 1000, 2),
        tok_s=round(ROWS * T / seconds), loss=float(loss), s=round(time.time() - t0, 1),
        peak_gib=round(torch.cuda.max_memory_allocated() / 2**30, 2) if not REH else None)
except Exception as err:  # noqa: BLE001
    log(ok=False, opts=OPTS, seen=seen[:1], error=repr(err)[:700], tb=traceback.format_exc()[-1200:],
        s=round(time.time() - t0, 1))
