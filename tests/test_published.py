"""Every published table is what ``report`` makes of its committed records, and every published command trains the
recipe its records were trained with.

A table in README.md or docs/ is published from records when it sits between ``<!-- report: FOLDER BLOCK -->`` and
``<!-- /report -->``: FOLDER is docs/records/FOLDER (``A+B``: the report over several folders at once, for a table
across experiments), BLOCK the name of one of ``report``'s tables (the ``## BLOCK``
headings it prints). A command is published for FOLDER by ``<!-- command: FOLDER -->`` before a ```` ```bash ````
block holding its ``python -m cable_lightning sweep`` line.
"""

from __future__ import annotations

import contextlib
import glob
import io
import os
import re
import shlex

import pytest
import yaml

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RECORDS = os.path.join(ROOT, "docs", "records")
TABLE = re.compile(r"<!-- report: (\S+) (.+?) -->\n(.*?)\n<!-- /report -->", re.S)
COMMAND = re.compile(r"<!-- command: (\S+) -->\n```bash\n(.*?)```", re.S)
# Filled in by the fit itself from the settings compared here (the run folder, the logger, the validation interval
# from the checkpoint interval), or the sweep's own resume flag: not part of a recipe.
AT_RUN_TIME = ("checkpoint.dirpath", "ckpt_path", "trainer.logger", "trainer.val_check_interval",
               "trainer.check_val_every_n_epoch")
# Settings that came after some records were kept, each with the value that trains what those records trained: a
# record without the setting matches a command only where the command gives it that value.
ADDED_LATER = {f"model.init_args.backbone.{switch}": False for switch in ("attn_gate", "attn_sink", "qk_norm")}


def published_files() -> list[str]:
    return [os.path.join(ROOT, "README.md"), *sorted(glob.glob(os.path.join(ROOT, "docs", "**", "*.md"),
                                                              recursive=True))]


def marks(pattern: re.Pattern) -> list[tuple[str, tuple[str, ...]]]:
    found = []
    for path in published_files():
        with open(path, encoding="utf-8") as f:
            found += [(os.path.relpath(path, ROOT), m.groups()) for m in pattern.finditer(f.read())]
    return found


def records_folders() -> list[str]:
    return sorted(d for d in os.listdir(RECORDS) if os.path.isdir(os.path.join(RECORDS, d)))


@pytest.fixture(scope="module")
def reports(tmp_path_factory):
    """Each records folder's tables, built once (no figures)."""
    from cable_lightning.eval.report import report

    out = tmp_path_factory.mktemp("reports")
    return {folder: report([os.path.join(RECORDS, part) for part in folder.split("+")], str(out / folder),
                           figures=False)
            for folder in {folder for _, (folder, *_) in marks(TABLE)}}


def test_every_published_table_is_what_report_makes_of_its_records(reports):
    tables = marks(TABLE)
    assert tables, "no table in README.md or docs/ is marked as published from records"
    for where, (folder, block, text) in tables:
        for part in folder.split("+"):
            assert os.path.isdir(os.path.join(RECORDS, part)), f"{where}: no records folder docs/records/{part}"
        made = reports[folder]
        assert block in made, f"{where}: report makes no table {block!r} of docs/records/{folder} ({sorted(made)})"
        assert text.strip() == made[block].strip(), (
            f"{where}: the table {block!r} differs from what `python -m cable_lightning report "
            f"{' '.join('docs/records/' + part for part in folder.split('+'))}` "
            f"makes of its records; paste its output again")


def test_every_records_folder_backs_a_published_table_and_names_its_command():
    tabled = {part for _, (folder, *_) in marks(TABLE) for part in folder.split("+")}
    commanded = {folder for _, (folder, _) in marks(COMMAND)}
    for folder in records_folders():
        assert folder in tabled, f"docs/records/{folder} backs no published table (no <!-- report: {folder} ... -->)"
        assert folder in commanded, f"docs/records/{folder} has no published command (<!-- command: {folder} -->)"


def flat(tree: dict, prefix: str = "") -> dict:
    out = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            out |= flat(value, f"{prefix}{key}.")
        else:
            out[f"{prefix}{key}"] = value
    return out


