"""What a fit checkpoint holds and how every reader takes it back: the model class it may name (the allow-list),
an earlier version's settings and parameter names in this version's form (and where a setting of that version is
set now, for a command line that still names it), and the trained backbone that export reads. One home, so that the
CLI (``--ckpt_path``), the LightningModules (``on_load_checkpoint``, ``init_weights``), resumes and export read a
checkpoint, or an exported folder, the same way. (Encodings named by the class paths of an earlier version are read
by the registry itself: ``positional.registry``.)

Reading the file itself (weights-only, checked, downloaded from a URL) is :mod:`cable_lightning.checkpoints`; this
module is about what is inside. It imports nothing from the modules it names, so that they can call it.
"""

from __future__ import annotations

import inspect
import os
import re
import sys
from typing import Optional

import lightning as L

from ..checkpoints import fetch_checkpoint, is_url, read_checkpoint
from ..errors import ConfigError
from ..models import Backbone, BackboneConfig
from ..positional import ENCODING_FLAG
from ..records.io import content_hash

MODELS_PACKAGE = __package__  # cable_lightning.lit: where this package's models are defined


def package_model_class(class_path: str, source: str) -> type:
    """The LightningModule class a checkpoint names in ``_class_path``, accepted only when it is one of this
    package's own models (a LightningModule defined in ``cable_lightning.lit``: CausalLM, MaskedLM, their
    subclasses there). The name is looked up among the modules already imported, never imported: a checkpoint
    cannot make us run code."""
    module_name, _, name = str(class_path).rpartition(".")
    inside = module_name == MODELS_PACKAGE or module_name.startswith(MODELS_PACKAGE + ".")
    cls = getattr(sys.modules.get(module_name), name, None) if inside else None
    defined_here = isinstance(cls, type) and (cls.__module__ + ".").startswith(MODELS_PACKAGE + ".")
    if defined_here and issubclass(cls, L.LightningModule):
        return cls
    valid = ", ".join(f"{MODELS_PACKAGE}.{n}" for n in ("CausalLM", "MaskedLM"))
    raise ConfigError(f"checkpoint {source} names model class {class_path!r}, which is not one of this package's "
                      f"models ({valid} or their subclasses in {MODELS_PACKAGE}); use a checkpoint written by fit")


# Settings an earlier version kept as prefixed backbone fields, before encodings owned them: encoding -> {old: new}.
PREFIXED_SETTINGS = {"rope": {"rope_base": "base", "rope_scaling": "scaling", "rope_scaling_factor": "scaling_factor"},
                     "cable": {"cable_bias_activation": "bias_activation"},
                     "cable_nw": {"cable_bias_activation": "bias_activation"},
                     "k_cable": {"cable_bias_activation": "bias_activation"},
                     "learnable": {"max_positions": "max_positions"},
                     "cope": {"cope_positions": "positions"}}
DAPE_FIELDS = {"dape": "base", "dape_width": "width", "dape_kernel": "kernel"}  # dape: v2 -> dape_v2 wrapping
PREFIXED_FIELDS = {old for renames in PREFIXED_SETTINGS.values() for old in renames} | set(DAPE_FIELDS)
DAPE_IN_ATTENTION = re.compile(r"(^|\.)blocks\.(\d+)\.attn\.dape\.")


def moved_setting(name: str) -> Optional[str]:
    """Where an earlier version's backbone setting ``name`` lives now, as the flags that set it (None: ``name`` was
    never a backbone setting). Checkpoints map these by themselves; a command line or YAML gets this pointer."""
    flag = ENCODING_FLAG
    if name in DAPE_FIELDS:
        wraps = " (the encoding it wraps)" if name == "dape" else ""
        return f"it moved into the dape_v2 encoding: {flag} dape_v2 {flag}.{DAPE_FIELDS[name]} VALUE{wraps}"
    owners = [encoding for encoding, renames in PREFIXED_SETTINGS.items() if name in renames]
    if not owners:
        return None
    return (f"it moved into the {'/'.join(owners)} encoding: {flag} {owners[0]} "
            f"{flag}.{PREFIXED_SETTINGS[owners[0]][name]} VALUE")


def upgrade_backbone_dict(saved: dict) -> dict:
    """An earlier version's backbone dict (``pos_encoding: rope`` with ``rope_scaling`` etc. beside it, ``dape: v2``)
    in this version's form; a current one is returned as it is."""
    if not isinstance(saved.get("pos_encoding"), str) and not PREFIXED_FIELDS & set(saved):
        return saved
    name = saved.get("pos_encoding", "cable")
    renames = PREFIXED_SETTINGS.get(name, {})
    encoding = {"class_path": name,
                "init_args": {new: saved[old] for old, new in renames.items() if saved.get(old) is not None}}
    if saved.get("dape", "none") != "none":
        encoding = {"class_path": f"dape_{saved['dape']}",
                    "init_args": {"base": encoding, "width": saved.get("dape_width", 32),
                                  "kernel": saved.get("dape_kernel", 3)}}
    upgraded = {k: v for k, v in saved.items() if k not in PREFIXED_FIELDS}
    return upgraded | {"pos_encoding": encoding}


