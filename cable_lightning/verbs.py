"""The package's verbs, a table of names and strings that imports nothing: ``__main__`` runs a verb from it, and a
verb's module run as a program (``python -m cable_lightning.data.prepare``) says from it which verb replaced it."""

from __future__ import annotations

import sys
from typing import NoReturn

# verb: (module whose main(argv) runs it, what it does)
COMMANDS = {
    "fit": ("cable_lightning.cli", "train a model (LightningCLI: --config, --model.*, --data.*, --trainer.*)"),
    "validate": ("cable_lightning.cli", "evaluate a checkpoint at every evaluation length"),
    "test": ("cable_lightning.cli", "the same on the test split"),
    "prepare": ("cable_lightning.data.prepare", "tokenize a text source into a prepared folder (or s3:// prefix)"),
    "export": ("cable_lightning.hf.export", "write a fit checkpoint as a Hugging Face model folder"),
    "sweep": ("cable_lightning.sweep", "train one config across encodings, lengths and seeds, then report"),
    "report": ("cable_lightning.eval.report", "tables and figures over runs, with intervals and paired tests"),
    "bench": ("cable_lightning.bench", "speed and memory of every encoding (the paper's Figure 3)"),
    "gpu-check": ("cable_lightning.gpu_check", "CUDA: timed bf16 compiled fits of every attention backend, "
                  "recompiles, memory, 16k evaluation"),
    "retrieval-set": ("cable_lightning.data.retrieval_set", "build a long-document retrieval set from a corpus"),
    "retrieval": ("cable_lightning.hf.retrieval", "fine-tune an exported encoder and score nDCG@10 by length"),
    "lm-eval": ("cable_lightning.hf.lm_eval_lengths", "lm-evaluation-harness tasks on an export at several lengths"),
}
LIGHTNING_VERBS = ("fit", "validate", "test")  # LightningCLI's own subcommands: it reads the verb itself


def replaced_entry_point(module: str) -> NoReturn:
    """What ``python -m <a verb's module>`` does: some were entry points once (``python -m
    cable_lightning.data.prepare``), and a script that still calls one must fail, not exit 0 having done nothing."""
    verbs = " or ".join(f"'python -m cable_lightning {verb}'" for verb, (name, _) in COMMANDS.items() if name == module)
    print(f"error: python -m {module} was replaced by {verbs}", file=sys.stderr, flush=True)
    sys.exit(2)
