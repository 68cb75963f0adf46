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

``--peers``: transformers' own models at the same shape (:mod:`cable_lightning.bench.peer_models`: GPT-2 against
``learnable``, GPT-NeoX or Llama against ``rope``), each training step timed in turns with the project's in this
process, and their ratio. ``--compile``: each encoding's training step with its blocks compiled (``compile: true``)
against eager, the compile time apart from the steady steps, and the steps a fit needs to pay the compile back.
``--in_turns``: in place of the main table, each encoding's training step and evaluation timed in turns with NoPE's,
for a cost ratio that holds on a machine other jobs share.

    python -m cable_lightning bench --preset gpt2-tiny --n_layer 2 --pes cable alibi nope --json bench.json
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import platform
import time

import torch

from ..errors import ArgumentParser
from ..hardware import cpu_matmul_peaks, peak_flops
from ..positional import available
from .bf16 import bf16_rows, bf16_table
from .compiled import compile_rows, compile_table
from .in_turns import in_turns_rows, in_turns_table
from .loop_overhead import loop_overhead, summary
from .peer_models import DEFAULT_PEERS, PEERS
from .peers import peer_rows, peer_table, transformers_version
from .training import add_mfu_and_ratios, encoding_row, peaks_line, table
from .variants import default_variants, make_config


def run(args) -> dict:
    """The main table's rows (:mod:`.training`), then the peers', compiled and bf16 rows asked for, MFU against the
    peak (a CPU's measured before and after the encodings: the better of each, load lowers either), and the run's
    meta."""
    device = torch.device(args.device)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    pes = args.pes or default_variants(device, make_config(args, "nope", max(args.train_lengths)).head_dim)
    if "nope" not in pes:
        pes = ["nope"] + pes
    cpu_peaks = None
    if device.type == "cpu":
        cpu_peaks = cpu_matmul_peaks()
        peak_source = f"{dtype} 1024x1024 matmul measured in this process"
    else:
        peak, peak_source = peak_flops(device, dtype)
    rows = []
    for pe in [] if args.in_turns else pes:
        rows.append(encoding_row(pe, args, device, dtype))
        print(f"measured {pe}", flush=True)
    turns = in_turns_rows(pes, args, device, dtype) if args.in_turns else None
    peers = peer_rows(args, device, dtype) if args.peers else None
    compiled = compile_rows(pes, args, device, dtype) if args.compile else None
    bf16 = bf16_rows(pes, args, device) if args.bf16_speedup else None
    if cpu_peaks is not None:
        after = cpu_matmul_peaks()
        cpu_peaks = {name: max(flops, after[name]) for name, flops in cpu_peaks.items()}
        peak = cpu_peaks[args.dtype]
    if rows:
        add_mfu_and_ratios(rows, peak)
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
    if turns is not None:
        result["in_turns"] = turns
    if peers is not None:
        result["peers"] = peers
    if compiled is not None:
        result["compiled"] = compiled
    if bf16 is not None:
        result["bf16"] = bf16
    return result


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
                        "pe:backend forces a backend; dape_v2+pe is DAPEv2 over pe; pe+attn_gate (+attn_sink, "
                        "+qk_norm) is pe with that attention switch on")
    parser.add_argument("--naive_max_length", type=int, default=8192,
                        help="skip the naive CABLE beyond this eval length")
    parser.add_argument("--train_lengths", type=int, nargs="+", default=[256, 512, 1024])
    parser.add_argument("--eval_lengths", type=int, nargs="+", default=[2048, 4096, 8192])
    parser.add_argument("--tokens_per_step", type=int, default=4096, help="batch = this // length")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    parser.add_argument("--skip_memory", action="store_true")
    parser.add_argument("--bidirectional", action="store_true",
                        help="every row of the bidirectional encoder (causal false), as export and retrieval run it")
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
    parser.add_argument("--in_turns", action="store_true",
                        help="in place of the main table, time each encoding's training step and evaluation in turns "
                        "with NoPE's (a cost ratio that holds while other jobs share the machine)")
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
        print(summary(result))
        if args.json:
            with open(args.json, "w") as f:
                json.dump(result, f, indent=2)
        return result
    result = run(args)
    print(json.dumps(result["meta"]))
    print(peaks_line(result["meta"]))
    if result["rows"]:
        print(table(result))
    if "in_turns" in result:
        print("\nEach encoding in turns with NoPE, same process (cost > 1: slower than NoPE):")
        print(in_turns_table(result["in_turns"]))
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
