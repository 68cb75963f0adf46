"""How encodings are named: each class says its ``name`` (the registry key, the command line's and the records'
label), is that name in CapWords, and is found by its name, its class path and the class path records and checkpoints
hold (``cable_lightning.positional.<file>.<name>``), on the command line and in every committed record."""

import glob
import os
from dataclasses import dataclass

import pytest
import torch
import yaml
from conftest import printed_backbone

from cable_lightning.errors import ConfigError
from cable_lightning.models.config import SWITCHES, split_switches
from cable_lightning.positional import Encoding, available, encoding_class, encoding_from
from cable_lightning.positional.registry import class_path, named_class

ROOT = os.path.join(os.path.dirname(__file__), "..")
RECORDS = os.path.join(ROOT, "docs", "records")


def recorded_path(cls: type) -> str:
    """The class path that records and checkpoints written when the class bore the encoding's name hold."""
    return f"{cls.__module__}.{cls.name}"


@pytest.mark.parametrize("name", available())
def test_an_encoding_is_found_by_its_name_its_class_path_and_the_recorded_path(name):
    cls = encoding_class(name)
    assert cls.name == name and cls.__qualname__ == "".join(part.capitalize() for part in name.split("_"))
    assert encoding_class(class_path(cls)) is cls and encoding_class(recorded_path(cls)) is cls
    assert encoding_from({"class_path": recorded_path(cls), "init_args": {}}) == cls()
    assert cls().to_dict()["class_path"] == class_path(cls)


def test_a_path_naming_another_file_or_no_encoding_is_refused_in_one_line():
    for given in ("cable_lightning.positional.rope.cable", "cable_lightning.positional.rope.Ropee", "ropee"):
        assert named_class(given) is None
        with pytest.raises(ConfigError, match=rf"^unknown positional encoding '{given}'; valid names: alibi, "):
            encoding_class(given)


def test_an_encoding_class_must_name_itself_and_take_a_free_name(monkeypatch):
    monkeypatch.setattr(Encoding, "registered", dict(Encoding.registered))  # forgotten after the test
    rope = encoding_class("rope")
    with pytest.raises(TypeError, match=r"^encoding class Scaled must set its own name"):
        @dataclass
        class Scaled(rope):  # a subclass of another encoding inherits its name: it must give its own
            pass
    with pytest.raises(TypeError, match=r"^encoding name 'rope' of Other is taken by Rope$"):
        @dataclass
        class Other(Encoding):
            name = "rope"


def record_encodings() -> list[tuple[str, dict, str]]:
    """(record file, its encoding section, the encoding its run folder names) of every committed record config; the
    folder's switches must be the ones the run has on."""
    found = []
    for path in sorted(glob.glob(os.path.join(RECORDS, "**", "config.yaml"), recursive=True)):
        with open(path, encoding="utf-8") as f:
            config = yaml.safe_load(f)
        run = os.path.dirname(config["checkpoint"]["dirpath"]).split("/")  # runs/<experiment>/<encoding>[/seed<N>]
        encoding, switches = split_switches(run[2])  # the folder names the attention switches the run has on
        backbone = config["model"]["init_args"]["backbone"]
        assert switches == [name for name in SWITCHES if backbone.get(name)], path
        found.append((os.path.relpath(path, ROOT), backbone["pos_encoding"], encoding))
    return found


def class_paths(encoding: dict) -> list[str]:
    """Every class path of an encoding section, a wrapped encoding's included."""
    inner = [value for value in (encoding.get("init_args") or {}).values() if isinstance(value, dict)]
    return [encoding["class_path"]] + [path for value in inner if "class_path" in value for path in class_paths(value)]


def test_every_class_path_in_the_committed_records_is_the_encoding_its_run_folder_names():
    records = record_encodings()
    assert records
    for where, encoding, label in records:
        assert encoding_from(encoding).label(runtime=False) == label, where
        for path in class_paths(encoding):
            cls = encoding_class(path)  # a record holds the class's path, or the one it had when named as its encoding
            assert path in (class_path(cls), recorded_path(cls)), (where, path)


def test_the_fit_parser_reads_every_recorded_path_as_the_class_path(capsys):
    """As a record's config.yaml gives it to ``--config``: the parsed config names the class by its path."""
    flag = "--model.init_args.backbone.pos_encoding"
    for path in sorted({path for _, encoding, _ in record_encodings() for path in class_paths(encoding)}):
        backbone = printed_backbone(capsys, flag, f'{{"class_path": "{path}"}}')
        assert backbone["pos_encoding"]["class_path"] == class_path(encoding_class(path)), path
    for given in ("rope", "cable_lightning.positional.rope.Rope", "cable_lightning.positional.rope.rope"):
        assert printed_backbone(capsys, flag, given)["pos_encoding"]["class_path"] == \
            "cable_lightning.positional.rope.Rope", given


def test_a_checkpoint_naming_its_encoding_by_the_recorded_path_resumes_as_the_same_run(tiny_corpus_dir, tmp_path):
    """A checkpoint written when the classes bore the encodings' names holds ``...positional.rope.rope``: a resume
    from it that names the encoding takes that encoding's settings from it (RoPE's base here, not the default) and
    trains on."""
    from conftest import args as cli_args

    from cable_lightning.cli import main

    runs = str(tmp_path / "runs")
    fit = [*cli_args(tiny_corpus_dir, runs, pe="rope", steps=2, every=2),
           "--model.init_args.backbone.pos_encoding.base", "500"]
    main(["fit", *fit])
    last = os.path.join(runs, "test", "rope", "checkpoints", "last.ckpt")
    checkpoint = torch.load(last, weights_only=True)
    encoding = checkpoint["hyper_parameters"]["backbone"]["pos_encoding"]
    assert encoding["class_path"] == "cable_lightning.positional.rope.Rope"
    encoding["class_path"] = "cable_lightning.positional.rope.rope"
    torch.save(checkpoint, last)
    resumed = [arg for arg in fit if arg not in ("--model.init_args.backbone.pos_encoding.base", "500")]
    resumed[resumed.index("--trainer.max_steps") + 1] = "4"  # the encoding's settings from the checkpoint
    cli = main(["fit", *resumed, "--ckpt_path", "last"])
    assert cli.trainer.global_step == 4 and cli.model.config.pos_encoding == encoding_class("rope")(base=500.0)
