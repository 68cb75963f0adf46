"""What the attention diagnostics cost against the length evaluation they sit beside (docs/diagnostics.md#cost).

For each encoding and length: the length evaluation's work (every non-overlapping window of ``--eval-tokens`` targets
through ``token_nll``, batched as the datamodule batches them: ``--micro-batch`` windows up to the training length,
one past it; the bare forwards, without the metric updates and reads back of the real validation) and the
diagnostics' (``diagnose`` of ``--windows`` windows: the forward with the attention recorded, the short-context pass
and the read back), each the fastest of ``--repeats`` runs, so that a busy machine's stalls drop out; wall seconds and
this process's CPU seconds; then, from one more run of each, what a GPU would be asked for (``eval/work.py``): passes
through the model, operators launched and reads back to the host. The weights do not change the cost, so the model is
a fresh one of the given shape.

    python tools/diagnostics_cost.py --pes cable rope stick_breaking
    python tools/diagnostics_cost.py --pes alibi cable --n-head 12 --per-block   # operators per row block

``--per-block``: the operators one layer's recorded attention launches per block of rows and besides (by two block
counts), from which the count at any length and block size follows (docs/diagnostics.md#cost).
"""

from __future__ import annotations

import argparse
import time

import torch

import cable_lightning.eval.diagnostics as diagnostics_module
from cable_lightning.data.windows import EvalWindows
from cable_lightning.eval.diagnostics import AttentionStats, diagnose
from cable_lightning.eval.tables import markdown_table
from cable_lightning.eval.work import DeviceWork
from cable_lightning.models import BackboneConfig, build_backbone
from cable_lightning.positional import from_label


def fastest(fn, repeats: int) -> tuple[float, float]:
    """(wall, CPU) seconds of the fastest of ``repeats`` calls."""
    best = (float("inf"), float("inf"))
    for _ in range(repeats):
        wall, cpu = time.perf_counter(), time.process_time()
        fn()
        best = min(best, (time.perf_counter() - wall, time.process_time() - cpu))
    return best


@torch.no_grad()
def measure(pe: str, args) -> list[dict]:
    torch.manual_seed(0)
    config = BackboneConfig(preset="gpt2-tiny", pos_encoding=from_label(pe), n_layer=args.n_layer, n_head=args.n_head,
                            n_embd=args.n_embd, block_size=args.train_length, vocab_size=args.vocab_size)
    backbone = build_backbone(config).eval()
    stream = torch.randint(0, args.vocab_size, (max(args.eval_tokens, max(args.lengths)) + 1,))
    rows = []
    for length in args.lengths:
        windows = EvalWindows(stream, length, length)
        batch = args.micro_batch if length <= args.train_length else 1
        tokens = [windows[i]["tokens"] for i in range(len(windows))]

        def evaluation():
            for at in range(0, len(tokens), batch):
                chunk = torch.stack(tokens[at : at + batch])
                backbone.token_nll(chunk[:, :-1], chunk[:, 1:])

        few = torch.stack(tokens[: args.windows])

        def diagnostics():
            diagnose(backbone, few[:, :-1], few[:, 1:], args.train_length)

        row = {"pe": pe, "length": length}
        for name, fn in (("evaluation", evaluation), ("diagnostics", diagnostics)):
            row[name], row[name + "_cpu"] = fastest(fn, args.repeats)
            work = DeviceWork(backbone)
            with work:
                fn()
            row[name + "_work"] = work.counts()
        rows.append(row)
        print(f"{pe:>16} {length:>6}: evaluation {row['evaluation']:6.2f} s, diagnostics {row['diagnostics']:6.2f} s "
              f"(CPU {row['evaluation_cpu']:6.2f} vs {row['diagnostics_cpu']:6.2f}); evaluation "
              f"{row['evaluation_work']}, diagnostics {row['diagnostics_work']}", flush=True)
    return rows


@torch.no_grad()
def per_block(pe: str, args) -> tuple[float, float]:
    """(operators per row block, operators per layer besides) of one layer's recorded attention, ``--windows``
    windows and ``--n-head`` heads, from 4 and 8 blocks of a 256-token layer."""
    config = BackboneConfig(preset="gpt2-tiny", pos_encoding=from_label(pe), n_layer=2, n_head=args.n_head,
                            n_embd=8 * args.n_head, block_size=256)
    backbone = build_backbone(config)
    shape = (args.windows, args.n_head, 256, 8)
    q, k, h = torch.randn(shape), torch.randn(shape), torch.randn(args.windows, 256, 8 * args.n_head)
    scores = backbone.pe.score_bias(h, 0, 0, None)
    counts, kept = {}, diagnostics_module.BLOCK_ELEMENTS
    try:
        for blocks in (4, 8):
            maps = diagnostics_module.MAPS + getattr(scores, "maps_per_head", 1)
            diagnostics_module.BLOCK_ELEMENTS = 256 // blocks * args.windows * args.n_head * maps * 256
            work = DeviceWork()
            with work:
                AttentionStats(local=32).add(0, q, k, scores, True, None)
            counts[blocks] = work.kernels
    finally:
        diagnostics_module.BLOCK_ELEMENTS = kept
    block = (counts[8] - counts[4]) / 4
    return block, counts[4] - 4 * block


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pes", nargs="+", default=["cable", "rope", "stick_breaking"])
    parser.add_argument("--n-layer", dest="n_layer", type=int, default=4)
    parser.add_argument("--n-head", dest="n_head", type=int, default=4)
    parser.add_argument("--n-embd", dest="n_embd", type=int, default=256)
    parser.add_argument("--vocab-size", dest="vocab_size", type=int, default=4096)
    parser.add_argument("--train-length", dest="train_length", type=int, default=128)
    parser.add_argument("--lengths", nargs="+", type=int, default=[128, 256, 512, 1024, 2048])
    parser.add_argument("--eval-tokens", dest="eval_tokens", type=int, default=16384)
    parser.add_argument("--micro-batch", dest="micro_batch", type=int, default=16)
    parser.add_argument("--windows", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--per-block", dest="per_block", action="store_true",
                        help="count the operators per block of rows only")
    args = parser.parse_args(argv)
    if args.per_block:
        for pe in args.pes:
            block, layer = per_block(pe, args)
            print(f"{pe}: {block:g} operators per block of rows, {layer:g} per layer besides ({args.windows} windows, "
                  f"{args.n_head} heads)")
        return
    print(f"threads {torch.get_num_threads()}; quickstart shape unless given; fastest of {args.repeats}", flush=True)
    lines = []
    for pe in args.pes:
        rows = measure(pe, args)
        evaluation = sum(r["evaluation"] for r in rows)
        diagnostics = sum(r["diagnostics"] for r in rows)
        cpu = sum(r["diagnostics_cpu"] for r in rows) / sum(r["evaluation_cpu"] for r in rows)
        work = {key: " vs ".join(str(sum(r[f"{name}_work"][key] for r in rows)) for name in ("diagnostics",
                                                                                             "evaluation"))
                for key in ("forwards", "kernels", "transfers")}
        lines.append([pe, f"{evaluation:.1f}", f"{diagnostics:.1f}", f"{diagnostics / evaluation:.2f}", f"{cpu:.2f}",
                      work["forwards"], work["kernels"], work["transfers"]])
    print(markdown_table(["encoding", "length evaluation (s)", "diagnostics (s)", "ratio", "CPU ratio", "forwards",
                          "operators", "reads back"], lines))


if __name__ == "__main__":
    main()
