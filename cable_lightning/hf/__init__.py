"""Hugging Face interop: export a checkpoint as a transformers folder (``python -m cable_lightning export``), read one
back, and the command-line tools built on exports (the ``retrieval`` and ``lm-eval`` verbs). Needs the ``hf`` extra."""

from .export import export_backbone, export_checkpoint, load_backbone

__all__ = ["export_backbone", "export_checkpoint", "load_backbone"]
