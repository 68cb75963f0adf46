"""Configuration of a cable_lightning backbone exported by ``python -m cable_lightning export``.

This file is copied into every exported folder and loaded by transformers (``trust_remote_code=True``); it must
not import cable_lightning. ``backbone`` holds the package's ``BackboneConfig`` as a dict (shape, positional
encoding, training length); ``core_files`` lists the folder's copy of the package's model code (``cable_core/``).
"""

from transformers import PretrainedConfig


class CableConfig(PretrainedConfig):
    model_type = "cable_lightning"

    def __init__(self, backbone=None, core_files=None, **kwargs):
        self.backbone = dict(backbone or {})
        self.core_files = list(core_files or [])
        super().__init__(**kwargs)
