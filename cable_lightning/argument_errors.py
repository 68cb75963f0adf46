"""jsonargparse's reports of a bad command line or config, translated into one line each: an unknown encoding or
setting, a value outside a setting's choices or types, a config file that is not YAML, validate or test without the
run's configs. :class:`TerseParser` is the parser that says them, and reads encodings by their names
(:func:`read_encoding_names`)."""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import os
import re
import sys
from typing import Optional

import yaml
from jsonargparse import _typehints
from lightning.pytorch.cli import LightningArgumentParser

from .checkpoints import run_configs
from .errors import KeepsWriteErrors
from .lit.checkpoint_format import moved_setting
from .models.config import BackboneConfig
from .positional import ENCODING_FLAG, Encoding, available
from .positional.registry import class_path, named_class

SETTING_ERRORS = re.compile(r"(unknown positional encoding |positional encoding |unknown \w+ setting |unknown value )")


def setting_error(message: str) -> Optional[str]:
    """jsonargparse's nested report of a bad encoding name, an unknown setting (of an encoding, the backbone or the
    model) or a value outside a setting's fixed choices, as one line; None for any other error. Nested parsers report
    into their parents' messages: the innermost names the class and the setting."""
    known = [line.strip() for line in message.splitlines() if SETTING_ERRORS.match(line.strip())]
    if known:
        return known[0]
    unknown = re.search(r'"pos_encoding":\s.*?Expected a dot import path string: (\S+)', message, flags=re.S)
    if unknown:
        return f"unknown positional encoding {unknown.group(1)!r}; valid names: {', '.join(available())}"
    choice = re.findall(r'Parser key "([\w.]+)":\s+Expected a typing\.Literal\[(.*?)\]\. Got value: (.*)', message)
    if choice:  # a fixed-choice setting (attention_backend chunkd): the innermost report names it
        key, choices, value = choice[-1]
        return f"unknown value {value.strip()!r} for {key}; choose one of {choices}"
    union = union_error(message)
    if union:
        return union
    simple = re.findall(r'Parser key "([\w.]+)":\s+Expected a <class \'(\w+)\'>\. Got value: (.*)', message)
    if simple and simple[-1][1] in SIMPLE_TYPES:  # a word for a number (--throughput.warmup one)
        key, kind, value = simple[-1]
        return f"invalid value {value.strip()!r} for {key}; expected {SIMPLE_TYPES[kind]}"
    setting = re.search(r"Problem with given class_path '([\w.]+)':\s+Option '(\w+)' is not accepted", message)
    if not setting:
        return None
    given, option = setting.groups()
    encoding = named_class(given)
    if encoding is not None:
        settings = ", ".join(f.name for f in dataclasses.fields(encoding)) or "none"
        return (f"positional encoding {encoding.name!r} has no setting {option!r} (its settings: {settings}); name the "
                f"encoding before its settings ({ENCODING_FLAG} NAME), also with --ckpt_path")
    name = given.rpartition(".")[2]
    module, _, attribute = given.rpartition(".")
    try:
        cls = getattr(importlib.import_module(module), attribute)
    except (ImportError, AttributeError, ValueError):
        return None
    backbone = issubclass(cls, BackboneConfig)
    moved = moved_setting(option) if backbone else None
    if moved:
        return f"unknown backbone setting {option!r}; {moved}"
    settings = ", ".join(p for p, v in inspect.signature(cls).parameters.items() if v.kind is v.POSITIONAL_OR_KEYWORD)
    return f"unknown {'backbone' if backbone else name} setting {option!r}; its settings: {settings}"


SIMPLE_TYPES = {"bool": "bool", "int": "int", "float": "float", "str": "str", "NoneType": "null"}
CONTAINERS = {"dict": "a mapping", "list": "a list"}  # jsonargparse writes them as dict[str, typing.Any], list[int]


def top_level(text: str) -> list[str]:
    """``text`` split at its commas outside brackets: ``"dict[str, int], <class 'NoneType'>"`` -> two types."""
    parts, depth, start = [], 0, 0
    for i, char in enumerate(text):
        depth += (char == "[") - (char == "]")
        if char == "," and depth == 0:
            parts.append(text[start:i].strip())
            start = i + 1
    return parts + [text[start:].strip()]


def union_error(message: str) -> Optional[str]:
    """jsonargparse's report of a value that fits none of a setting's types, when those are fixed choices, simple
    types, mappings and lists (``--trainer.precision bf16-mixd``, ``--seed_everything one``, ``--data.tasks '[1,2]'``),
    as one line naming the choices or types; None for any other report."""
    union = re.search(r'Parser key "([\w.]+)":\s+Does not validate against any of the Union subtypes\s+Subtypes: '
                     r'\[(.*)\]$', message, flags=re.M)
    given = re.search(r"^  Given value: (.*)$", message, flags=re.M)  # the outermost union's (nested ones indent more)
    if not union or not given:
        return None
    key, subtypes = union.groups()
    choices, kinds = [], []
    for subtype in top_level(subtypes):
        literal = re.fullmatch(r"typing\.Literal\[(.*)\]", subtype)
        simple = re.fullmatch(r"<class '(\w+)'>", subtype)
        container = re.fullmatch(r"(?:typing\.)?(\w+)\[.*\]", subtype)
        if literal:
            choices += [item.strip().strip("'\"") for item in literal.group(1).split(",")]
        elif simple and simple.group(1) in SIMPLE_TYPES:
            kinds.append(SIMPLE_TYPES[simple.group(1)])
        elif container and container.group(1).lower() in CONTAINERS:
            kinds.append(CONTAINERS[container.group(1).lower()])
        else:
            return None  # a type with settings of its own: jsonargparse's report says which one failed
    value = given.group(1).strip()
    if choices:
        return f"unknown value {value!r} for {key}; choose one of {', '.join(dict.fromkeys(choices))}"
    return f"invalid value {value!r} for {key}; expected {' or '.join(kinds)}"


