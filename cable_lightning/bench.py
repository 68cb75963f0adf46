"""Speed and memory of every positional encoding on one backbone shape.

Per PE: training step (forward + backward) tokens/s at several lengths, evaluation forward
seconds and peak memory at longer lengths, each with its ratio to ``nope`` measured in the same
process. On CPU, peak memory is the peak RSS of a fresh spawned process that runs one evaluation
(so one PE's allocations cannot hide another's); on CUDA it is ``max_memory_allocated``.

MFU (model FLOPs utilisation) of each training step: its model FLOPs (``Backbone.training_flops_per_token``, 6 per
parameter plus the attention matmuls) per second over a peak (:func:`cable_lightning.hardware.peak_flops`): on CUDA
the device's datasheet dense bf16 peak (a GPU the project's table lacks: a bf16 matmul measured in this process), on
CPU the best rate of a 1024 x 1024 matmul in the benchmark's dtype (``--dtype``: fp32, or bf16 under autocast) measured
in this process with its threads, before and after the PEs (a CPU has no datasheet figure that its threads reach; on a
machine shared with other jobs both measurements move with the load, so MFU is noisier than tokens/s). Both the fp32
and the bf16 peak are measured and printed, so the table shows what each precision can reach on this CPU.

``--peers``: transformers' own models at the same shape (:mod:`cable_lightning.peers`: GPT-2 against ``learnable``,
GPT-NeoX or Llama against ``rope``), each training step timed in turns with the project's in this process, and their
ratio. ``--compile``: each encoding's training step with its blocks compiled (``compile: true``) against eager, the
compile time apart from the steady steps, and the steps a fit needs to pay the compile back.

    python -m cable_lightning bench --preset gpt2-tiny --n_layer 2 --pes cable alibi nope --json bench.json
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import multiprocessing as mp
import platform
import statistics
import time

import lightning as L
import torch
import torch.nn.functional as F

from cable_lightning.errors import ArgumentParser
from cable_lightning.eval.tables import markdown_table
from cable_lightning.hardware import cpu_matmul_peaks, peak_flops, sync
from cable_lightning.models import BackboneConfig, build_backbone
from cable_lightning.models.attention import FLEX_MIN_HEAD_DIM
from cable_lightning.peers import DEFAULT_PEERS, PEERS, build_peer
from cable_lightning.positional import ENCODING_FLAG, available, from_label


def make_config(args, variant: str, block_size: int, causal: bool | None = None) -> BackboneConfig:
    """``variant`` is an encoding's label (``dape_v2+kerple_log``), optionally with an attention backend:
    ``cable:materialized`` is the naive CABLE of the paper's release (full (B, H, T, T) bias added to q.k^T, softmax,
    times v)."""
    name, _, backend = variant.partition(":")
    overrides = {k: getattr(args, k) for k in ("n_layer", "n_head", "n_embd", "vocab_size")
                 if getattr(args, k) is not None}
    if causal is not None:
        overrides["causal"] = causal
    return BackboneConfig(preset=args.preset, pos_encoding=name, block_size=block_size,
                          attention_backend=backend or "auto", **overrides)


def row_name(variant: str) -> str:
    """The variant as its rows are named: the encoding's label (``dape_v2`` -> ``dape_v2+cable``), then the backend."""
    name, colon, backend = variant.partition(":")
    return from_label(name).label() + colon + backend


def default_variants(device, head_dim: int) -> list[str]:
    """Every registered encoding, then CABLE and ALiBi on the bias paths ``auto`` no longer picks for them (it folds
    them), the naive CABLE, and DAPEv2 over KERPLE (with DAPEv2 over CABLE, its default base: the CABLE paper's cost
    comparison)."""
    bias_path = "flex" if device.type == "cuda" and head_dim >= FLEX_MIN_HEAD_DIM else "chunked"
    return available() + [f"cable:{bias_path}", f"alibi:{bias_path}", "cable:materialized", "dape_v2+kerple_log"]


def out_of_memory(err: Exception) -> bool:
    return (isinstance(err, torch.OutOfMemoryError) or "out of memory" in str(err).lower()
            or isinstance(err, MemoryError))


