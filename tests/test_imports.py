"""The package's parts: one command table whose verbs run from anywhere, and imports with no circle and no upward
arrow (read from the source with ``ast``, imports inside functions included)."""

import ast
import json
import os
import re
import subprocess
import sys

import pytest

from cable_lightning.__main__ import COMMANDS
from cable_lightning.__main__ import main as verbs

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE = os.path.join(ROOT, "cable_lightning")

# Lowest first: a module imports only from its own layer or a lower one (a layer is the package's top-level module
# or folder). docs/design.md shows the same table.
LAYERS = [
    {"__init__", "errors", "verbs"},
    {"positional"},
    {"models"},
    {"console", "owned", "records", "checkpoints", "figures", "tasks", "hardware", "timing"},
    {"data"},
    {"eval"},
    {"lit", "callbacks"},
    {"hf", "cli", "argument_errors", "run_setup", "run_failures"},
    {"sweep", "bench", "gpu_check", "__main__"},
]
# Copied into every export (hf/export.py, CORE_SOURCES): they may import only each other.
CORE = {"errors", "models", "positional"}


def module_files() -> dict[str, str]:
    """{dotted module name: file} for every module of the package."""
    found = {}
    for folder, _, files in os.walk(PACKAGE):
        for file in files:
            if file.endswith(".py"):
                parts = os.path.relpath(os.path.join(folder, file), ROOT)[:-3].split(os.sep)
                found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = os.path.join(folder, file)
    return found


def imports(name: str, file: str, modules: set[str]) -> set[str]:
    """The package's modules that ``file`` (module ``name``) imports, anywhere in it: ``from a import b`` counts as
    ``a.b`` when that is a module, else ``a``."""
    tree = ast.parse(open(file, encoding="utf-8").read(), file)
    package = name if file.endswith("__init__.py") else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names]
        else:
            continue
        found |= {t for t in targets if t in modules and t != name}
    return found


def import_graph() -> dict[str, set[str]]:
    files = module_files()
    return {name: imports(name, file, set(files)) for name, file in files.items()}


def unit(module: str) -> str:
    """The top-level module or folder a module belongs to (``cable_lightning`` itself: ``__init__``)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One circle of imports (its modules, the first repeated at the end), or None."""
    state: dict[str, str] = {}

    def visit(node, path):
        state[node] = "open"
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == "open":
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt, path + [nxt])):
                return cycle
        state[node] = "done"
        return None

    for start in sorted(graph):
        if start not in state and (cycle := visit(start, [start])):
            return cycle
    return None


def test_the_import_checks_can_fail():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None
    graph = import_graph()
    assert "cable_lightning.lit.checkpoint_format" in graph["cable_lightning.lit.modules"]  # relative, from-import
    assert "cable_lightning.data.prepare" in graph["cable_lightning.run_setup"]  # in a function: `from .data import x`


def test_the_imports_have_no_circle():
    assert find_cycle(import_graph()) is None


def test_no_import_points_upward():
    layer = {name: i for i, names in enumerate(LAYERS) for name in names}
    graph = import_graph()
    assert {unit(m) for m in graph} == set(layer), "every top-level module or folder has a layer"
    upward = [(m, t) for m, targets in graph.items() for t in targets if layer[unit(t)] > layer[unit(m)]]
    assert upward == []


def test_the_model_code_that_export_copies_imports_nothing_else_of_the_package():
    pytest.importorskip("safetensors")  # hf.export needs the hf extra
    from cable_lightning.hf.export import CORE_SOURCES

    assert {source.removesuffix(".py") for source in CORE_SOURCES} == CORE
    outside = [(m, t) for m, targets in import_graph().items() if unit(m) in CORE for t in targets
               if unit(t) not in CORE]
    assert outside == []


@pytest.mark.parametrize("verb", [v for v in COMMANDS if v not in ("fit", "validate", "test")])
def test_every_verb_has_help(verb, capsys):
    with pytest.raises(SystemExit) as stop:
        verbs([verb, "--help"])
    assert stop.value.code == 0 and "usage:" in capsys.readouterr().out


def test_the_table_lists_every_verb_and_refuses_an_unknown_one(capsys):
    assert verbs(["--help"]) == 0
    listed = capsys.readouterr().out
    assert all(f"  {verb} " in listed for verb in COMMANDS)
    assert verbs([]) == 2 and "error: name a verb" in capsys.readouterr().err
    assert verbs(["sweeep"]) == 2
    assert "error: unknown verb 'sweeep'; choose one of fit, validate, test, prepare" in capsys.readouterr().err