def yaml_error(path: Optional[str], exc: Optional[BaseException]) -> Optional[str]:
    """A config file that is not valid YAML as one line naming the file and line (jsonargparse reads the file into a
    string, so YAML's own report, over four lines, names ``"<unicode string>"``); None for any other error."""
    while exc is not None and not isinstance(exc, yaml.MarkedYAMLError):
        exc = exc.__cause__ or exc.__context__
    if exc is None or path is None:
        return None
    mark, context = exc.problem_mark or exc.context_mark, ""
    if exc.context and exc.context_mark:
        context = f" ({exc.context} at line {exc.context_mark.line + 1}, column {exc.context_mark.column + 1})"
    return f"{path}{f':{mark.line + 1}' if mark else ''}: not valid YAML: {exc.problem or exc.context}{context}"


def missing_model(message: str, given: list[str]) -> Optional[str]:
    """``validate.model is required`` (validate or test given ``--ckpt_path`` alone), as one line saying that the run's
    configs are needed too, naming the ``config.yaml`` the run saved when the checkpoint is in its run folder; None
    for any other error."""
    missing = re.search(r"arguments are required: (validate|test)\.model\b", message)
    if not missing:
        return None
    verb = missing.group(1)
    ckpt = next((arg.partition("=")[2] or (given[i + 1] if i + 1 < len(given) else "") for i, arg in enumerate(given)
                 if arg.partition("=")[0] == "--ckpt_path"), "")
    saved = run_configs(ckpt)[-1:] if os.path.isfile(ckpt) else []
    advice = (f"the run saved its config in {saved[0]}: python -m cable_lightning {verb} --config {saved[0]} "
              f"--ckpt_path {ckpt}" if saved else
              f"give them as it was trained: python -m cable_lightning {verb} --config <the run's configs> "
              f"--ckpt_path {ckpt or '<its checkpoint>'}")
    return (f"{verb} needs the run's configs as well as --ckpt_path (the checkpoint holds the model's settings, not "
            f"the data section or the trainer's); {advice}")


JSONARGPARSE_RESOLVE = _typehints.resolve_class_path_by_name


def resolve_class_path(cls, name: str) -> str:
    """jsonargparse's resolution of a class given without its module (by the class's own name, ``Rope``), and also,
    for a setting typed :class:`Encoding`, of every name :func:`registry.named_class` reads: the encoding's name
    (``rope``) and the class paths records and checkpoints hold. Each becomes its class's path before jsonargparse
    imports anything, so the parsed config names every encoding by that path."""
    types = cls if isinstance(cls, tuple) else (cls,)
    if isinstance(name, str) and any(isinstance(t, type) and issubclass(t, Encoding) for t in types):
        found = named_class(name)
        if found is not None:
            return class_path(found)
    return JSONARGPARSE_RESOLVE(cls, name)


def read_encoding_names() -> None:
    """Makes jsonargparse resolve class names through :func:`resolve_class_path` (jsonargparse 4.53 has no hook of
    its own for it: the function is looked up in its ``_typehints`` module at every call)."""
    _typehints.resolve_class_path_by_name = resolve_class_path


class TerseParser(KeepsWriteErrors, LightningArgumentParser):
    """A usage error is two lines (what was wrong, how to get help), not the hundred-line usage first; a bad encoding
    name or unknown setting is one line (:func:`setting_error`), not jsonargparse's report of every type it tried, and
    so is a config file that is not valid YAML (:func:`yaml_error`)."""

    reading: Optional[str] = None  # the --config file being parsed
    given: list[str] = []  # the command line being parsed

    def __init__(self, *args, **kwargs):
        read_encoding_names()
        super().__init__(*args, **kwargs)

    def parse_args(self, args=None, *rest, **kwargs):
        self.given = list(sys.argv[1:] if args is None else args)
        return super().parse_args(args, *rest, **kwargs)

    def print_usage(self, file=None):
        pass

    def parse_path(self, path, *args, **kwargs):
        earlier, self.reading = self.reading, str(path)
        try:
            return super().parse_path(path, *args, **kwargs)
        finally:
            self.reading = earlier

    def error(self, message: str, *args, **kwargs):
        cause = args[0] if args else kwargs.get("ex")
        return super().error(yaml_error(self.reading, cause) or missing_model(message, self.given)
                             or setting_error(message) or message, *args, **kwargs)