def timed(fn, device, repeats):
    """The median seconds of ``repeats`` calls of ``fn``, after a warm-up call (and compilation on CUDA)."""
    return interleaved([fn], device, repeats)[0]


def interleaved(fns, device, repeats) -> list[float]:
    """The median seconds of each of ``fns``, run in turns (one call of each per round, after one warm-up call of
    each): load that comes and goes on a shared machine falls on all of them alike, so their ratios hold."""
    for fn in fns:
        fn()
    times = [[] for _ in fns]
    for _ in range(repeats):
        for fn, kept in zip(fns, times):
            sync(device)
            start = time.perf_counter()
            fn()
            sync(device)
            kept.append(time.perf_counter() - start)
    return [statistics.median(kept) for kept in times]


def training_batch(vocab_size, t, tokens_per_step, device):
    """(batch, t + 1) token ids: ``tokens_per_step // t`` rows (at least one)."""
    return torch.randint(0, vocab_size, (max(1, tokens_per_step // t), t + 1), device=device)


def train_step(model, x, device, dtype):
    """One training step of the backbone on ``x`` (forward and loss under autocast in ``dtype``, backward): a
    callable."""
    def step():
        with torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32):
            loss = model.loss(x[:, :-1], x[:, 1:])
        loss.backward()
        model.zero_grad(set_to_none=True)

    return step


def peer_train_step(peer, x, device, dtype):
    """:func:`train_step` of a transformers causal LM: its logits, and the backbone's loss on them (fp32 cross
    entropy of the next tokens), so both sides do the same work."""
    def step():
        with torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32):
            logits = peer(input_ids=x[:, :-1]).logits
            loss = F.cross_entropy(logits.float().flatten(0, 1), x[:, 1:].flatten())
        loss.backward()
        peer.zero_grad(set_to_none=True)

    return step


def train_tokens_per_second(model, t, tokens_per_step, device, dtype, repeats):
    x = training_batch(model.config.vocab_size, t, tokens_per_step, device)
    return x.shape[0] * t / timed(train_step(model, x, device, dtype), device, repeats)


def transformers_version() -> str:
    import transformers

    return transformers.__version__


def parameter_count(model) -> int:
    return sum(p.numel() for p in model.parameters())


def peer_rows(args, device, dtype) -> list[dict]:
    """Each peer (:data:`cable_lightning.peers.PEERS`) against the backbone with the encoding it matches, same shape,
    at each training length: both steps timed in turns in this process (:func:`interleaved`); ``ratio`` is the
    backbone's tokens/s over the peer's."""
    rows = []
    for name in args.peers:
        against = PEERS[name].against
        torch.manual_seed(0)
        config = make_config(args, against, max(args.train_lengths))
        model, peer = build_backbone(config).to(device), build_peer(name, config).to(device)
        row = {"peer": name, "peer_model": type(peer).__name__, "against": row_name(against),
               "params": parameter_count(model),
               "peer_params": parameter_count(peer), "tok_s": {}, "peer_tok_s": {}, "ratio": {}}
        for t in args.train_lengths:
            x = training_batch(config.vocab_size, t, args.tokens_per_step, device)
            ours, theirs = interleaved([train_step(model, x, device, dtype), peer_train_step(peer, x, device, dtype)],
                                       device, args.repeats)
            tokens = x.shape[0] * t
            row["tok_s"][t], row["peer_tok_s"][t], row["ratio"][t] = tokens / ours, tokens / theirs, theirs / ours
        if PEERS[name].evaluates_longer:
            row |= {"eval_s": {}, "peer_eval_s": {}, "eval_ratio": {}, "eval_mib": {}, "peer_eval_mib": {}}
            model.eval(), peer.eval()
            for t in args.eval_lengths:
                ours, theirs = interleaved([eval_forward(model, t, device, dtype),
                                            peer_eval_forward(peer, config.vocab_size, t, device, dtype)],
                                           device, args.repeats)
                row["eval_s"][t], row["peer_eval_s"][t], row["eval_ratio"][t] = ours, theirs, theirs / ours
                if not args.skip_memory:
                    row["eval_mib"][t] = eval_peak_mib(model, t, device, dtype)
                    row["peer_eval_mib"][t] = eval_peak_mib(peer, t, device, dtype, peer=name)
        rows.append(row)
        print(f"measured peer {name}", flush=True)
    return rows


def bf16_rows(pes, args, device) -> list[dict]:
    """Each encoding's training step under bf16 autocast against the same weights in fp32, at each training length,
    timed in turns in this process: ``speedup`` is the fp32 step's time over the bf16 one's. Whether bf16 pays at a
    config's shape (tiny widths gain little) before its runs are switched."""
    rows = []
    for pe in pes:
        torch.manual_seed(0)
        model = build_backbone(make_config(args, pe, max(args.train_lengths))).to(device)
        for t in args.train_lengths:
            x = training_batch(model.config.vocab_size, t, args.tokens_per_step, device)
            fp32_s, bf16_s = interleaved([train_step(model, x, device, torch.float32),
                                          train_step(model, x, device, torch.bfloat16)], device, args.repeats)
            rows.append({"pe": row_name(pe), "length": t, "fp32_step_s": fp32_s, "bf16_step_s": bf16_s,
                         "speedup": fp32_s / bf16_s})
        print(f"measured bf16 against fp32 {pe}", flush=True)
    return rows


def compile_rows(pes, args, device, dtype) -> list[dict]:
    """Each encoding's training step with its blocks compiled (``compile: true``) against the same weights eager, at
    each training length: the first compiled step's time over the steady compiled step (``compile_s``, with a fresh
    Dynamo, inductor's on-disk cache as this machine has it: ``inductor_cache`` counts the graphs it held and those
    compiled anew), both steady steps timed in turns, and the steps a fit needs before the compiled steps have paid the
    compile back (None: never)."""
    from torch._dynamo.utils import counters

    rows = []
    for pe in pes:
        torch.manual_seed(0)
        config = make_config(args, pe, max(args.train_lengths))
        eager, compiled = build_backbone(config).to(device), build_backbone(config).to(device)
        compiled.load_state_dict(eager.state_dict())
        for t in args.train_lengths:
            torch._dynamo.reset()  # each length compiles from nothing, as a fit at that length would
            compiled.compiled_blocks = None
            compiled.compile_blocks()
            x = training_batch(config.vocab_size, t, args.tokens_per_step, device)
            compiled_step = train_step(compiled, x, device, dtype)
            cache = counters["inductor"]
            hits, misses = cache["fxgraph_cache_hit"], cache["fxgraph_cache_miss"]
            sync(device)
            start = time.perf_counter()
            compiled_step()
            sync(device)
            first = time.perf_counter() - start
            hits, misses = cache["fxgraph_cache_hit"] - hits, cache["fxgraph_cache_miss"] - misses
            eager_s, compiled_s = interleaved([train_step(eager, x, device, dtype), compiled_step], device,
                                              args.repeats)
            compile_s = max(0.0, first - compiled_s)
            rows.append({"pe": row_name(pe), "length": t, "eager_step_s": eager_s, "compiled_step_s": compiled_s,
                         "speedup": eager_s / compiled_s, "compile_s": compile_s,
                         "inductor_cache": {"hits": hits, "misses": misses},
                         "payback_steps": compile_s / (eager_s - compiled_s) if compiled_s < eager_s else None})
        print(f"measured compiled {pe}", flush=True)
    return rows


def eval_forward(model, t, device, dtype):
    """One evaluation forward (the memory-safe path: chunked attention, chunked LM head) at length t."""
    x = torch.randint(0, model.config.vocab_size, (1, t + 1), device=device)

    def forward():
        with torch.no_grad(), torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32):
            model.token_nll(x[:, :-1], x[:, 1:])

    return forward


