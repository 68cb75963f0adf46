"""The Python parts of tools/gpu/run.sh, each a subcommand that prints what it found and appends one JSON line to
``--results`` (the run's results file, written as each part finishes):

- ``env``: Python, torch, the device, and every package the runs import (from the carried wheels or the image); exit
  1 when one is missing.
- ``prepared DATA``: the prepared corpus's manifest in one line (corpus hash, tokens, distributions).
- ``fit PE RUNS``: one encoding's run under RUNS: perplexity at each evaluated length (its latest evaluation),
  ppl(longest)/ppl(training length), tokens trained, steady tokens/s, MFU, the machine and the corpus hash, from the
  records the fit wrote (``length_eval.jsonl``, ``throughput.jsonl``).
- ``line KEY=VALUE ...``: any other part's line (a skipped part, the report's status).
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys

# What the runs import: installed on the machine, or installed from wheels in .whl/ (run.sh)
PACKAGES = ["litdata", "jsonargparse", "docstring_parser", "typeshed_client", "lightning", "torchmetrics",
            "tensorboard", "tokenizers", "matplotlib", "scipy", "numpy", "yaml"]


def append(results: str, row: dict) -> None:
    line = json.dumps(row, default=str)
    print(line, flush=True)
    with open(results, "a", encoding="utf-8") as f:
        f.write(line + "\n")


def env(args) -> int:
    import torch

    site = (os.environ.get("PYTHONPATH") or "").split(os.pathsep)[0]
    row = {"part": "env", "python": sys.version.split()[0], "torch": torch.__version__, "cuda": torch.version.cuda,
           "cuda_available": torch.cuda.is_available()}
    missing = []
    for name in PACKAGES:
        try:
            module = importlib.import_module(name)
        except Exception as err:  # noqa: BLE001 - every failure is named
            missing.append(f"{name} ({type(err).__name__}: {str(err).splitlines()[0][:120] if str(err) else ''})")
            continue
        where = "carried" if site and (getattr(module, "__file__", "") or "").startswith(site) else "image"
        print(f"  {name} {getattr(module, '__version__', '?')} ({where})", flush=True)
    try:
        import cable_lightning.cli  # noqa: F401 - what fit imports
        from cable_lightning.hardware import device_name, peak_flops

        device = torch.device("cuda" if torch.cuda.is_available() and not args.rehearse else "cpu")
        row["device"] = device_name(device)
        if device.type == "cuda":
            flops, source = peak_flops(device)
            row["peak_tflops"], row["peak_source"] = round(flops / 1e12, 1), source
    except Exception as err:  # noqa: BLE001
        missing.append(f"cable_lightning ({type(err).__name__}: {err})")
    row.update(status="ok" if not missing else "missing: " + "; ".join(missing))
    append(args.results, row)
    return 1 if missing else 0


def prepared(args) -> int:
    with open(os.path.join(args.data, "manifest.json"), encoding="utf-8") as f:
        manifest = json.load(f)
    source = manifest.get("source") or {}
    append(args.results, {
        "part": "prepare", "status": args.status, "data": args.data, "source": source.get("spec"),
        "corpus_hash": source.get("corpus_hash"), "python": source.get("python"),
        "tokenizer": manifest["tokenizer"]["spec"], "vocab_size": manifest["vocab_size"],
        "tokens": {split: info["tokens"] for split, info in manifest["splits"].items()},
        "distributions": len(source.get("distributions") or []), "bytes": source.get("bytes"),
        "prepare_s": manifest.get("seconds"), "wall_s": args.seconds})
    return 0


def fit(args) -> int:
    from cable_lightning.eval.comparable import latest_rows
    from cable_lightning.records.io import find_records
    from cable_lightning.records.schema import LengthRecord, ThroughputRecord

    row = {"part": "fit", "pe": args.pe, "status": args.status, "wall_s": args.seconds}
    lengths = latest_rows(find_records([args.runs], required=False))
    ppl = {r.length: r.ppl for r in lengths if r.mode == "nonoverlap"}
    if ppl:
        first = lengths[0]
        row.update(step=first.step, ppl={str(n): None if p is None else round(p, 3) for n, p in sorted(ppl.items())})
        base, longest = ppl.get(first.train_length), ppl[max(ppl)]
        if base and longest:
            row[f"ppl_{max(ppl) // first.train_length}x_over_1x"] = round(longest / base, 4)
        row.update(corpus_hash=first.corpus_hash, machine=first.machine, recipe=first.recipe)
    speed = latest_rows(find_records([args.runs], ThroughputRecord.FILE, required=False), ThroughputRecord,
                        lambda r: r.machine)
    if speed:
        last = speed[-1]
        rate = None if last.tokens_per_sec is None else round(last.tokens_per_sec)
        row.update(tokens=last.tokens, tokens_per_sec=rate, mfu=None if last.mfu is None else round(last.mfu, 4),
                   steady_steps=last.steady_steps, machine=last.machine, precision=last.precision)
    if not ppl and not speed:
        row["note"] = f"no {LengthRecord.FILE} or {ThroughputRecord.FILE} under {args.runs}"
    append(args.results, row)
    return 0


def line(args) -> int:
    append(args.results, dict(pair.split("=", 1) for pair in args.pairs))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tools/gpu/parts.py", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--results", required=True, help="the JSON-lines file each part appends its line to")
    verbs = parser.add_subparsers(dest="verb", required=True)
    verb = verbs.add_parser("env")
    verb.add_argument("--rehearse", action="store_true", help="the CPU rehearsal: the device is the CPU")
    verb.set_defaults(run=env)
    verb = verbs.add_parser("prepared")
    verb.add_argument("data")
    verb.add_argument("--status", default="prepared")
    verb.add_argument("--seconds", type=float)
    verb.set_defaults(run=prepared)
    verb = verbs.add_parser("fit")
    verb.add_argument("pe")
    verb.add_argument("runs")
    verb.add_argument("--status", default="done")
    verb.add_argument("--seconds", type=float)
    verb.set_defaults(run=fit)
    verb = verbs.add_parser("line")
    verb.add_argument("pairs", nargs="+", metavar="KEY=VALUE")
    verb.set_defaults(run=line)
    args = parser.parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
