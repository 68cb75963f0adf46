"""Data pipeline: text sources -> tokenizers -> litdata token chunks -> TokenDataModule (see data/README.md).

Names are imported lazily so that prepare's spawned workers, which only need the tokenizer and the source,
do not pay for importing Lightning. The prepare function lives in its module (``from
cable_lightning.data.prepare import prepare``): a package attribute of that name would be shadowed by the
submodule ``python -m cable_lightning.data.prepare`` runs.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "TokenDataModule": "cable_lightning.data.datamodule",
    "read_manifest": "cable_lightning.data.manifest",
    "get_source": "cable_lightning.data.sources",
    "python_docs": "cable_lightning.data.sources",
    "Tokenizer": "cable_lightning.data.tokenizers",
    "get_tokenizer": "cable_lightning.data.tokenizers",
    "train_bpe": "cable_lightning.data.tokenizers",
    "mask_tokens": "cable_lightning.data.masking",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'cable_lightning.data' has no attribute {name!r}")
