"""``python -m cable_lightning export --ckpt_path CKPT --out DIR``: a checkpoint as a Hugging Face model folder.

The folder holds ``config.json`` (with ``auto_map``), ``model.safetensors``, the data's tokenizer as a
``tokenizer.json`` that ``AutoTokenizer`` loads (with its end-of-text, mask and padding tokens), the two files in
``cable_lightning/hf/remote/`` that wrap the backbone as transformers models, and ``cable_core/``: a copy of this
package's model code (``CORE_SOURCES``) that those files import. Nothing in the folder imports cable_lightning, so
``AutoModelForCausalLM`` / ``AutoModel`` / ``AutoModelForMaskedLM.from_pretrained(DIR, trust_remote_code=True)``,
lm-evaluation-harness and sentence-transformers load it where this package is not installed.
:func:`load_backbone` reads a folder back into this package's own ``Backbone``.
"""

from __future__ import annotations

import base64
import glob
import json
import os
import shutil
import tempfile

from safetensors import SafetensorError

from ..checkpoints import check_exists, is_url, run_configs
from ..data.manifest import read_manifest
from ..data.remote import Store, is_remote
from ..data.tokenizers import HFTokenizer, TiktokenTokenizer, get_tokenizer
from ..errors import ArgumentParser, ConfigError, MissingFileError, RunFailedError, error_boundary, space_left
from ..lit.checkpoint_format import checkpoint_backbone, saved_backbone, upgrade_state_dict
from ..models import Backbone, BackboneConfig, build_backbone
from ..owned import check_replaceable, discard, staging_folder, swap_in
from ..records.io import content_hash

PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REMOTE = os.path.join(PACKAGE_ROOT, "hf", "remote")
REMOTE_FILES = ("configuration_cable.py", "modeling_cable.py")
# What the backbone imports, relative to the package root: copied whole into <out>/cable_core/ (new positional
# encodings registered in positional/ come along).
CORE_SOURCES = ("errors.py", "models", "positional")
CORE = "cable_core"
WEIGHTS = "model.safetensors"


def _core_files(root: str = PACKAGE_ROOT) -> list[str]:
    files = []
    for source in CORE_SOURCES:
        path = os.path.join(root, source)
        found = [path] if os.path.isfile(path) else sorted(glob.glob(os.path.join(path, "**", "*.py"), recursive=True))
        files += [os.path.relpath(f, root).replace(os.sep, "/") for f in found]
    return files


def copy_core(out: str) -> list[str]:
    """Copy the model code into ``<out>/cable_core/``; returns its files (relative paths, ``__init__.py`` first)."""
    target = os.path.join(out, CORE)
    os.makedirs(target, exist_ok=True)
    with open(os.path.join(target, "__init__.py"), "w", encoding="utf-8") as f:
        f.write('"""A copy of cable_lightning\'s model code (models/, positional/, errors.py), written by '
                '`python -m cable_lightning export`."""\n')
    files = _core_files()
    for name in files:
        os.makedirs(os.path.dirname(os.path.join(target, name)), exist_ok=True)
        shutil.copyfile(os.path.join(PACKAGE_ROOT, name), os.path.join(target, name))
    return ["__init__.py", *files]


def run_data_path(ckpt_path: str) -> str | None:
    """``data.path`` of the run that wrote ``ckpt_path`` (the ``config.yaml`` LightningCLI saved in the newest
    ``version_*`` folder beside its checkpoints folder), or None; an error when that folder is not there (a path
    relative to another folder, say)."""
    import yaml

    for config in reversed(run_configs(ckpt_path)):
        with open(config, encoding="utf-8") as f:
            path = ((yaml.safe_load(f) or {}).get("data") or {}).get("path")
        if path and not is_remote(str(path)) and not os.path.isdir(path):  # relative to where the run started?
            raise MissingFileError(f"the run's data.path {path} (from {config}) is not there from {os.getcwd()}; "
                                   "pass --data_path <the prepared folder the run trained on> (its tokenizer is "
                                   "exported)")
        if path:
            return str(path)
    return None


