"""What the attention diagnostics cost against the length evaluation they sit beside (docs/diagnostics.md#cost).

For each encoding and length: the length evaluation's work (every non-overlapping window of ``--eval-tokens`` targets
through ``token_nll``, batched as the datamodule batches them: ``--micro-batch`` windows up to the training length,
one past it) and the diagnostics' (``--windows`` windows: the forward with the attention recorded, then the
short-context pass), each the fastest of ``--repeats`` runs, so that a busy machine's stalls drop out; wall seconds
and this process's CPU seconds. The weights do not change the cost, so the model is a fresh one of the given shape.

    python tools/diagnostics_cost.py --pes cable rope stick_breaking
"""

from __future__ import annotations

import argparse
import time

import torch

from cable_lightning.data.windows import EvalWindows
from cable_lightning.eval.diagnostics import AttentionStats, recording, short_context_nll
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
        inputs, targets = few[:, :-1], few[:, 1:]

        def recorded():
            with recording(backbone, AttentionStats(local=max(1, args.train_length // 8))):
                backbone.token_nll(inputs, targets)

        def short():
            if length > args.train_length:
                short_context_nll(backbone, inputs, targets, args.train_length, max(1, args.train_length // 4))

        row = {"pe": pe, "length": length}
        for name, fn in (("evaluation", evaluation), ("attention", recorded), ("short", short)):
            row[name], row[name + "_cpu"] = fastest(fn, args.repeats)
        rows.append(row)
        cpu = row["attention_cpu"] + row["short_cpu"]
        print(f"{pe:>16} {length:>6}: evaluation {row['evaluation']:6.2f} s, diagnostics {row['attention']:6.2f} + "
              f"{row['short']:6.2f} s (CPU {row['evaluation_cpu']:6.2f} vs {cpu:6.2f})", flush=True)
    return rows


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
    args = parser.parse_args(argv)
    print(f"threads {torch.get_num_threads()}; quickstart shape unless given; fastest of {args.repeats}", flush=True)
    lines = ["| encoding | length evaluation (s) | diagnostics (s) | of which short-context (s) | ratio | CPU ratio |",
             "|---|---|---|---|---|---|"]
    for pe in args.pes:
        rows = measure(pe, args)
        evaluation = sum(r["evaluation"] for r in rows)
        diagnostics = sum(r["attention"] + r["short"] for r in rows)
        short = sum(r["short"] for r in rows)
        cpu = sum(r["attention_cpu"] + r["short_cpu"] for r in rows) / sum(r["evaluation_cpu"] for r in rows)
        lines.append(f"| {pe} | {evaluation:.1f} | {diagnostics:.1f} | {short:.1f} | {diagnostics / evaluation:.2f} | "
                     f"{cpu:.2f} |")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