def peer_eval_forward(peer, vocab_size, t, device, dtype):
    """:func:`eval_forward` of a peer: its logits at length t and their cross entropy, without gradients."""
    x = torch.randint(0, vocab_size, (1, t + 1), device=device)

    def forward():
        with torch.no_grad(), torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32):
            F.cross_entropy(peer(input_ids=x[:, :-1]).logits.float().flatten(0, 1), x[:, 1:].flatten())

    return forward


def eval_seconds(model, t, device, dtype, repeats):
    return timed(eval_forward(model, t, device, dtype), device, repeats)


PADDED_MODES = ("per_span", "one_group", "grouped")


def padded_step_seconds(model, rows, longest, device, repeats, mode):
    """One fine-tuning step of a padded batch as sentence-transformers runs it (mean pooling of the real tokens, a
    loss on the pooled vectors, backward): ``rows`` rows of lengths drawn from 1..``longest``, right-padded. ``mode``
    (:data:`PADDED_MODES`): ``per_span``, each distinct span as its own sub-batch (how the transformers wrapper ran a
    padded batch before the backbone took a padding mask); ``one_group``, one call with the padding mask and every
    row padded to the longest (``padding_waste`` 1.0, the first padding mask); ``grouped``, one call with the padding
    mask as the backbone runs it (groups of similar length)."""
    generator = torch.Generator().manual_seed(0)
    lengths = torch.randint(1, longest + 1, (rows,), generator=generator).to(device)
    x = torch.randint(0, model.config.vocab_size, (rows, longest), generator=generator).to(device)
    mask = torch.arange(longest, device=device) < lengths[:, None]
    default_waste = model.padding_waste

    def step():
        if mode == "per_span":
            hidden = torch.zeros(rows, longest, model.config.n_embd, device=device)
            for n in lengths.unique().tolist():
                same = (lengths == n).nonzero().flatten()
                hidden[same, :n] = model.hidden_states(x[same, :n])
        else:
            model.padding_waste = 1.0 if mode == "one_group" else default_waste
            hidden = model.hidden_states(x, padding_mask=mask)
            model.padding_waste = default_waste
        pooled = (hidden * mask[..., None]).sum(1) / lengths[:, None]
        pooled.square().mean().backward()
        model.zero_grad(set_to_none=True)

    return timed(step, device, repeats)