def recipe(config: dict) -> dict:
    """The flat settings that define a run; an encoding's class path as its class's own path, so that records whose
    paths end in the encoding's name (``cable_lightning.positional.rope.rope``) name the same encoding as they did."""
    from cable_lightning.positional.registry import class_path, encoding_class

    return {k: class_path(encoding_class(v)) if k.endswith("pos_encoding.class_path") else v
            for k, v in flat(config).items() if not k.startswith(AT_RUN_TIME)}


def resolved(fit: list[str]) -> dict:
    """The config a fit command would train with, resolved by the fit's own parser (nothing built)."""
    from cable_lightning.cli import main

    printed = io.StringIO()
    with contextlib.redirect_stdout(printed), pytest.raises(SystemExit):
        main(fit + ["--print_config"])
    return yaml.safe_load(printed.getvalue())


def sweep_lines(block: str) -> list[list[str]]:
    """The arguments of each ``python -m cable_lightning sweep`` line of a command block (continuations joined)."""
    lines = block.replace("\\\n", " ").splitlines()
    return [shlex.split(line)[4:] for line in lines if line.strip().startswith("python -m cable_lightning sweep")]


def fits_of(sweep: list[str]) -> list[str]:
    """The sweep's fits alone: a retrieval stage trains no weights of the run (and needs its set)."""
    if "--stage" not in sweep:
        return sweep
    return [*sweep[:sweep.index("--stage")], "--stage", "fit", *sweep[sweep.index("--stage") + 2:]]


def drift(sweeps: list[list[str]], records: str) -> list[str]:
    """What published sweeps would train differently from their records: a line per run whose resolved config
    differs (naming the settings), lacks records, or has records none of the commands trains."""
    from cable_lightning import sweep as sweeping

    found = {}
    for path in glob.glob(os.path.join(records, "**", "config.yaml"), recursive=True):
        with open(path, encoding="utf-8") as f:
            config = yaml.safe_load(f)
        found[os.path.dirname(config["checkpoint"]["dirpath"])] = (os.path.relpath(path, ROOT), config)
    lines = []
    for _, cmd in (cmd for sweep in sweeps for cmd in sweeping.commands(sweeping.parse_args(fits_of(sweep)))):
        config = resolved(cmd[cmd.index("fit"):])
        from jsonargparse import dict_to_namespace

        from cable_lightning.run_setup import run_folder

        run = run_folder(dict_to_namespace(config))
        if run not in found:
            lines.append(f"{run}: the command trains it, and no records hold it")
            continue
        where, kept = found.pop(run)
        theirs, mine = recipe(kept), recipe(config)
        theirs = {**{k: v for k, v in ADDED_LATER.items() if k in mine}, **theirs}
        differ = sorted(k for k in theirs.keys() | mine.keys() if theirs.get(k) != mine.get(k))
        if differ:
            lines.append(f"{run}: " + ", ".join(f"{k} {mine.get(k)!r} (records, {where}: {theirs.get(k)!r})"
                                                 for k in differ))
    lines += [f"{run}: its records ({where}) are of a run the command does not train"
              for run, (where, _) in found.items()]
    return lines


def test_every_published_command_trains_its_records_recipe():
    commands = marks(COMMAND)
    assert commands
    for where, (folder, block) in commands:
        with contextlib.chdir(ROOT):
            problems = drift(sweep_lines(block), os.path.join(RECORDS, folder))
        assert not problems, f"{where}: the published command for docs/records/{folder} drifted: {problems}"


CODE_LONG_SWEEP = ["--config", "configs/code_long.yaml", "--experiment", "code-long", "--pes", "cable", "--seeds", "0"]


def recorded_as_published(tmp_path) -> tuple[str, dict]:
    """(a records folder's run folder, the config the published code-long sweep of CABLE's seed 0 resolves to, as
    a run would keep it): what the drift tests change one setting of."""
    kept = os.path.join(tmp_path, "cable", "seed0")
    os.makedirs(kept)
    with contextlib.chdir(ROOT):
        config = resolved(["fit", "--config", "configs/code_long.yaml", "--experiment", "code-long",
                           "--seed_everything", "0", "--folder_per_seed", "true"])
    config["checkpoint"]["dirpath"] = "runs/code-long/cable/seed0/checkpoints"
    return kept, config


