"""``python -m cable_lightning VERB ...`` and the installed ``cable_lightning VERB ...``: every command of the package
in one table.

A verb's module is imported only when the verb runs: ``prepare``'s worker processes import this module again
(spawn), and must not pay for Lightning or transformers to tokenize. Every verb's errors are one ``error:`` line
(exit 2 for a bad setting, file or checkpoint, 1 for a run that failed; ``CABLE_LIGHTNING_DEBUG=1``: the traceback).
"""

from __future__ import annotations

import importlib
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
    "gpu-check": ("cable_lightning.gpu_check", "on a lent GPU: timed fits of every attention backend, in 6 minutes"),
    "retrieval-set": ("cable_lightning.data.retrieval_set", "build a long-document retrieval set from a corpus"),
    "retrieval": ("cable_lightning.hf.retrieval", "fine-tune an exported encoder and score nDCG@10 by length"),
    "lm-eval": ("cable_lightning.hf.lm_eval_lengths", "lm-evaluation-harness tasks on an export at several lengths"),
}
LIGHTNING_VERBS = ("fit", "validate", "test")  # LightningCLI's own subcommands: it reads the verb itself


def usage() -> str:
    width = max(map(len, COMMANDS))
    lines = [f"  {verb:<{width}}  {what}" for verb, (_, what) in COMMANDS.items()]
    return ("usage: python -m cable_lightning VERB [--help] ...\n\n"
            "Train short, test long: positional-encoding research on Lightning.\n\nverbs:\n" + "\n".join(lines))


def replaced_entry_point(module: str) -> NoReturn:
    """What ``python -m <a verb's module>`` does: some were entry points once (``python -m
    cable_lightning.data.prepare``), and a script that still calls one must fail, not exit 0 having done nothing."""
    verbs = " or ".join(f"'python -m cable_lightning {verb}'" for verb, (name, _) in COMMANDS.items() if name == module)
    print(f"error: python -m {module} was replaced by {verbs}", file=sys.stderr, flush=True)
    sys.exit(2)


def main(argv: list[str] | None = None) -> int:
    from_command_line = argv is None
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] in (["-h"], ["--help"]):
        print(usage())
        return 0
    if not argv:
        print(f"{usage()}\n\nerror: name a verb", file=sys.stderr)
        return 2
    verb = argv[0]
    if verb not in COMMANDS:
        print(f"{usage()}\n\nerror: unknown verb {verb!r}; choose one of {', '.join(COMMANDS)}", file=sys.stderr)
        return 2
    from .errors import error_boundary

    module = importlib.import_module(COMMANDS[verb][0])
    with error_boundary():
        if verb in LIGHTNING_VERBS:  # LightningCLI reads sys.argv itself (given both, it warns that they may differ)
            module.run(None if from_command_line else argv)
        else:
            module.main(argv[1:])
    return 0


if __name__ == "__main__":
    sys.exit(main())
