"""Shared fixtures. ``tiny_corpus_dir`` is a small prepared corpus (real English from the offline python-docs
source, a bpe:512 tokenizer) that model, CLI and data tests can train and evaluate on without the network."""

from __future__ import annotations

import json
import os

import pytest

# Tokenizers is used before litdata forks its workers in these tests; say up front that it may not use threads
# there (otherwise it prints a warning per fork).
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

TINY_CORPUS_CHARS = 330_000  # about 170k bpe:512 tokens, a third of them held out
TINY_VAL_FRACTION = 0.25


def write_tiny_corpus(folder: str, chars: int = TINY_CORPUS_CHARS) -> tuple[str, list[str]]:
    """Write the first python-docs documents (about ``chars`` characters) as jsonl; returns (path, documents)."""
    from cable_lightning.data.sources import python_docs

    docs, total = [], 0
    for doc in python_docs():
        if total >= chars:
            break
        docs.append(doc)
        total += len(doc)
    path = os.path.join(folder, "corpus.jsonl")
    with open(path, "w", encoding="utf-8") as f:
        for doc in docs:
            f.write(json.dumps({"text": doc}) + "\n")
    return path, docs


@pytest.fixture(scope="session")
def tiny_corpus_docs(tmp_path_factory) -> tuple[str, list[str]]:
    """(jsonl path, documents) of the tiny corpus's raw text."""
    return write_tiny_corpus(str(tmp_path_factory.mktemp("tiny_corpus_raw")))


@pytest.fixture(scope="session")
def tiny_corpus_dir(tiny_corpus_docs, tmp_path_factory) -> str:
    """Path of a prepared folder (manifest.json, tokenizer.json, train/, val/): bpe:512, >= 60k train and
    >= 20k val tokens, deterministic. Read it with ``TokenDataModule(path=tiny_corpus_dir, ...)``."""
    from cable_lightning.data.prepare import prepare

    jsonl, _ = tiny_corpus_docs
    out = str(tmp_path_factory.mktemp("tiny_corpus") / "tiny-bpe512")
    manifest = prepare(
        source=jsonl,
        tokenizer="bpe:512",
        out=out,
        val_fraction=TINY_VAL_FRACTION,
        num_workers=1,
        start_method="fork",  # a spawned worker re-imports torch (~3 s); a forked one starts at once
        verbose=False,
    )
    assert manifest["splits"]["train"]["tokens"] >= 60_000, manifest["splits"]
    assert manifest["splits"]["val"]["tokens"] >= 20_000, manifest["splits"]
    return out