def keep(kept: str, config: dict) -> None:
    """``config`` as the run's records would hold it, in the records folder ``kept``."""
    with open(os.path.join(kept, "config.yaml"), "w") as f:
        yaml.safe_dump(config, f)


def test_a_published_command_whose_config_changed_its_precision_fails(tmp_path):
    """The nine-encoding table's case: its records trained in fp32, and the quickstart config it names became
    bf16-mixed: the command as written trains another recipe, and the comparison names the setting."""
    kept, config = recorded_as_published(tmp_path)
    with contextlib.chdir(ROOT):
        keep(kept, config)
        assert drift([CODE_LONG_SWEEP], str(tmp_path)) == []
        config["trainer"]["precision"] = "32-true"
        keep(kept, config)
        [line] = drift([CODE_LONG_SWEEP], str(tmp_path))
    assert line.startswith("runs/code-long/cable/seed0: trainer.precision 'bf16-mixed' (records, ") and \
        line.endswith(": '32-true')"), line


def test_a_record_kept_before_the_switches_matches_only_a_command_without_them(tmp_path):
    """Records kept before the attention switches existed hold none of them: they match a command that leaves each
    off, and a record of a run without the gate is never the records of a run with it."""
    kept, config = recorded_as_published(tmp_path)
    for switch in ADDED_LATER:
        del config["model"]["init_args"]["backbone"][switch.rsplit(".", 1)[1]]
    with contextlib.chdir(ROOT):
        keep(kept, config)
        assert drift([CODE_LONG_SWEEP], str(tmp_path)) == []
        config["checkpoint"]["dirpath"] = "runs/code-long/cable+attn_gate/seed0/checkpoints"
        keep(kept, config)
        switched = [*CODE_LONG_SWEEP[:5], "cable+attn_gate", *CODE_LONG_SWEEP[6:]]
        [line] = drift([switched], str(tmp_path))
    assert line == ("runs/code-long/cable+attn_gate/seed0: model.init_args.backbone.attn_gate True (records, "
                    f"{os.path.relpath(os.path.join(kept, 'config.yaml'), ROOT)}: False)"), line


def test_a_record_naming_its_encoding_by_another_path_matches_and_another_encoding_does_not(tmp_path):
    """Records hold class paths ending in the encoding's name (``...positional.cable.cable``): the same encoding as
    the command's ``...positional.cable.Cable``; a record of another encoding is a drift naming the setting."""
    kept, config = recorded_as_published(tmp_path)
    with contextlib.chdir(ROOT):
        encoding = config["model"]["init_args"]["backbone"]["pos_encoding"]
        assert encoding["class_path"] == "cable_lightning.positional.cable.Cable"
        for path, drifted in [("cable_lightning.positional.cable.cable", False),
                              ("cable_lightning.positional.cable.cable_nw", True)]:
            encoding["class_path"] = path
            keep(kept, config)
            lines = drift([CODE_LONG_SWEEP], str(tmp_path))
            assert bool(lines) == drifted, lines
    assert "model.init_args.backbone.pos_encoding.class_path 'cable_lightning.positional.cable.Cable' (records" in \
        lines[0] and lines[0].endswith(": 'cable_lightning.positional.cable.CableNw')"), lines


def test_the_512_token_long_table_differs_from_the_128_token_one_in_its_length_alone():
    """The training-length comparison holds everything else fixed: the same model, schedule, precision, corpus and
    held-out tokens, and the same tokens a step (16 x 128 = 4 x 512), evaluated at the same multiples."""
    with contextlib.chdir(ROOT):
        short = recipe(resolved(["fit", "--config", "configs/code_long.yaml"]))
        long = recipe(resolved(["fit", "--config", "configs/code_long.yaml", "--config", "configs/code_long_512.yaml"]))
    differ = {k for k in short.keys() | long.keys() if short.get(k) != long.get(k)}
    assert differ == {"experiment", "data.block_size", "data.micro_batch_size", "data.eval_lengths"}, differ
    assert short["data.block_size"] * short["data.micro_batch_size"] == long["data.block_size"] * \
        long["data.micro_batch_size"]
    assert [n // short["data.block_size"] for n in short["data.eval_lengths"]] == \
        [n // long["data.block_size"] for n in long["data.eval_lengths"]]
