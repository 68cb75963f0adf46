"""Tokenize a text source into litdata token chunks: ``<out>/train``, ``<out>/val`` and ``<out>/manifest.json``.

    python -m cable_lightning.data.prepare --source python-docs --tokenizer bpe:4096 --out data/pydocs-bpe4096
    python -m cable_lightning.data.prepare --source fineweb-edu --tokenizer gpt2 --out data/fineweb-edu-gpt2 \
        --val-tokens 100000000 --num-workers 16
    python -m cable_lightning.data.prepare --source 'corpus/*.jsonl' --tokenizer gpt2:/models/r50k_base.tiktoken ...

Each document's tokens are followed by the end-of-text id, so the stream is ``doc1 <eot> doc2 <eot> ...`` and
windows cut from it may span documents (GPT-2 style). Validation is the head of the source: whole documents from
the start until ``--val-fraction`` of the characters or ``--val-tokens`` tokens are taken; sources with their own
splits (wikitext-103) keep them. Work happens in ``<out>.partial`` and is renamed to ``<out>`` at the end, so an
``<out>`` folder is always complete.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import os
import shutil
import sys
import time
from collections.abc import Iterator
from datetime import datetime, timezone
from typing import Any

import numpy as np

from cable_lightning.data.manifest import FORMAT_VERSION, MANIFEST, check_split, fix_command, read_manifest, split_tokens
from cable_lightning.data.sources import Source, get_source
from cable_lightning.data.tokenizers import TOKENIZER_FILE, Tokenizer, get_tokenizer, parse_bpe_spec, train_bpe

# Tokens per litdata chunk. TokensLoader windows never cross a chunk, so a chunk must be far longer than the
# longest eval window (16 x 1024 + 1); each chunk loses at most one window's worth of tail tokens.
CHUNK_TOKENS = 1 << 22
# Largest array one work item yields at a time (must stay <= CHUNK_TOKENS; the writer cannot split items).
PIECE_TOKENS = 1 << 20
DEFAULT_VAL_FRACTION = 0.05
ENCODE_BATCH = 64


# ------------------------------------------------------------------------------------- worker side (spawned)

_WORKER_TOKENIZERS: dict[tuple[str, str], Tokenizer] = {}


def _worker_tokenizer(ref: str, name: str) -> Tokenizer:
    key = (ref, name)
    if key not in _WORKER_TOKENIZERS:
        _WORKER_TOKENIZERS[key] = get_tokenizer(ref, name=name)
    return _WORKER_TOKENIZERS[key]


def tokenize_work(work: tuple[str, Any, int], source: Source, tokenizer_ref: str, tokenizer_name: str, dtype: str) -> Iterator[np.ndarray]:
    """The function litdata.optimize maps (module level so spawned workers can import it).

    ``work`` is ``("source", item, skip)``: the source's work item minus its first ``skip`` documents (they went
    to validation), or ``("docs", documents, 0)``: documents already chosen in the main process.
    """
    kind, payload, skip = work
    docs = iter(payload) if kind == "docs" else source.read(payload)
    tok = _worker_tokenizer(tokenizer_ref, tokenizer_name)
    pending: list[np.ndarray] = []
    size = 0
    for batch in _batched(itertools.islice(docs, skip, None), ENCODE_BATCH):
        for ids in tok.encode_batch(batch):
            ids.append(tok.eot_id)
            pending.append(np.asarray(ids, dtype=dtype))
            size += len(ids)
        if size >= PIECE_TOKENS:
            yield from _pieces(pending)
            pending, size = [], 0
    if pending:
        yield from _pieces(pending)


def _pieces(arrays: list[np.ndarray]) -> Iterator[np.ndarray]:
    flat = np.concatenate(arrays)
    for start in range(0, len(flat), PIECE_TOKENS):
        yield flat[start : start + PIECE_TOKENS]


def _batched(it: Iterator[str], n: int) -> Iterator[list[str]]:
    while batch := list(itertools.islice(it, n)):
        yield batch


# ------------------------------------------------------------------------------------- main process


def _log(verbose: bool, msg: str) -> None:
    if verbose:
        print(f"[prepare] {msg}", flush=True)


def _version() -> str:
    try:
        import cable_lightning

        return str(cable_lightning.__version__)
    except (ImportError, AttributeError):
        return "unknown"


def _check_existing(out: str, request: dict[str, Any], overwrite: bool) -> dict[str, Any] | None:
    """The finished manifest when ``out`` already holds this exact request; errors on a conflicting one."""
    if not os.path.exists(out) or overwrite:
        return None
    if not os.path.isfile(os.path.join(out, MANIFEST)):
        if os.path.isdir(out) and not os.listdir(out):
            return None
        raise FileExistsError(f"{out} exists but holds no {MANIFEST}; pass --overwrite to replace it or choose another --out")
    manifest = read_manifest(out, check_shards=False)
    if manifest.get("request") != request:
        old = manifest.get("request", {})
        raise FileExistsError(
            f"{out} already holds data prepared from {old.get('source')!r} with {old.get('tokenizer')!r} "
            f"(request {json.dumps(old, sort_keys=True)}); pass --overwrite to replace it or choose another --out"
        )
    return read_manifest(out, check_shards=True)


def _plan_head_split(
    source: Source, items: list[Any], tok: Tokenizer, val_fraction: float | None, val_tokens: int | None, verbose: bool
) -> tuple[list[tuple[str, Any, int]], list[tuple[str, Any, int]]]:
    """Take whole documents from the start of the stream for validation; the rest (same order) is train."""
    if val_tokens is not None:
        budget, unit = float(val_tokens), "tokens"
    else:
        budget, unit = val_fraction * sum(len(d) for d in source.documents()), "characters"
    stream = ((idx, doc) for idx, item in enumerate(items) for doc in source.read(item))
    val_docs: list[str] = []
    taken, last_item, taken_from_last = 0.0, 0, 0
    for batch in _batched(stream, ENCODE_BATCH):
        texts = [doc for _, doc in batch]
        sizes = [len(ids) + 1 for ids in tok.encode_batch(texts)] if val_tokens is not None else [len(d) for d in texts]
        for (idx, doc), size in zip(batch, sizes):
            if taken >= budget:
                break
            taken_from_last = taken_from_last + 1 if idx == last_item else 1
            last_item = idx
            val_docs.append(doc)
            taken += size
        if taken >= budget:
            break
    if not val_docs:
        raise ValueError(f"{source.name} yielded no documents; check the source")
    _log(verbose, f"validation: the first {len(val_docs)} documents ({int(taken)} {unit})")
    val_work = [("docs", tuple(b), 0) for b in _batched(iter(val_docs), 256)]
    train_work = [("source", items[last_item], taken_from_last)] + [("source", it, 0) for it in items[last_item + 1 :]]
    return val_work, train_work


def _optimize_split(out_dir: str, work: list, fn: Any, num_workers: int, start_method: str | None, verbose: bool) -> None:
    from litdata import TokensLoader, optimize

    try:
        optimize(
            fn=fn,
            inputs=work,
            output_dir=out_dir,
            chunk_size=CHUNK_TOKENS,
            item_loader=TokensLoader(),
            num_workers=max(1, min(num_workers, len(work))),
            keep_data_ordered=True,  # worker k writes the k-th contiguous slice: the stream keeps source order
            reorder_files=False,
            start_method=start_method,
            verbose=verbose,
        )
    except RuntimeError as exc:
        lines = [line for line in str(exc).strip().splitlines() if line.strip()]
        raise RuntimeError(f"tokenizing into {out_dir} failed in a worker: {lines[-1].strip() if lines else exc}") from None


def prepare(
    source: str = "python-docs",
    tokenizer: str = "bpe:4096",
    out: str = "data/pydocs-bpe4096",
    val_fraction: float | None = None,
    val_tokens: int | None = None,
    num_workers: int | None = None,
    overwrite: bool = False,
    bpe_train_chars: int = 200_000_000,
    start_method: str | None = None,
    verbose: bool = True,
) -> dict[str, Any]:
    """Prepare ``source`` with ``tokenizer`` into ``out`` and return the manifest (see the module docstring).

    A finished ``out`` with the same request is left alone (a no-op that says so); a different request needs
    ``overwrite=True``. ``start_method`` is passed to litdata (None: spawn; "fork" starts workers faster).
    """
    out = os.path.normpath(str(out))
    src = get_source(source)
    bpe_size = parse_bpe_spec(tokenizer)
    if val_fraction is not None and val_tokens is not None:
        raise ValueError("give --val-fraction or --val-tokens, not both")
    if src.splits is not None and (val_fraction is not None or val_tokens is not None):
        raise ValueError(f"{src.name} has its own validation split; drop --val-fraction/--val-tokens")
    if src.splits is None and val_fraction is None and val_tokens is None:
        val_fraction = DEFAULT_VAL_FRACTION
    if val_fraction is not None and not 0 < val_fraction < 1:
        raise ValueError(f"--val-fraction must be in (0, 1), got {val_fraction}")
    if val_tokens is not None and val_tokens < 1:
        raise ValueError(f"--val-tokens must be positive, got {val_tokens}")
    if src.streamed and val_fraction is not None:
        raise ValueError(f"{src.name} is streamed and its size unknown; pass --val-tokens (the paper held out 100000000)")
    request = {
        "source": src.name,
        "tokenizer": tokenizer,
        "val_fraction": val_fraction,
        "val_tokens": val_tokens,
        **({"bpe_train_chars": bpe_train_chars} if bpe_size else {}),
    }
    if (done := _check_existing(out, request, overwrite)) is not None:
        _log(verbose, f"{out} is already prepared for this request ({done['splits']['train']['tokens']} train tokens); nothing to do")
        return done
    src.check()

    t0 = time.time()
    workers = num_workers or max(1, (os.cpu_count() or 1))
    partial = out + ".partial"
    shutil.rmtree(partial, ignore_errors=True)
    os.makedirs(partial)

    if bpe_size:
        _log(verbose, f"training {tokenizer} on up to {bpe_train_chars} characters of {src.name}")
        tok: Tokenizer = train_bpe(_first_chars(src.documents("train" if src.splits else None), bpe_train_chars), bpe_size)
        tok.save(os.path.join(partial, TOKENIZER_FILE))
        tokenizer_ref = os.path.join(partial, TOKENIZER_FILE)
    else:
        tok = get_tokenizer(tokenizer)
        tokenizer_ref = tokenizer
    dtype = "uint16" if max(tok.vocab_size, tok.mask_id + 1) <= 1 << 16 else "int32"

    if src.splits is None:
        val_work, train_work = _plan_head_split(src, src.work_items(), tok, val_fraction, val_tokens, verbose)
        if not train_work or (len(train_work) == 1 and _is_exhausted(src, train_work[0])):
            raise ValueError(f"{src.name} is too small: validation took every document; lower --val-fraction/--val-tokens")
        plan = {"train": train_work, "val": val_work}
    else:
        plan = {ours: [("source", it, 0) for it in src.work_items(ours)] for ours in src.splits}

    fn = functools.partial(tokenize_work, source=src, tokenizer_ref=tokenizer_ref, tokenizer_name=tok.name, dtype=dtype)
    splits: dict[str, dict[str, Any]] = {}
    for split, work in plan.items():
        # Held-out splits are written by one worker so their first chunk is full: eval reads one contiguous stream.
        split_workers = workers if split == "train" else 1
        _log(verbose, f"tokenizing {split}: {len(work)} work items, up to {split_workers} workers")
        _optimize_split(os.path.join(partial, split), work, fn, split_workers, start_method, verbose)
        index = check_split(partial, split)
        splits[split] = {"tokens": split_tokens(index), "chunks": len(index["chunks"])}
        _log(verbose, f"{split}: {splits[split]['tokens']} tokens in {splits[split]['chunks']} chunks")

    manifest = {
        "format": FORMAT_VERSION,
        "request": request,
        "source": src.describe(),
        "tokenizer": {"spec": tokenizer, "identity": tok.identity, "file": TOKENIZER_FILE if bpe_size else None},
        "vocab_size": tok.vocab_size,
        "eot_id": tok.eot_id,
        "mask_id": tok.mask_id,
        "special_ids": list(tok.special_ids),
        "dtype": dtype,
        "chunk_tokens": CHUNK_TOKENS,
        "splits": splits,
        "seconds": round(time.time() - t0, 1),
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "cable_lightning_version": _version(),
        "litdata_version": _litdata_version(),
    }
    with open(os.path.join(partial, MANIFEST), "w", encoding="utf-8") as f:
        json.dump(manifest, f, indent=2)
    if os.path.exists(out):
        shutil.rmtree(out)
    os.replace(partial, out)
    _log(verbose, f"wrote {out} in {manifest['seconds']} s: " + ", ".join(f"{k} {v['tokens']} tokens" for k, v in splits.items()))
    return manifest


def _is_exhausted(src: Source, work: tuple[str, Any, int]) -> bool:
    kind, item, skip = work
    return next(itertools.islice(src.read(item), skip, None), None) is None


def _first_chars(docs: Iterator[str], limit: int) -> Iterator[str]:
    seen = 0
    for doc in docs:
        if seen >= limit:
            return
        yield doc
        seen += len(doc)


def _litdata_version() -> str:
    import litdata

    return str(litdata.__version__)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m cable_lightning.data.prepare",
        description="Tokenize a text source into litdata token chunks (train/, val/, manifest.json).",
    )
    p.add_argument("--source", default="python-docs", help="python-docs | fineweb-edu[:config] | wikitext-103 | path/dir/glob of .txt/.jsonl/.parquet")
    p.add_argument("--tokenizer", default="bpe:4096", help="gpt2 | gpt2:/path/r50k_base.tiktoken | bert-base-uncased | bert:/path/vocab.txt | bpe:N")
    p.add_argument("--out", default="data/pydocs-bpe4096", help="output folder")
    val = p.add_mutually_exclusive_group()
    val.add_argument("--val-fraction", type=float, default=None, help=f"share of characters held out (default {DEFAULT_VAL_FRACTION})")
    val.add_argument("--val-tokens", type=int, default=None, help="tokens held out for validation (the paper: 100000000)")
    p.add_argument("--num-workers", type=int, default=None, help="tokenizing processes (default: all cores)")
    p.add_argument("--bpe-train-chars", type=int, default=200_000_000, help="characters used to train bpe:N")
    p.add_argument("--overwrite", action="store_true", help="replace an output prepared for a different request")
    p.add_argument("--quiet", action="store_true")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        prepare(
            source=args.source,
            tokenizer=args.tokenizer,
            out=args.out,
            val_fraction=args.val_fraction,
            val_tokens=args.val_tokens,
            num_workers=args.num_workers,
            overwrite=args.overwrite,
            bpe_train_chars=args.bpe_train_chars,
            verbose=not args.quiet,
        )
    except (ValueError, RuntimeError, OSError) as exc:  # our errors are one line; say it without a traceback
        print(f"prepare: error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    # Re-import by package name so spawned workers unpickle `tokenize_work` from a module they can import.
    from cable_lightning.data.prepare import main as _main

    sys.exit(_main())
