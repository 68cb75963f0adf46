"""Prepare FineWeb-Edu as the CABLE paper used it: the sample-10BT config, GPT-2's BPE, 0.1B tokens held out.

    python tools/prepare_fineweb.py                       # -> data/fineweb-edu-gpt2
    python tools/prepare_fineweb.py --tokenizer bert-base-uncased --out data/fineweb-edu-bert   # the BERT runs
    python tools/prepare_fineweb.py --tokenizer gpt2:/models/r50k_base.tiktoken                 # no tiktoken download

Needs the Hugging Face hub (the text is streamed, about 27 GB) and takes hours on a few cores; the output is
about 20 GB of uint16 tokens. Re-running on a finished output is a no-op.
"""

from __future__ import annotations

import argparse
import sys

PAPER_VAL_TOKENS = 100_000_000


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default="sample-10BT", help="FineWeb-Edu config (sample-10BT, sample-100BT, ...)")
    p.add_argument("--tokenizer", default="gpt2")
    p.add_argument("--out", default=None, help="default: data/fineweb-edu-gpt2 (or -bert for a bert tokenizer)")
    p.add_argument("--val-tokens", type=int, default=PAPER_VAL_TOKENS)
    p.add_argument("--num-workers", type=int, default=None)
    p.add_argument("--overwrite", action="store_true")
    args = p.parse_args(argv)
    source = "fineweb-edu" if args.config == "sample-10BT" else f"fineweb-edu:{args.config}"
    out = args.out or f"data/fineweb-edu-{'bert' if args.tokenizer.startswith('bert') else 'gpt2'}"
    from cable_lightning.data.prepare import main as prepare_main

    forwarded = ["--source", source, "--tokenizer", args.tokenizer, "--out", out, "--val-tokens", str(args.val_tokens)]
    if args.num_workers is not None:
        forwarded += ["--num-workers", str(args.num_workers)]
    if args.overwrite:
        forwarded.append("--overwrite")
    return prepare_main(forwarded)


if __name__ == "__main__":
    from cable_lightning.errors import error_boundary

    with error_boundary():
        sys.exit(main())
