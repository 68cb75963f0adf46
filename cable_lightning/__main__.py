"""``python -m cable_lightning VERB ...`` and the installed ``cable_lightning VERB ...``: every command of the package,
from one table (``verbs.py``).

A verb's module is imported only when the verb runs: ``prepare``'s worker processes import this module again
(spawn), and must not pay for Lightning or transformers to tokenize. Every verb's errors are one ``error:`` line
(exit 2 for a bad setting, file or checkpoint, 1 for a run that failed; ``CABLE_LIGHTNING_DEBUG=1``: the traceback).
"""

from __future__ import annotations

import importlib
import sys

from .verbs import COMMANDS, LIGHTNING_VERBS


def usage() -> str:
    width = max(map(len, COMMANDS))
    lines = [f"  {verb:<{width}}  {what}" for verb, (_, what) in COMMANDS.items()]
    return ("usage: python -m cable_lightning VERB [--help] ...\n\n"
            "Train short, test long: positional-encoding research on Lightning.\n\nverbs:\n" + "\n".join(lines))


def main(argv: list[str] | None = None) -> int:
    """Runs a verb inside the error boundary, this module's own output (the usage) included."""
    from .errors import error_boundary

    with error_boundary():
        return run_verb(argv)


def run_verb(argv: list[str] | None) -> int:
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
    module = importlib.import_module(COMMANDS[verb][0])
    if verb in LIGHTNING_VERBS:  # LightningCLI reads sys.argv itself (given both, it warns that they may differ)
        module.run(None if from_command_line else argv)
    else:
        module.main(argv[1:])
    return 0


if __name__ == "__main__":
    sys.exit(main())