def saved_backbone(saved: dict) -> BackboneConfig:
    """The backbone a checkpoint's or an exported folder's dict describes, written by this version or an earlier one."""
    return BackboneConfig.from_dict(upgrade_backbone_dict(saved))


def upgrade_state_dict(state: dict, saved: dict) -> dict:
    """An earlier version's weights in this version's names (``saved``: the backbone dict written with them): DAPEv2's
    convolutions moved from each attention layer (``blocks.<i>.attn.dape.``) into the encoding (``pe.layers.<i>.``),
    and the encoding it wraps to ``pe.base.``."""
    if saved.get("dape", "none") == "none":
        return state
    upgraded = {}
    for key, value in state.items():
        key = re.sub(r"(^|\.)pe\.", r"\1pe.base.", key)
        upgraded[DAPE_IN_ATTENTION.sub(r"\1pe.layers.\2.", key)] = value
    return upgraded


def saved_weights(checkpoint: dict) -> dict:
    """A checkpoint's state dict in this version's parameter names (an earlier version's are translated)."""
    backbone = (checkpoint.get("hyper_parameters") or {}).get("backbone")
    state = checkpoint["state_dict"]
    return upgrade_state_dict(state, backbone) if isinstance(backbone, dict) else state


def checkpoint_settings(ckpt_path: str) -> tuple[Optional[dict], dict]:
    """The model section (class_path, init_args) a checkpoint was made with, without the linked data description
    (the CLI's defaults under ``--ckpt_path``; None when it names no class), and that data description (what
    validate checks its data section against; empty when it holds none)."""
    hparams = dict(read_checkpoint(ckpt_path, weights_only=True, mmap=True).get("hyper_parameters") or {})
    data = hparams.get("data") or {}
    class_path = hparams.pop("_class_path", None)
    if class_path is None:
        return None, data
    # Only what the class takes now: the data description is linked from the data section, and settings an older
    # version saved (vocab_size, block_size before they came from the data) would stop the parse.
    accepted = inspect.signature(package_model_class(class_path, ckpt_path)).parameters
    init_args = {k: v for k, v in hparams.items() if k in accepted and k != "data"}
    if isinstance(init_args.get("backbone"), dict):  # an earlier version's settings in this version's form
        backbone = upgrade_backbone_dict(init_args["backbone"])
        init_args["backbone"] = backbone | {"pos_encoding": saved_backbone(backbone).pos_encoding.to_dict()}
    return {"class_path": class_path, "init_args": init_args}, data


def checkpoint_backbone(ckpt_path: str) -> tuple[Backbone, dict, dict]:
    """The trained backbone of a fit checkpoint (built by its LightningModule class, as validate does), the
    data description it was trained with (vocabulary, ids, tokenizer identity, training length), and its provenance,
    which export keeps so that what is measured on it is recorded as that run's (as its length records name it:
    :meth:`LanguageModel.record_context`): the step, run seed, path and content hash of the checkpoint, and the run's
    peak learning rate, corpus hash, recipe and settings (None where the checkpoint was written before it held them)."""
    ckpt = read_checkpoint(ckpt_path, weights_only=True)
    hparams = dict(ckpt.get("hyper_parameters") or {})
    class_path = hparams.get("_class_path")
    if not class_path or "data" not in hparams or "state_dict" not in ckpt:
        raise ConfigError(f"{ckpt_path} is not a checkpoint written by `python -m cable_lightning fit` (no model "
                          "class, data description or weights); export a checkpoint from a fit run")
    model = package_model_class(class_path, ckpt_path)(
        backbone=saved_backbone(hparams["backbone"]), data=hparams["data"])
    model.load_state_dict(saved_weights(ckpt))
    local = fetch_checkpoint(ckpt_path) if is_url(ckpt_path) else ckpt_path  # read_checkpoint's copy of a URL
    provenance = {"step": ckpt.get("global_step"), "run_seed": ckpt.get("run_seed"),
                  "checkpoint": os.path.abspath(ckpt_path), "checkpoint_hash": content_hash([local]),
                  "lr": hparams.get("lr"), "corpus_hash": (ckpt.get("run_data") or {}).get("corpus_hash"),
                  "recipe": ckpt.get("recipe"), "settings": model.run_settings()}
    return model.backbone.eval(), hparams["data"], provenance
