"""The commands the README shows still parse: every line of its bash blocks is either checked here (its
``--print_config`` or ``--help`` form exits 0) or named in ``NOT_CHECKED`` with the reason."""

import contextlib
import io
import os
import re
import runpy
import shlex
import sys

import pytest

from cable_lightning.__main__ import COMMANDS as VERBS

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Lines of the README's bash blocks that are not run here, and why. The test fails when this list and the README
# disagree, so a new command is either checked or named here.
NOT_CHECKED = {
    "python3 -m venv .venv && . .venv/bin/activate": "makes a virtualenv (the shell's, not a command of this package)",
    "bash tools/install.sh": "installs packages from PyPI (network); CI runs it first (.ci/run)",
    "python -m pytest tests -q -n 2": "the test suite itself",
    "tensorboard --logdir runs/": "another project's server, not this package's command",
}


def readme_commands() -> list[str]:
    """Each command line of the README's ```bash blocks: continuation lines joined, comments dropped."""
    text = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()
    lines = []
    for block in re.findall(r"^```bash\n(.*?)^```", text, flags=re.S | re.M):
        for line in re.sub(r"\\\n\s*", " ", block).splitlines():
            line = line.strip()
            if line and not line.startswith("#"):
                lines.append(line)
    return lines


def checked_form(line: str) -> tuple[str, list[str]]:
    """(kind, argv) of the form to run: ``--print_config`` for the LightningCLI subcommands, ``--help`` for the
    rest (before a ``--`` that passes the remaining arguments on, so it is read as an option)."""
    argv = shlex.split(line, comments=True)
    if argv[:3] == ["python", "-m", "cable_lightning"] and argv[3] in ("fit", "validate", "test"):
        return "cli", argv[3:] + ["--print_config"]
    cut = argv.index("--") if "--" in argv else len(argv)
    argv = argv[:cut] + ["--help"] + argv[cut:]
    if argv[:3] == ["python", "-m", "cable_lightning"] and argv[3] in VERBS:  # prepare, export, sweep, ...
        return "verb", argv[3:]
    if argv[0] == "python" and argv[1].startswith("tools/") and argv[1].endswith(".py"):
        return "tool", argv[1:]
    return "unknown", argv


def exit_code(kind: str, argv: list[str]) -> int:
    """Runs the form in this process (each imports torch and Lightning once, here); its exit status."""
    out, saved = io.StringIO(), sys.argv
    sys.argv = argv if kind == "tool" else ["python -m cable_lightning"]  # tools read it; the others get argv
    try:
        with contextlib.redirect_stdout(out):
            if kind == "cli":
                from cable_lightning.cli import run

                run(argv)
            elif kind == "verb":
                from cable_lightning.__main__ import main

                main(argv)
            else:
                runpy.run_path(os.path.join(ROOT, argv[0]), run_name="__main__")
    except SystemExit as stop:
        return 0 if stop.code is None else stop.code if isinstance(stop.code, int) else 1
    finally:
        sys.argv = saved
    return 0 if out.getvalue() else 1  # --print_config and --help print and exit; a form that ran on is wrong


COMMANDS = readme_commands()
CHECKED = [line for line in COMMANDS if line not in NOT_CHECKED]


def test_every_readme_command_is_checked_or_named_with_a_reason():
    assert set(COMMANDS) - set(CHECKED) == set(NOT_CHECKED)
    assert all(checked_form(line)[0] != "unknown" for line in CHECKED), [
        line for line in CHECKED if checked_form(line)[0] == "unknown"]
    assert len(CHECKED) >= 8  # the quickstart, the main commands, the tools


@pytest.mark.parametrize("line", CHECKED)
def test_readme_command_parses(line, monkeypatch):
    monkeypatch.chdir(ROOT)  # the README's paths are relative to the repository
    monkeypatch.syspath_prepend(os.path.join(ROOT, "tools"))  # as `python tools/x.py` puts tools/ first
    kind, argv = checked_form(line)
    assert exit_code(kind, argv) == 0, line


@pytest.mark.parametrize("line", [
    "python -m cable_lightning fit --config configs/quickstart.yaml --model.init_args.backbone.pos_encoding ropee",
    "python -m cable_lightning validate --config configs/no_such.yaml",
    "python tools/no_such_tool.py --out x",
])
def test_a_broken_command_is_caught(line, monkeypatch, capsys):
    """The check can fail: a misspelt encoding, a missing config and a missing tool do not exit 0."""
    monkeypatch.chdir(ROOT)
    kind, argv = checked_form(line)
    try:
        code = exit_code(kind, argv)
    except (FileNotFoundError, OSError):
        code = 1
    assert code != 0