def data_tokenizer(data_path: str, trained_with: dict):
    """The prepared data's tokenizer, checked to be the one the checkpoint was trained with (an s3:// path: its small
    files are fetched into LitData's cache, the endpoint from boto3's configuration)."""
    if is_remote(data_path):
        data_path = Store(data_path).mirror()
    manifest = read_manifest(data_path, check_files=False)
    info = manifest["tokenizer"]
    tok = get_tokenizer(os.path.join(data_path, info["file"]) if info.get("file") else info["spec"],
                        name=info["identity"]["name"])
    if (tok.identity["kind"], tok.identity["hash"]) != (trained_with.get("kind"), trained_with.get("hash")):
        raise ConfigError(f"the data at {data_path} uses tokenizer {tok.identity['name']!r} "
                          f"(hash {tok.identity['hash'][:12]}) "
                          f"but the checkpoint was trained with {trained_with.get('name')!r} (hash "
                          f"{str(trained_with.get('hash'))[:12]}); pass --data_path with the run's prepared data")
    return tok


def write_tiktoken_ranks(ranks: dict[bytes, int], path: str) -> None:
    """A ``.tiktoken`` rank file (base64 token, rank per line; tiktoken's own writer needs ``blobfile``)."""
    with open(path, "w", encoding="ascii") as f:
        for token, rank in sorted(ranks.items(), key=lambda item: item[1]):
            f.write(f"{base64.b64encode(token).decode()} {rank}\n")


