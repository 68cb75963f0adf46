"""Hugging Face interop: export a checkpoint as a transformers folder (``python -m cable_lightning export``), read one
back, and the command-line tools built on exports (the ``retrieval`` and ``lm-eval`` verbs). Needs the ``hf`` extra.

The names below are imported when first used: a package that imported ``export`` itself would make ``python -m
cable_lightning.hf.export`` print runpy's warning before its one line."""

__all__ = ["export_backbone", "export_checkpoint", "load_backbone"]


def __getattr__(name: str):
    if name in __all__:
        from . import export

        return getattr(export, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
