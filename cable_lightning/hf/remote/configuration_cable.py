"""Configuration of a cable_lightning backbone exported by ``python -m cable_lightning export``.

This file is copied into every exported folder and loaded by transformers (``trust_remote_code=True``); it must
not import cable_lightning. ``backbone`` holds the package's ``BackboneConfig`` as a dict (shape, positional
encoding, training length); ``core_files`` lists the folder's copy of the package's model code (``cable_core/``);
``provenance`` the checkpoint it came from (step, run seed, path), so measurements on the folder name their run.
"""

from transformers import PretrainedConfig


class CableConfig(PretrainedConfig):
    model_type = "cable_lightning"

    def __init__(self, backbone=None, core_files=None, provenance=None, **kwargs):
        self.backbone = dict(backbone or {})
        self.core_files = list(core_files or [])
        self.provenance = dict(provenance or {})
        super().__init__(**kwargs)