def hf_tokenizer(tok, max_length: int):
    """Our tokenizer as a transformers ``PreTrainedTokenizerFast`` that encodes text to the same ids (no special
    tokens added: the model was trained on plain ids with end-of-text between documents)."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    if isinstance(tok, TiktokenTokenizer):
        from transformers.convert_slow_tokenizer import TikTokenConverter

        with tempfile.TemporaryDirectory() as tmp:
            ranks = os.path.join(tmp, "ranks.tiktoken")
            write_tiktoken_ranks(tok.enc._mergeable_ranks, ranks)
            backend = TikTokenConverter(vocab_file=ranks, pattern=tok.enc._pat_str,
                                        extra_special_tokens=tok.enc._special_tokens).converted()
    elif isinstance(tok, HFTokenizer):
        backend = Tokenizer.from_str(tok.tok.to_str())
        backend.post_processor = None  # WordPiece's [CLS] ... [SEP] template: our data has none
    else:
        raise ConfigError(f"cannot export tokenizer {type(tok).__name__}; valid: tiktoken (gpt2), WordPiece, bpe:N")
    backend.encode_special_tokens = False
    vocab = backend.get_vocab(with_added_tokens=True)
    names = {i: t for t, i in vocab.items()}
    eot = names.get(tok.eot_id, "<|endoftext|>")
    pad = next((t for t in ("[PAD]", "<pad>") if t in vocab), eot)
    special = {"eos_token": eot, "bos_token": eot, "pad_token": pad}
    if tok.mask_id in names:
        special["mask_token"] = names[tok.mask_id]
    for key, token in (("unk_token", "[UNK]"), ("cls_token", "[CLS]"), ("sep_token", "[SEP]")):
        if token in vocab:
            special[key] = token
    return PreTrainedTokenizerFast(tokenizer_object=backend, model_max_length=max_length,
                                   model_input_names=["input_ids", "attention_mask"], **special)


def training_length(config: BackboneConfig) -> int:
    """The length the model was trained at, or the most its encoding can serve (a learnable table's size)."""
    return config.pos_encoding.longest_length(config.original_length) or config.block_size


def export_backbone(backbone: Backbone, out: str, tokenizer=None, overwrite: bool = False,
                    inputs: tuple = (), provenance: dict | None = None) -> str:
    """Write ``backbone`` (and ``tokenizer``, one of this package's tokenizers) as a Hugging Face folder ``out``;
    ``provenance`` (the checkpoint's and its run's identity: :func:`checkpoint_backbone`) goes into ``config.json``.

    ``overwrite`` replaces only a folder an export wrote (its marker, :mod:`cable_lightning.owned`), never one that
    holds ``inputs`` (the checkpoint, the data). The folder is built in a private folder beside ``out`` and renamed
    into place: a failed export leaves no half folder and the old one intact; a failed write is one line (exit 1)."""
    out = os.path.abspath(out)
    check_replaceable(out, "export", overwrite, inputs)
    config = backbone.config
    partial = None
    try:
        partial = staging_folder(out, "export")
        core_files = copy_core(partial)
        for name in REMOTE_FILES:
            shutil.copyfile(os.path.join(REMOTE, name), os.path.join(partial, name))
        from .remote.configuration_cable import CableConfig
        from .remote.modeling_cable import CableForCausalLM, CableForMaskedLM

        head, head_class = (("AutoModelForCausalLM", CableForCausalLM) if config.causal
                            else ("AutoModelForMaskedLM", CableForMaskedLM))
        auto_map = {"AutoConfig": "configuration_cable.CableConfig", "AutoModel": "modeling_cable.CableModel",
                    head: f"modeling_cable.{head_class.__name__}"}
        eot = getattr(tokenizer, "eot_id", None)
        hf_config = CableConfig(
            backbone=config.to_dict(), core_files=core_files, auto_map=auto_map, architectures=[head_class.__name__],
            name_or_path=partial, vocab_size=config.vocab_size, hidden_size=config.n_embd,
            num_hidden_layers=config.n_layer, num_attention_heads=config.n_head,
            max_position_embeddings=training_length(config), is_decoder=config.causal, use_cache=config.causal,
            bos_token_id=eot, eos_token_id=eot, pad_token_id=eot, tie_word_embeddings=False,
            provenance=provenance)
        model = head_class(hf_config)
        model.backbone.load_state_dict(backbone.state_dict())
        model.save_pretrained(partial)
        if tokenizer is not None:
            hf_tokenizer(tokenizer, training_length(config)).save_pretrained(partial)
        swap_in(partial, out, "export")
    except (OSError, SafetensorError) as exc:  # safetensors has its own error for a failed write
        raise RunFailedError(f"could not write the export {out} ({type(exc).__name__}: {exc}; "
                             f"{space_left(out)}); nothing was replaced") from exc
    finally:
        if partial is not None:
            discard(partial)
    return out


def export_checkpoint(ckpt_path: str, out: str, data_path: str | None = None, overwrite: bool = False) -> str:
    """Export a fit checkpoint with its data's tokenizer (``data_path``, or the run's own ``data.path``)."""
    check_exists(ckpt_path)  # before advice about the data that only matters for a checkpoint that is there
    data_path = data_path or run_data_path(ckpt_path)
    if data_path is None:
        raise MissingFileError(f"no run config.yaml beside {ckpt_path} names the prepared data; pass --data_path "
                               "<the prepared folder the run trained on> (its tokenizer is exported)")
    check_replaceable(os.path.abspath(out), "export", overwrite, (ckpt_path, data_path))  # before any work
    backbone, data, provenance = checkpoint_backbone(ckpt_path)
    return export_backbone(backbone, out, data_tokenizer(data_path, data["tokenizer"]), overwrite=overwrite,
                           inputs=(ckpt_path, data_path), provenance=provenance)


def exported_already(ckpt_path: str, out: str) -> str | None:
    """The line ``export`` says instead of exporting when ``out`` is a complete export of this very checkpoint (its
    provenance names the checkpoint's path and content hash, and its weights are there: an export is swapped in
    whole), so that a sweep run again exports nothing twice; None otherwise (a checkpoint URL is exported anew)."""
    if is_url(ckpt_path) or not os.path.isfile(ckpt_path) or not os.path.isfile(os.path.join(out, WEIGHTS)):
        return None
    try:
        provenance = read_export_config(out).get("provenance") or {}
    except (ConfigError, MissingFileError):
        return None
    if (provenance.get("checkpoint"), provenance.get("checkpoint_hash")) != (os.path.abspath(ckpt_path),
                                                                              content_hash([ckpt_path])):
        return None
    return f"{out} is an export of {ckpt_path} (the same checkpoint): already done; nothing to do"


def read_export_config(folder: str) -> dict:
    """An exported folder's ``config.json``, checked: readable, and its ``core_files`` inside the folder's
    ``cable_core/`` and present (the check the folder's own ``modeling_cable.py`` makes when transformers loads it)."""
    path = os.path.join(folder, "config.json")
    if not os.path.isfile(path):
        raise MissingFileError(f"{folder} holds no config.json; give a folder written by "
                               "`python -m cable_lightning export`")
    try:
        with open(path, encoding="utf-8") as f:
            config = json.load(f)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{path} cannot be read ({type(exc).__name__}: {exc}); export the checkpoint again") from None
    if "core_files" in config:
        if not os.path.isdir(os.path.join(folder, CORE)):  # transformers would look for it on the hub
            raise ConfigError(f"{folder} is not a complete export: its {CORE}/ folder (the model's code) is missing; "
                              "export the checkpoint again")
        from types import SimpleNamespace

        from .remote.modeling_cable import core_paths

        try:
            core_paths(SimpleNamespace(core_files=config["core_files"], name_or_path=folder))
        except (ValueError, OSError) as exc:
            first = (str(exc).strip().splitlines() or [""])[0]
            raise ConfigError(f"{folder} is not a complete export ({first}); export the checkpoint again") from None
    return config


def check_remote_code(model: str, trusted: bool) -> None:
    """Remote code runs only when asked: a local folder whose ``config.json`` maps transformers' Auto classes to its
    own files (every export does) is refused without ``trusted`` (the tools' ``--trust_remote_code``, passed on as
    transformers' ``trust_remote_code``). A hub id is left to transformers, which refuses custom code the same way."""
    if not os.path.isdir(model):
        return
    auto_map = read_export_config(model).get("auto_map") or {}
    if auto_map and not trusted:
        files = sorted({str(v).split("--")[-1].split(".")[0] + ".py" for v in auto_map.values()})
        raise ConfigError(f"{model} runs its own code when loaded ({', '.join(files)}); pass --trust_remote_code to "
                          "allow it (transformers' trust_remote_code=True)")


def load_backbone(folder: str) -> Backbone:
    """An exported folder back as this package's ``Backbone`` (the same weights, through ``safetensors``)."""
    from safetensors.torch import load_file

    saved = read_export_config(folder)["backbone"]
    backbone = build_backbone(saved_backbone(saved))
    weights = upgrade_state_dict(load_file(os.path.join(folder, WEIGHTS)), saved)
    backbone.load_state_dict({k.removeprefix("backbone."): v for k, v in weights.items()})
    return backbone.eval()


def main(argv: list[str] | None = None) -> None:
    parser = ArgumentParser(prog="python -m cable_lightning export",
                            description="Write a fit checkpoint as a Hugging Face model folder.")
    parser.add_argument("--ckpt_path", required=True,
                        help="a checkpoint written by fit (e.g. runs/<exp>/<pe>/checkpoints/last.ckpt)")
    parser.add_argument("--out", required=True, help="the Hugging Face folder to write")
    parser.add_argument("--data_path", default=None, help="the prepared data the run trained on (default: the run's "
                        "data.path from its config.yaml); its tokenizer is exported")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing --out folder (one that is "
                        "already an export of this checkpoint is left as it is: nothing to do)")
    args = parser.parse_args(argv)
    from transformers.utils import logging as transformers_logging

    transformers_logging.disable_progress_bar()  # one line of output: what was written where
    with error_boundary():
        if done := exported_already(args.ckpt_path, args.out):
            print(done)
            return
        out = export_checkpoint(args.ckpt_path, args.out, args.data_path, args.overwrite)
    print(f"exported {args.ckpt_path} to {out}")


if __name__ == "__main__":  # an entry point once: say which verb replaced it, never exit 0 having done nothing
    from cable_lightning.verbs import replaced_entry_point

    replaced_entry_point(__spec__.name)