def test_report_sweep_and_bench_run_from_a_folder_outside_the_clone(tmp_path):
    """What a researcher with the package installed (not a clone) runs: nothing is read from tools/ or the cwd."""
    run = tmp_path / "runs" / "exp" / "cable"
    run.mkdir(parents=True)
    row = {"pe": "cable", "train_length": 32, "stage": "fit", "step": 4, "length": 32, "mode": "nonoverlap",
           "ppl": 9.5}
    (run / "length_eval.jsonl").write_text(json.dumps(row) + "\n")
    env = {**os.environ, "PYTHONPATH": ROOT}  # this checkout's package, as an install would provide it

    def verb(*argv):
        done = subprocess.run([sys.executable, "-m", "cable_lightning", *argv], capture_output=True, text=True,
                              env=env, cwd=tmp_path, timeout=300)
        assert done.returncode == 0, done.stderr
        return done.stdout

    assert "| 32 | **9.50** |" in verb("report", "runs/exp", "--out", "runs/exp/report")
    assert (tmp_path / "runs" / "exp" / "report_nonoverlap.md").exists()
    printed = verb("sweep", "--config", "base.yaml", "--pes", "cable", "alibi", "--print_only").splitlines()
    assert len(printed) == 2 and all(" -m cable_lightning fit --config base.yaml " in line for line in printed)
    assert "--pes" in verb("bench", "--help")


def test_the_design_document_draws_the_same_layers():
    """docs/design.md's table of parts is the one a new maintainer reads first: it lists every part in its layer."""
    import re

    drawn = []
    for line in open(os.path.join(ROOT, "docs", "design.md"), encoding="utf-8"):
        row = re.match(r"\| (\d) \| ([^|]+) \|", line)
        if row:
            drawn.append({name.removesuffix(".py").rstrip("/") for name in re.findall(r"`([^`]+)`", row.group(2))})
    assert drawn == [layer - {"__init__"} for layer in LAYERS]  # the package's own __init__ is no part


# What the product's text may not say: the tracker's numbers, and words about how it was built (machines lent for a
# while, work sessions, helpers, a new user, hashes named after a branch, paths outside the repository).
HOW_IT_WAS_BUILT = re.compile(
    r"\bissues? #?\d+|\blent\b|\blends?\b|\blending\b|\bloans?\b|\bsessions?\b|\bhelpers?\b|\bnew users?\b"
    r"|\b(?:main|branch) [0-9a-f]{7,40}\b|\bthis branch\b|\.\./shared\b", re.IGNORECASE)
# Technical uses of those words, each (file, what the line holds): pytest's fixture scope, TensorBoard's hparams
# session records, boto3's Session, and a test's fake source files.
TECHNICAL = [
    ("tests/conftest.py", 'scope="session"'),
    ("tests/test_tasks.py", "session"),  # TensorBoard's SESSION_START_INFO records
    ("cable_lightning/callbacks/hparams.py", "session_start"),  # TensorBoard's hparams summary
    ("cable_lightning/data/remote.py", "boto3.session.Session"),
    ("tests/test_code_retrieval.py", "helpers"),  # a fake module's name and docstrings
]
SCANNED = ["README.md", "docs", "configs", "tools", "tests", "cable_lightning"]
TEXT = (".py", ".md", ".yaml", ".yml", ".sh", ".txt", ".toml", ".cfg", ".ini")


def product_text() -> list[str]:
    """Every text file of the scanned folders (docs/records, the kept data of runs, excepted)."""
    found = []
    for top in SCANNED:
        path = os.path.join(ROOT, top)
        if os.path.isfile(path):
            found.append(path)
            continue
        for folder, dirs, names in os.walk(path):
            dirs[:] = [d for d in dirs if d != "__pycache__" and os.path.join(folder, d) != os.path.join(ROOT, "docs",
                                                                                                       "records")]
            found += [os.path.join(folder, name) for name in names if name.endswith(TEXT)]
    return sorted(found)


def how_it_was_built(path: str) -> list[str]:
    where = os.path.relpath(path, ROOT)
    allowed = [held for name, held in TECHNICAL if name == where]
    return [f"{where}:{number}: {line.strip()[:100]}" for number, line in enumerate(open(path, encoding="utf-8"), 1)
            if HOW_IT_WAS_BUILT.search(line) and not any(held in line for held in allowed)]


def test_the_product_states_substance_not_how_it_was_built():
    """Code, help text, docs, configs, tools and tests say what a thing is for; issue numbers and words about how the
    project was built mean nothing to a reader of the product (git keeps the story)."""
    assert [path for path in product_text() if path.endswith("test_imports.py")]  # the scan reaches the tests
    cited = [hit for path in product_text() if not path.endswith("test_imports.py") for hit in how_it_was_built(path)]
    assert not cited, cited


def test_the_words_check_catches_a_planted_line(tmp_path, monkeypatch):
    """The check can fail: an issue number, a lent machine and a branch hash are each caught; a technical use on the
    allow-list is not."""
    planted = tmp_path / "x.md"
    planted.write_text("fixed in issue 12\non a lent GPU\nas on main 3d3d900\nplain text\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", str(tmp_path))
    assert [hit.split(":")[1] for hit in how_it_was_built(str(planted))] == ["1", "2", "3"]
    monkeypatch.setattr(sys.modules[__name__], "TECHNICAL", [("x.md", "lent GPU")])
    assert [hit.split(":")[1] for hit in how_it_was_built(str(planted))] == ["1", "3"]