def _cpu_eval_peak(config_dict, t, threads, out, peer=None):
    """Runs in a fresh process: peak RSS of one evaluation forward (of the backbone, or of the peer named), in MiB."""
    torch.set_num_threads(threads)
    config = BackboneConfig.from_dict(config_dict)
    if peer is None:
        eval_forward(build_backbone(config).eval(), t, torch.device("cpu"), torch.float32)()
    else:
        peer_eval_forward(build_peer(peer, config).eval(), config.vocab_size, t, torch.device("cpu"), torch.float32)()
    out.put(peak_rss_mib())


def peak_rss_mib() -> float:
    """This process's peak resident memory. VmHWM, not ru_maxrss: Linux carries ru_maxrss across
    fork+exec, so a spawned child would report its parent's peak."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("no VmHWM in /proc/self/status (peak memory needs Linux)")


def eval_peak_mib(model, t, device, dtype, peer=None):
    """The peak memory of one evaluation forward at length t (``peer``: ``model`` is the peer of that name, whose
    ``config`` is the backbone config it was built at)."""
    if device.type == "cuda":
        forward = (eval_forward(model, t, device, dtype) if peer is None
                   else peer_eval_forward(model, model.config.vocab_size, t, device, dtype))
        torch.cuda.reset_peak_memory_stats()
        forward()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() / 2**20
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=_cpu_eval_peak, args=(model.config.to_dict(), t, torch.get_num_threads(), queue, peer))
    proc.start()
    peak = queue.get()
    proc.join()
    return peak


def run(args) -> dict:
    device = torch.device(args.device)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    pes = args.pes or default_variants(device, make_config(args, "nope", max(args.train_lengths)).head_dim)
    if "nope" not in pes:
        pes = ["nope"] + pes
    cpu_peaks = None
    if device.type == "cpu":  # both dtypes' peaks, before and after the PEs: the better of each (load lowers either)
        cpu_peaks = cpu_matmul_peaks()
        peak_source = f"{dtype} 1024x1024 matmul measured in this process"
    else:
        peak, peak_source = peak_flops(device, dtype)
    rows = []
    for pe in pes:
        torch._dynamo.reset()  # what one encoding compiled (FlexAttention) counts toward no other's recompile limit
        torch.manual_seed(0)
        row = {"pe": row_name(pe), "train_tok_s": {}, "eval_s": {}, "eval_peak_mib": {}}
        if args.padded_batch:
            encoder = build_backbone(make_config(args, pe, args.padded_longest, causal=False)).to(device)
            row["padded_step_s"] = {mode: padded_step_seconds(encoder, args.padded_batch, args.padded_longest, device,
                                                               args.repeats, mode) for mode in PADDED_MODES}
        model = build_backbone(make_config(args, pe, max(args.train_lengths))).to(device)
        for t in args.train_lengths:
            row["train_tok_s"][t] = train_tokens_per_second(model, t, args.tokens_per_step, device, dtype, args.repeats)
        row["train_flops_per_token"] = {t: model.training_flops_per_token(t) for t in args.train_lengths}
        model.eval()
        for t in args.eval_lengths:
            longest = model.config.pos_encoding.longest_length(model.config.block_size)
            if longest is not None and t > longest:  # a learnable table cannot serve longer inputs
                continue
            if t > args.naive_max_length and pe.endswith(":materialized"):
                row["eval_s"][t] = row["eval_peak_mib"][t] = "skipped"
                continue
            try:
                row["eval_s"][t] = eval_seconds(model, t, device, dtype, args.repeats)
                if not args.skip_memory:
                    row["eval_peak_mib"][t] = eval_peak_mib(model, t, device, dtype)
            except (RuntimeError, MemoryError) as err:
                if not out_of_memory(err):
                    raise
                row["eval_s"][t] = row["eval_peak_mib"][t] = "OOM"
                if device.type == "cuda":
                    torch.cuda.empty_cache()
        rows.append(row)
        print(f"measured {pe}", flush=True)
    peers = peer_rows(args, device, dtype) if args.peers else None
    compiled = compile_rows(pes, args, device, dtype) if args.compile else None
    bf16 = bf16_rows(pes, args, device) if args.bf16_speedup else None
    if cpu_peaks is not None:
        after = cpu_matmul_peaks()
        cpu_peaks = {name: max(flops, after[name]) for name, flops in cpu_peaks.items()}
        peak = cpu_peaks[args.dtype]
    for row in rows:
        row["train_mfu"] = {t: v * row["train_flops_per_token"][t] / peak for t, v in row["train_tok_s"].items()}
    base = next(r for r in rows if r["pe"] == "nope")
    for row in rows:
        row["train_ratio_to_nope"] = {t: base["train_tok_s"][t] / v for t, v in row["train_tok_s"].items()}
        row["eval_ratio_to_nope"] = {t: v / base["eval_s"][t] for t, v in row["eval_s"].items()
                                     if not isinstance(v, str)}
    config = make_config(args, "nope", max(args.train_lengths))
    meta = {
        "date": time.strftime("%Y-%m-%d"),
        "device": (torch.cuda.get_device_name() if device.type == "cuda"
                   else f"{platform.processor() or 'cpu'} x{torch.get_num_threads()} threads"),
        "torch": torch.__version__, "dtype": args.dtype,
        "shape": {k: getattr(config, k) for k in ("n_layer", "n_head", "n_embd", "vocab_size")},
        "tokens_per_step": args.tokens_per_step, "peak_flops": peak, "peak_source": peak_source,
        "cpu_matmul_peaks": cpu_peaks,
    }
    result = {"meta": meta, "rows": rows}
    if peers is not None:
        result["peers"] = peers
    if compiled is not None:
        result["compiled"] = compiled
    if bf16 is not None:
        result["bf16"] = bf16
    return result


class StepClock(L.Callback):
    """The host time between consecutive training batches' starts: one whole loop iteration (the next batch from the
    stream, the step, the optimizer, callbacks and logging), synchronised with the device at each start."""

    def __init__(self):
        self.starts: list[float] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        sync(pl_module.device)
        self.starts.append(time.perf_counter())


def loop_overhead(data_path: str, pe: str = "cable", steps: int = 40, warmup: int = 10, repeats: int = 40,
                  shape: tuple[int, int, int] = (2, 4, 128), block_size: int = 128, batch: int = 8,
                  compile: bool = False) -> dict:
    """A fit's training step over the bare step of the same model, shape and batch, measured in this process: the
    loop's overhead. The fit runs through the CLI (LitData's stream of ``data_path``, Lightning's loop, the project's
    callbacks and logging, no validation inside the steps timed); the bare step is forward, backward, the optimizer's
    step and zero_grad on one fixed batch (the fit's optimizer, built by the same function). Medians of the steps after
    ``warmup``; the fit's step also counts the gap to the next batch (loading, callbacks). The bare step clips the
    gradients as the fit does. With ``compile``, both
    steps run the compiled blocks, and ``warmup_s`` (the fit's first ``warmup`` steps) holds the compilation."""
    import tempfile

    from cable_lightning.cli import main as cli_main

    n_layer, n_head, n_embd = shape
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
                        "--trainer.callbacks+=cable_lightning.bench.StepClock",
                        "--checkpoint.every_n_train_steps", str(steps), "--runs_dir", runs,
                        "--experiment", "loop_overhead", "--model.init_args.compile", str(compile).lower()])
    clock = next(cb for cb in cli.trainer.callbacks if isinstance(cb, StepClock))
    fit_step = statistics.median(b - a for a, b in zip(clock.starts[warmup:], clock.starts[warmup + 1:]))
    model = cli.model
    device = model.device
    optimizer = model.configure_optimizers()["optimizer"]  # the fit's own recipe, built by the fit's own code
    clip = cli.trainer.gradient_clip_val  # and its clipping (norm), which Lightning applies before each step
    x = torch.randint(0, model.config.vocab_size, (batch, block_size + 1), device=device)

    def step():
        model.backbone.loss(x[:, :-1], x[:, 1:]).backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(model.backbone.parameters(), clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    for _ in range(warmup):
        step()
    bare_step = timed(step, device, repeats)
    return {"pe": pe, "shape": shape, "block_size": block_size, "batch": batch, "compile": compile,
            "gradient_clip": clip, "warmup_s": clock.starts[warmup] - clock.starts[0], "fit_step_s": fit_step,
            "bare_step_s": bare_step, "ratio": fit_step / bare_step, "fit_steps_timed": len(clock.starts) - warmup - 1,
            "threads": torch.get_num_threads(), "device": str(device)}


def fmt(value, spec, ratio=None) -> str:
    if value is None:
        return "-"
    if isinstance(value, str):
        return value
    return f"{value:{spec}}" + (f" ({ratio:.2f})" if ratio is not None else "")


def table(result) -> str:
    rows = result["rows"]
    train_ts = list(rows[0]["train_tok_s"])
    eval_ts = list(rows[0]["eval_s"])
    head = (["pe"] + [f"train tok/s @{t} (x nope)" for t in train_ts] + [f"MFU @{t}" for t in train_ts]
            + [f"eval s @{t} (x nope)" for t in eval_ts]
            + [f"eval peak MiB @{t}" for t in eval_ts])
    padded = "padded_step_s" in rows[0]
    if padded:
        head += ["padded step s, per span", "one call, one group (x per span)", "one call, grouped (x per span)"]
    lines = []
    for r in rows:
        cells = [r["pe"]]
        cells += [f"{r['train_tok_s'][t]:.0f} ({r['train_ratio_to_nope'][t]:.2f})" for t in train_ts]
        cells += [f"{r['train_mfu'][t]:.1%}" for t in train_ts]
        cells += [fmt(r["eval_s"].get(t), ".3f", r["eval_ratio_to_nope"].get(t)) for t in eval_ts]
        cells += [fmt(r["eval_peak_mib"].get(t), ".0f") for t in eval_ts]
        if padded:
            step = r["padded_step_s"]
            cells += [f"{step['per_span']:.2f}"] + [f"{step[mode]:.2f} ({step[mode] / step['per_span']:.2f})"
                                                    for mode in PADDED_MODES[1:]]
        lines.append(cells)
    return markdown_table(head, lines)


def peer_table(rows) -> str:
    ts = list(rows[0]["tok_s"])
    head = ["peer", "against", "parameters (peer / project)"] + [f"train tok/s @{t}: project / peer (x peer)"
                                                                   for t in ts]
    body = [[f"{r['peer']} ({r['peer_model']})", r["against"],
             f"{r['peer_params']:,} / {r['params']:,}"]
            + [f"{r['tok_s'][t]:.0f} / {r['peer_tok_s'][t]:.0f} ({r['ratio'][t]:.2f}x)" for t in ts] for r in rows]
    text = markdown_table(head, body)
    for r in (r for r in rows if "eval_s" in r):  # a peer that reads longer inputs: its evaluation too
        memory = bool(r["eval_mib"])
        text += "\n\n" + markdown_table(
            ["eval length", f"{r['against']} s", f"{r['peer']} s", f"{r['peer']} / {r['against']}"]
            + ([f"{r['against']} peak MiB", f"{r['peer']} peak MiB"] if memory else []),
            [[t, f"{r['eval_s'][t]:.3f}", f"{r['peer_eval_s'][t]:.3f}", f"{r['eval_ratio'][t]:.2f}x"]
             + ([f"{r['eval_mib'][t]:.0f}", f"{r['peer_eval_mib'][t]:.0f}"] if memory else [])
             for t in r["eval_s"]])
    return text


def compile_table(rows) -> str:
    head = ["pe", "length", "eager step s", "compiled step s (x eager's speed)", "compile s",
            "inductor's cache: graphs held / compiled", "steps to pay back"]
    body = [[r["pe"], str(r["length"]), f"{r['eager_step_s']:.3f}", f"{r['compiled_step_s']:.3f} ({r['speedup']:.2f}x)",
             f"{r['compile_s']:.1f}", f"{r['inductor_cache']['hits']} / {r['inductor_cache']['misses']}",
             "never" if r["payback_steps"] is None else f"{r['payback_steps']:.0f}"] for r in rows]
    return markdown_table(head, body)


def bf16_table(rows) -> str:
    head = ["pe", "length", "fp32 step s", "bf16 step s", "bf16's speedup"]
    body = [[r["pe"], str(r["length"]), f"{r['fp32_step_s']:.3f}", f"{r['bf16_step_s']:.3f}", f"{r['speedup']:.2f}x"]
            for r in rows]
    return markdown_table(head, body)


def peaks_line(meta) -> str:
    """Both CPU matmul peaks, so a user sees what bf16 offers on this CPU, and the one MFU divides by."""
    line = f"MFU against {meta['peak_source']}: {meta['peak_flops'] / 1e9:.1f} GFLOP/s"
    peaks = meta["cpu_matmul_peaks"]
    if peaks is None:
        return line
    threads = torch.get_num_threads()
    return (f"CPU matmul peaks (1024x1024, {threads} thread{'s' * (threads > 1)}, best of before and after): fp32 "
            f"{peaks['fp32'] / 1e9:.1f} GFLOP/s, bf16 {peaks['bf16'] / 1e9:.1f} GFLOP/s "
            f"({peaks['bf16'] / peaks['fp32']:.2f}x fp32)\n{line}")


def main(argv=None):
    parser = ArgumentParser(prog="python -m cable_lightning bench", description=__doc__,
                            formatter_class=argparse.RawDescriptionHelpFormatter,
                            epilog="With no arguments it runs the full benchmark: every encoding at the defaults "
                            "above (on a CPU, it takes long).")
    parser.add_argument("--preset", default="gpt2-tiny")
    parser.add_argument("--n_layer", dest="n_layer", type=int)
    parser.add_argument("--n_head", dest="n_head", type=int)
    parser.add_argument("--n_embd", dest="n_embd", type=int)
    parser.add_argument("--vocab_size", dest="vocab_size", type=int)
    parser.add_argument("--pes", nargs="*", help=f"default: all of {', '.join(available())}, plus cable and alibi "
                        "on the chunked (CPU) or flex (CUDA) bias path and cable:materialized (naive); "
                        "pe:backend forces a backend; dape_v2+pe is DAPEv2 over pe")
    parser.add_argument("--naive_max_length", type=int, default=8192,
                        help="skip the naive CABLE beyond this eval length")
    parser.add_argument("--train_lengths", type=int, nargs="+", default=[256, 512, 1024])
    parser.add_argument("--eval_lengths", type=int, nargs="+", default=[2048, 4096, 8192])
    parser.add_argument("--tokens_per_step", type=int, default=4096, help="batch = this // length")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    parser.add_argument("--skip_memory", action="store_true")
    parser.add_argument("--padded_batch", type=int, default=0,
                        help="also time a fine-tuning step of a bidirectional encoder on this many right-padded rows "
                        "of mixed lengths: one call per span, one call padded to the longest, one call as the backbone "
                        "groups the rows (0: skip)")
    parser.add_argument("--padded_longest", type=int, default=512, help="the padded rows' longest length")
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--loop_overhead", metavar="DATA_PATH",
                        help="instead of the table: a tiny model's fit step (through the CLI, on this prepared data "
                        "folder) over its bare step, the loop's overhead (docs/speed.md)")
    parser.add_argument("--peers", nargs="*", choices=list(PEERS), metavar="PEER",
                        help=f"also time transformers' models at the same shape, each in turns with the encoding it "
                        f"matches: {', '.join(f'{n} (against {p.against})' for n, p in PEERS.items())}; "
                        f"no names: {' '.join(DEFAULT_PEERS)}")
    parser.add_argument("--compile", action="store_true",
                        help="also time each encoding's training step with its blocks compiled (compile: true) "
                        "against eager: the compile time, the steady steps, the steps to pay back; with "
                        "--loop_overhead: compile the blocks of its fit and bare step")
    parser.add_argument("--bf16_speedup", action="store_true",
                        help="also time each encoding's training step under bf16 autocast against fp32, same weights, "
                        "in turns: bf16's speedup at this shape")
    args = parser.parse_args(argv)
    if args.peers == []:
        args.peers = list(DEFAULT_PEERS)
    if args.peers and importlib.util.find_spec("transformers") is None:
        parser.error("--peers needs transformers, which the hf extra installs: pip install 'cable_lightning[hf]'")
    if args.loop_overhead:
        result = loop_overhead(args.loop_overhead, compile=args.compile)
        print(f"loop overhead ({result['pe']}, layers/heads/width {result['shape']}, {result['batch']} x "
              f"{result['block_size']} tokens, {result['threads']} threads, compile {result['compile']}): fit step "
              f"{result['fit_step_s'] * 1e3:.1f} ms, bare step {result['bare_step_s'] * 1e3:.1f} ms, ratio "
              f"{result['ratio']:.3f}; the fit's first steps {result['warmup_s']:.1f} s")
        if args.json:
            with open(args.json, "w") as f:
                json.dump(result, f, indent=2)
        return result
    result = run(args)
    print(json.dumps(result["meta"]))
    print(peaks_line(result["meta"]))
    print(table(result))
    if "peers" in result:
        print(f"\nPeers (transformers {transformers_version()}), each step timed in turns with the project's:")
        print(peer_table(result["peers"]))
    if "compiled" in result:
        print("\nCompiled blocks (compile: true) against eager, same weights, steady steps timed in turns:")
        print(compile_table(result["compiled"]))
    if "bf16" in result:
        print("\nbf16 autocast against fp32, same weights, steps timed in turns:")
        print(bf16_table(result["bf16"]))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return result


if __name__ == "__main__":  # an entry point once: say which verb replaced it, never exit 0 having done nothing
    from cable_lightning.verbs import replaced_entry_point

    replaced_entry_point(__spec__.name)
