"""lm-evaluation-harness tasks on an exported model at several maximum input lengths, as one table.

    python -m cable_lightning lm-eval --model exports/gpt2-tiny-cable --tasks hellaswag --lengths 1024 2048 4096 \
        --out results/hellaswag --device cuda --batch_size 16 --trust_remote_code

Each length is one run of the harness's own evaluation (``lm_eval.simple_evaluate`` with the ``hf`` model and
``max_length=L``: the harness keeps the last L tokens of each input), the same as

    lm_eval --model hf --model_args pretrained=DIR,trust_remote_code=True,max_length=L --tasks hellaswag

Lengths only matter for inputs longer than them: HellaSwag's fit in about 150 tokens, so its numbers do not move
with the length; long-context tasks' do. Writes ``<out>/table.md`` and ``table.csv`` (rows: length, columns:
task/metric) and the harness's results per length (``<out>/len_<L>.json``); prints the table. ``--include_path``
adds a folder of task YAMLs (a local task over local files runs offline).
"""

from __future__ import annotations

import ast
import csv
import glob
import json
import math
import os

from cable_lightning.errors import ArgumentParser, ConfigError, MissingFileError
from cable_lightning.eval.tables import markdown_table, write_markdown


def evaluate(model: str, tasks: list[str], lengths: list[int | None], include_path: str | None = None,
             batch_size: int = 1, device: str = "cpu", limit: float | None = None,
             bootstrap_iters: int = 100000, include_defaults: bool = True,
             trust_remote_code: bool = False) -> dict[int | None, dict]:
    """``{length: {task: {metric: value}}}``; ``None`` is the model's own maximum (its training length). An export
    runs its own code (``modeling_cable.py``): that needs ``trust_remote_code``."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    from cable_lightning.hf.export import check_remote_code

    if include_path is not None and not os.path.isdir(include_path):
        raise MissingFileError(f"--include_path {include_path} is not a folder; give the folder of your task YAMLs")
    manager = TaskManager(include_path=include_path, include_defaults=include_defaults)
    check_tasks(tasks, manager, include_path, include_defaults)
    check_task_data(tasks, manager)
    check_remote_code(model, trust_remote_code)
    check_model(model, trust_remote_code)
    scores = {}
    for length in lengths:
        model_args = {"pretrained": model, "trust_remote_code": trust_remote_code}
        if length is not None:
            model_args["max_length"] = length
        results = lm_eval.simple_evaluate(model="hf", model_args=model_args, tasks=tasks, task_manager=manager,
                                          batch_size=batch_size, device=device, limit=limit, log_samples=False,
                                          bootstrap_iters=bootstrap_iters)
        # the harness names a metric "<metric>,<filter>" (beside it: "alias", "sample_len" and the stderr entries)
        scores[length] = {task: {name.split(",")[0]: value for name, value in metrics.items()
                                 if "," in name and "_stderr" not in name and isinstance(value, (int, float))}
                          for task, metrics in results["results"].items()}
    return scores


def check_tasks(tasks: list[str], manager, include_path: str | None, include_defaults: bool) -> None:
    """Every task is one the harness indexed (or a task YAML's path), before the model is loaded; the harness skips a
    task YAML it cannot read without a word, so such files under ``include_path`` are named."""
    from lm_eval.tasks._yaml_loader import load_yaml  # the loader the harness indexes with

    unknown = [task for task in tasks if not manager.match_tasks([task]) and not os.path.isfile(task)]
    if not unknown:
        return
    broken = []
    for path in sorted(glob.glob(os.path.join(include_path, "**", "*.yaml"), recursive=True)) if include_path else ():
        try:
            load_yaml(path, resolve_func=False, recursive=True)
        except Exception as exc:  # noqa: BLE001 - yaml and the harness raise their own types
            broken.append(f"{path} does not load ({type(exc).__name__}: {(str(exc).splitlines() or [''])[0]})")
    where = (f"the tasks of --include_path {include_path}: {', '.join(manager.all_tasks) or 'none'}"
             if include_path and not include_defaults else "`lm_eval ls tasks` lists the harness's tasks")
    raise ConfigError(f"unknown lm-eval task {', '.join(map(repr, unknown))}; "
                      + ("; ".join(broken) + "; fix it" if broken else f"valid: {where}"))


def check_task_data(tasks: list[str], manager) -> None:
    """The local jsonl files of a ``dataset_path: json`` task are there and read row by row, and every row has the
    label its ``doc_to_target`` reads, before the model is loaded: the harness (datasets) reports a missing file or a
    torn row as a long traceback that names neither the file nor the line, and scores a row without its label (the
    template renders ``None``) with a warning among its log lines."""
    for task in tasks:
        entry = getattr(manager, "task_index", {}).get(task)
        config = getattr(entry, "cfg", None) or {}
        if config.get("dataset_path") != "json":
            continue
        files = (config.get("dataset_kwargs") or {}).get("data_files") or []
        for group in files.values() if isinstance(files, dict) else [files]:
            for path in [group] if isinstance(group, str) else group:
                if "://" in path or glob.has_magic(path):
                    continue  # a URL or a glob: the harness's to read
                if not os.path.isfile(path):
                    raise MissingFileError(f"{path} is not a file; task {task} reads its data from it (its YAML's "
                                           "dataset_kwargs.data_files): restore the file or fix the path")
                rows = []
                with open(path, encoding="utf-8", errors="replace") as f:
                    for number, line in enumerate(f, 1):
                        if not line.strip():
                            continue
                        try:
                            rows.append((number, json.loads(line.strip())))
                        except ValueError as exc:
                            raise ConfigError(f"{path}:{number}: not a JSON row ({exc}); task {task} cannot read its "
                                              "data: fix or remove that line") from None
                check_labels(task, config, path, rows)
                check_choices(task, config, path, rows)


def check_labels(task: str, config: dict, path: str, rows: list[tuple[int, object]]) -> None:
    """Every row holds (not null) each field the task's ``doc_to_target`` reads: a template's variables, or the
    column it names (a name no row has is a constant). A target made by code (``!function``) or from rows that
    ``process_docs`` rewrites is the harness's to check."""
    target = config.get("doc_to_target")
    if not isinstance(target, str) or target.startswith("!function") or config.get("process_docs"):
        return
    if "{{" in target or "{%" in target:
        from jinja2 import Environment, meta  # the harness's templates

        fields = sorted(meta.find_undeclared_variables(Environment().parse(target)))
    else:
        fields = [target] if any(isinstance(row, dict) and target in row for _, row in rows) else []
    for number, row in rows:
        missing = [field for field in fields if not isinstance(row, dict) or row.get(field) is None]
        if missing:
            raise ConfigError(f"{path}:{number}: the row has no {missing[0]!r}; task {task} reads its label from it "
                              f"(doc_to_target {target!r}), and the harness would score the row without one: give the "
                              "row its label or remove that line")


def check_choices(task: str, config: dict, path: str, rows: list[tuple[int, object]]) -> None:
    """A multiple-choice row's label names one of its choices: an index from 0 to the number of choices less one, or
    the text of a choice. The harness scores a label outside them (9 of 4 choices) with a warning among its log
    lines. Read as the harness reads them (a column, a template, a list); choices or a target made by code are the
    harness's to check."""
    choice, target = config.get("doc_to_choice"), config.get("doc_to_target")
    if config.get("output_type") != "multiple_choice" or config.get("process_docs") or choice is None:
        return
    from lm_eval.utils import apply_template

    features = {key for _, row in rows if isinstance(row, dict) for key in row}
    for number, row in rows:
        if not isinstance(row, dict):
            continue
        try:
            if isinstance(choice, str):
                choices = row[choice] if choice in features else ast.literal_eval(apply_template(choice, row))
            else:
                choices = list(choice.values()) if isinstance(choice, dict) else choice
            label = row[target] if isinstance(target, str) and target in features else target
            if isinstance(label, str) and not (isinstance(target, str) and target in features):
                label = apply_template(label, row)
                label = int(label) if label.isdigit() else label
        except Exception:  # noqa: BLE001 - not readable this way: the harness's to read (and report)
            continue
        if not isinstance(choices, list) or label is None or isinstance(label, (list, bool)):
            continue
        if isinstance(label, int) and not 0 <= label < len(choices) or isinstance(label, str) and label not in choices:
            raise ConfigError(f"{path}:{number}: label {label!r} is not one of the row's {len(choices)} choices (an "
                              f"index from 0 to {len(choices) - 1} or a choice's text); task {task} would score the "
                              "row against no answer: fix its label or remove that line")


def check_model(model: str, trust_remote_code: bool) -> None:
    """A model that is not a folder is a hub id: its config must load (offline, a missing folder fails here)."""
    if os.path.isdir(model):
        return
    from transformers import AutoConfig

    try:
        AutoConfig.from_pretrained(model, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as exc:
        raise MissingFileError(f"--model {model} is not a folder and does not load from the hub "
                               f"({(str(exc).strip().splitlines() or [''])[0]}); give a folder written by "
                               "`python -m cable_lightning export`") from None


def table(scores: dict[int | None, dict]) -> tuple[list[str], list[list[str]]]:
    columns = sorted({f"{task}/{metric}" for per_task in scores.values() for task, metrics in per_task.items()
                      for metric in metrics})
    rows = []
    for length, per_task in scores.items():
        values = {f"{task}/{metric}": v for task, metrics in per_task.items() for metric, v in metrics.items()}
        rows.append([str(length) if length is not None else "model"] +
                    [f"{values[c]:.4f}" if c in values and math.isfinite(values[c]) else "-" for c in columns])
    return ["length", *columns], rows


def write(scores: dict[int | None, dict], out: str) -> str:
    os.makedirs(out, exist_ok=True)
    header, rows = table(scores)
    with open(os.path.join(out, "table.csv"), "w", newline="", encoding="utf-8") as f:
        csv.writer(f).writerows([header, *rows])
    markdown = markdown_table(header, rows) + "\n"
    write_markdown(os.path.join(out, "table.md"), markdown[:-1])
    for length, per_task in scores.items():
        with open(os.path.join(out, f"len_{length or 'model'}.json"), "w", encoding="utf-8") as f:
            json.dump(per_task, f, indent=2)
    return markdown


def main(argv: list[str] | None = None) -> None:
    parser = ArgumentParser(prog="python -m cable_lightning lm-eval", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="a folder written by `python -m cable_lightning export`")
    parser.add_argument("--tasks", nargs="+", required=True, help="lm-eval task names (e.g. hellaswag)")
    parser.add_argument("--lengths", nargs="+", type=int, default=None,
                        help="maximum input lengths (default: the model's training length)")
    parser.add_argument("--out", required=True)
    parser.add_argument("--include_path", default=None, help="a folder of extra task YAMLs")
    parser.add_argument("--only_include_path", action="store_true",
                        help="index only --include_path's tasks (the harness's built-in ones take about 20 s to index)")
    parser.add_argument("--batch_size", type=int, default=1)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--limit", type=float, default=None, help="documents per task (for a quick look)")
    parser.add_argument("--bootstrap_iters", type=int, default=100000, help="for standard errors; 0 skips them")
    parser.add_argument("--trust_remote_code", action="store_true",
                        help="let the model run its own code (an export's modeling_cable.py needs it), as transformers")
    args = parser.parse_args(argv)
    if args.lengths is not None and min(args.lengths) < 1:
        parser.error(f"--lengths must be positive, got {args.lengths}")
    scores = evaluate(args.model, args.tasks, args.lengths or [None], args.include_path, args.batch_size, args.device,
                      args.limit, args.bootstrap_iters, include_defaults=not args.only_include_path,
                      trust_remote_code=args.trust_remote_code)
    print(write(scores, args.out), end="")


if __name__ == "__main__":  # an entry point once: say which verb replaced it, never exit 0 having done nothing
    from cable_lightning.verbs import replaced_entry_point

    replaced_entry_point(__spec__.name)
