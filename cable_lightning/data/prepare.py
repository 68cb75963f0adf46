"""Tokenize a text source into ``<out>/train`` (litdata token chunks), ``<out>/val.npy`` and a manifest.

    python -m cable_lightning prepare --source python-docs --tokenizer bpe:4096 --out data/pydocs-bpe4096
    python -m cable_lightning prepare --source fineweb-edu --tokenizer gpt2 --out data/fineweb-edu-gpt2 \
        --val_tokens 100000000 --num_workers 16

Each document's tokens are followed by the end-of-text id (``doc1 <eot> doc2 <eot> ...``). Validation is the head
of the stream: whole documents until ``--val_fraction`` of the characters or ``--val_tokens`` tokens, tokenized
once, in this process (the tokenizers' batch encoders use every core), into one flat array; training is the rest,
tokenized by litdata workers from where the head stopped. Sources with their own splits (wikitext-103) keep them.
Work happens in a private ``.<out>.partial-*`` folder under a lock on ``<out>.lock`` and is renamed to ``<out>`` at
the end, so an ``<out>`` folder is always complete and concurrent prepares of one ``<out>`` run one after the other. An
``s3://bucket/prefix`` ``<out>`` is prepared the same way in a local temporary folder, then published there with its
manifest last, under a lock object in the store (:mod:`cable_lightning.data.remote`).
"""

from __future__ import annotations

import fcntl
import functools
import itertools
import json
import os
import re
import shutil
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Iterable, Iterator
from datetime import datetime, timezone
from typing import Any

import numpy as np

from cable_lightning.data.litdata_workers import supervised_optimize
from cable_lightning.data.manifest import FORMAT_VERSION, MANIFEST, read_manifest
from cable_lightning.data.python_code import FILE_LIST, write_file_list
from cable_lightning.data.remote import Store, is_remote
from cable_lightning.data.sources import VALID_SOURCES, DatasetSource, get_source
from cable_lightning.data.tokenizers import (
    TOKENIZER_FILE,
    VALID_SPECS,
    Tokenizer,
    get_tokenizer,
    parse_bpe_spec,
    tokenizer_file,
    train_bpe,
)
from cable_lightning.errors import ArgumentParser, ConfigError, RunFailedError, TargetExistsError, error_boundary
from cable_lightning.owned import MARKER, check_replaceable, discard, staging_folder, swap_in

# Tokens per train chunk: TokensLoader windows never cross a chunk, so each chunk loses < one window of its tail.
CHUNK_TOKENS = 1 << 22
PIECE_TOKENS = 1 << 20  # largest array a worker yields at once (the writer cannot split items)
DEFAULT_VAL_FRACTION = 0.05
ENCODE_BATCH = 64
SEGMENT_CHARS = 1 << 20  # longer documents are encoded a segment at a time (see encode)


WORD_START = re.compile(r"\s(?=\S)")  # the whitespace character just before a word


def segments(doc: str, size: int) -> list[str]:
    """``doc`` in pieces of about ``size`` characters, each cut just before the last word start in reach (a whitespace
    character followed by a word), so that a tokenizer that pre-splits at whitespace (byte-level BPE, WordPiece)
    gives the same ids piece by piece as whole: a piece ends where a pre-token ends either way."""
    pieces, start = [], 0
    while len(doc) - start > size:
        starts = [m.start() for m in WORD_START.finditer(doc, start + 1, start + size)]
        if not starts:  # no word start in reach: the long run goes whole, up to the next word start
            following = WORD_START.search(doc, start + size)
            starts = [following.start() if following else len(doc)]
        pieces.append(doc[start : starts[-1]])
        start = starts[-1]
    return [*pieces, doc[start:]]


def encode(tok: Tokenizer, documents: Iterable[str], dtype: str) -> Iterator[tuple[str, np.ndarray]]:
    """(document, its ids + eot) for each document, encoded in batches. A document longer than
    :data:`SEGMENT_CHARS` is encoded a segment at a time: the tokenizer's memory stays bounded (a 42 MB one-line
    document took 6 GB encoded whole)."""
    it = iter(documents)
    while batch := list(itertools.islice(it, ENCODE_BATCH)):
        short = iter(tok.encode_batch([doc for doc in batch if len(doc) <= SEGMENT_CHARS]))
        for doc in batch:
            ids = (next(short) if len(doc) <= SEGMENT_CHARS
                   else [i for part in segments(doc, SEGMENT_CHARS) for i in tok.encode_batch([part])[0]])
            yield doc, np.asarray([*ids, tok.eot_id], dtype=dtype)


@functools.lru_cache(maxsize=2)
def _worker_tokenizer(ref: str, name: str) -> Tokenizer:
    return get_tokenizer(ref, name=name)


def tokenize_work(work: tuple[Any, int], source: DatasetSource, tokenizer_ref: str, tokenizer_name: str,
                  dtype: str) -> Iterator[np.ndarray]:
    """What litdata's workers map: a source work item minus its first ``skip`` documents (they went to validation)."""
    item, skip = work
    tok, pending, size = _worker_tokenizer(tokenizer_ref, tokenizer_name), [], 0
    for _, ids in encode(tok, itertools.islice(source.read(item), skip, None), dtype):
        pending.append(ids)
        size += len(ids)
        if size >= PIECE_TOKENS:
            yield from _pieces(pending)
            pending, size = [], 0
    yield from _pieces(pending)


def _pieces(arrays: list[np.ndarray]) -> Iterator[np.ndarray]:
    flat = np.concatenate(arrays) if arrays else arrays
    yield from (flat[start : start + PIECE_TOKENS] for start in range(0, len(flat), PIECE_TOKENS))


def split_head(src: DatasetSource, tok: Tokenizer, budget: float, by_chars: bool,
               dtype: str) -> tuple[np.ndarray, list]:
    """Whole documents from the start of the stream until ``budget`` characters or tokens: (val tokens, train work)."""
    head, taken, items = [], 0, src.work_items()
    for index, item in enumerate(items):
        for used, (doc, ids) in enumerate(encode(tok, src.read(item), dtype)):
            if taken >= budget:
                if taken > 2 * budget:  # whole documents are held out: one long document can take far more
                    unit = "characters" if by_chars else "tokens"
                    print(f"warning: {src.name}: validation holds {taken} {unit}, {taken / budget:.1f}x the "
                          f"{budget:.0f} asked for, because whole documents are held out; split long documents "
                          "or pass --val_tokens", file=sys.stderr, flush=True)
                return np.concatenate(head), [(item, used)] + [(rest, 0) for rest in items[index + 1 :]]
            head.append(ids)
            taken += len(doc) if by_chars else len(ids)
    if not head:
        raise ValueError(f"{src.name} holds no text (empty files?); give a source with documents")
    raise ValueError(f"{src.name} is too small: validation took all {len(head)} documents; "
                     "lower --val_fraction/--val_tokens"
                     " (a .txt file is one document: use several files, or jsonl with one document per line)")


def prepare(source: str = "python-docs", tokenizer: str = "bpe:4096", out: str = "data/pydocs-bpe4096",
            val_fraction: float | None = None, val_tokens: int | None = None, num_workers: int | None = None,
            overwrite: bool = False, bpe_train_chars: int = 200_000_000, start_method: str | None = None,
            verbose: bool = True, endpoint_url: str | None = None, expect: str | None = None) -> dict[str, Any]:
    """Prepare ``source`` with ``tokenizer`` into ``out`` and return the manifest (see the module docstring).

    A finished ``out`` with the same request is left alone (a no-op that says so); a different request needs
    ``overwrite=True``. ``start_method`` is passed to litdata (None: spawn; "fork" starts workers faster). An
    ``s3://bucket/prefix`` ``out`` is prepared locally and published there (``endpoint_url``: an S3-compatible
    store's, else boto3's usual configuration). ``expect``: a corpus file list (``files.tsv``) that the source's
    files must match, checked before anything is written.
    """
    out = str(out) if is_remote(out) else os.path.normpath(str(out))
    src, bpe_size = get_source(source), parse_bpe_spec(tokenizer)
    if val_fraction is not None and val_tokens is not None:
        raise ValueError("give --val_fraction or --val_tokens, not both")
    if src.splits is not None and (val_fraction is not None or val_tokens is not None):
        raise ValueError(f"{src.name} has its own validation split; drop --val_fraction/--val_tokens")
    if src.splits is None and val_tokens is None:
        val_fraction = DEFAULT_VAL_FRACTION if val_fraction is None else val_fraction
        if not 0 < val_fraction < 1:
            raise ValueError(f"--val_fraction must be in (0, 1), got {val_fraction}")
        if src.streamed:
            raise ValueError(f"{src.name} is streamed and its size unknown; pass --val_tokens "
                             "(the paper held out 100000000)")
    if val_tokens is not None and val_tokens < 1:
        raise ValueError(f"--val_tokens must be positive, got {val_tokens}")
    if num_workers is not None and num_workers < 1:  # 0 meant all cores and -1 one worker, without a word
        raise ValueError(f"--num_workers must be a positive number of tokenizing processes, got {num_workers}; leave "
                         "it out to use every core")
    if expect is not None:
        if not hasattr(src, "expect"):
            raise ValueError(f"--expect compares a corpus with its file list, and {src.name} keeps none (python-code "
                             "does); drop --expect")
        src.expect(expect)
    request = {"source": src.name, "tokenizer": tokenizer, "val_fraction": val_fraction, "val_tokens": val_tokens,
               **({"bpe_train_chars": bpe_train_chars} if bpe_size else {})}
    log = functools.partial(print, "[prepare]", flush=True) if verbose else None
    if is_remote(out):
        return _prepare_remote(src, request, str(out), overwrite, num_workers, start_method, log, endpoint_url)
    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
    with open(out + ".lock", "a") as lock:
        # A second prepare of this out waits here, then finds it done. A POSIX lock belongs to this process alone:
        # forked litdata child processes that outlive a killed worker cannot keep it (an flock would stay held by them).
        fcntl.lockf(lock, fcntl.LOCK_EX)
        if (done := _existing(out, request, overwrite, [*(src.files or ()), tokenizer_file(tokenizer)])) is not None:
            (log or _silent)(f"{out} is already prepared for this request "
                             f"({done['splits']['train']['tokens']} train tokens); nothing to do")
            return done
        src.check()
        return _stoppable(src, request, out, num_workers, start_method, log)


def _stoppable(src: DatasetSource, request: dict, out: str, num_workers: int | None, start_method: str | None,
               log: Any) -> dict[str, Any]:
    """:func:`_prepare` in a private folder beside ``out`` (:func:`staging_folder`), with SIGTERM and Ctrl-C turned
    into :class:`PrepareStopped` (main thread only). What a failed or stopped run wrote is removed (the watchdog has
    ended the workers: see litdata_workers)."""
    staged = staging_folder(out, "prepare")
    stop = functools.partial(_stop, main_pid=os.getpid())
    previous = ({signum: signal.signal(signum, stop) for signum in STOP_SIGNALS}
                if threading.current_thread() is threading.main_thread() else {})
    try:
        return _prepare(src, request, out, staged, num_workers, start_method, log)
    finally:
        discard(staged)  # already renamed to out after a success
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def _prepare_remote(src: DatasetSource, request: dict, out: str, overwrite: bool, num_workers: int | None,
                    start_method: str | None, log: Any, endpoint_url: str | None) -> dict[str, Any]:
    """Prepare into ``s3://bucket/prefix``: the same work into a local temporary folder, then uploaded with the
    manifest last, under the store's lock (see :mod:`cable_lightning.data.remote`)."""
    store = Store(out, endpoint_url)
    store.check()  # unreachable store, missing bucket, refused credentials: before any work
    say = log or _silent
    with store.lock(say):
        if (done := _existing_remote(store, request, overwrite, say)) is not None:
            say(f"{store.url} is already prepared for this request "
                f"({done['splits']['train']['tokens']} train tokens); nothing to do")
            return done
        src.check()
        staging = tempfile.mkdtemp(prefix="cable_lightning-prepare-")
        try:
            local = os.path.join(staging, "prepared")
            manifest = _stoppable(src, request, local, num_workers, start_method, log)
            store.publish(local, MARKER, say)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    say(f"published {store.url}")
    return manifest


def _existing_remote(store: Store, request: dict[str, Any], overwrite: bool, log: Any) -> dict[str, Any] | None:
    """The remote twin of :func:`_existing`: the finished manifest for this exact request, None when the prefix is
    to be (re)written (emptied first), and an error for a prefix prepare did not write or a different request."""
    objects = store.sizes()
    if not objects:
        return None
    marker = store.read(MARKER)
    try:
        owner = json.loads(marker).get("written_by") if marker else None
    except (ValueError, AttributeError):
        owner = None
    if owner != "prepare":
        raise TargetExistsError(f"{store.url} already holds {len(objects)} objects not written by prepare (no "
                                f"{MARKER} marker); choose another --out")
    if MANIFEST in objects:
        _, manifest = store.manifest()
        old = manifest.get("request", {})
        if old == request and not overwrite:
            store.check_train(manifest, store.read("train/index.json"))
            return manifest
        if old != request and not overwrite:
            raise TargetExistsError(f"{store.url} already holds data prepared from {old.get('source')!r} "
                                    f"with {old.get('tokenizer')!r} (request {json.dumps(old, sort_keys=True)}), not "
                                    f"from {request['source']!r} with {request['tokenizer']!r} as asked; pass "
                                    "--overwrite to replace it or choose another --out")
    else:
        log(f"{store.url} holds an unfinished earlier prepare ({len(objects)} objects, no {MANIFEST}); replacing it")
    store.delete_all()
    return None


STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)  # a scheduler's stop and Ctrl-C


class PrepareStopped(BaseException):
    """SIGTERM or Ctrl-C during prepare: raised in the main thread so that the workers are ended and the partial output
    removed (like KeyboardInterrupt, not an Exception: nothing may swallow it)."""

    def __init__(self, signum: int):
        super().__init__(f"stopped by {signal.Signals(signum).name}")
        self.signum = signum


def _stop(signum: int, frame: Any, main_pid: int = os.getpid()) -> None:
    if os.getpid() != main_pid:  # a forked worker inherited this handler: it dies of the signal, as it would have
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)
        return
    raise PrepareStopped(signum)


def _silent(*_: Any) -> None:
    pass


def _prepare(src: DatasetSource, request: dict, out: str, partial: str, num_workers: int | None,
             start_method: str | None, printer: Any) -> dict:
    log, tokenizer, bpe_size = printer or _silent, request["tokenizer"], parse_bpe_spec(request["tokenizer"])
    started = time.time()
    if bpe_size:
        chars = request["bpe_train_chars"]
        log(f"training {tokenizer} on up to {chars} characters of {src.name}")
        tok: Tokenizer = train_bpe(_first_chars(src.documents("train" if src.splits else None), chars), bpe_size)
        tok.save(os.path.join(partial, TOKENIZER_FILE))
        tokenizer_ref = os.path.join(partial, TOKENIZER_FILE)
    else:
        tok, tokenizer_ref = get_tokenizer(tokenizer), tokenizer
    dtype = "uint16" if max(tok.vocab_size, (tok.mask_id or 0) + 1) <= 1 << 16 else "int32"

    held_out: dict[str, np.ndarray] = {}
    if src.splits is None:
        by_chars = request["val_tokens"] is None
        budget = request["val_fraction"] * sum(map(len, src.documents())) if by_chars else request["val_tokens"]
        if budget == 0:
            raise ValueError(f"{src.name} holds no text (empty files?); give a source with documents")
        held_out["val"], train_work = split_head(src, tok, budget, by_chars, dtype)
    else:
        for split in (s for s in src.splits if s != "train"):
            held_out[split] = np.concatenate([ids for _, ids in encode(tok, src.documents(split), dtype)])
        train_work = [(item, 0) for item in src.work_items("train")]
    splits: dict[str, dict[str, Any]] = {}
    for split, tokens in held_out.items():
        np.save(os.path.join(partial, f"{split}.npy"), tokens)
        splits[split] = {"tokens": len(tokens), "file": f"{split}.npy"}
        log(f"{split}: {len(tokens)} tokens")

    workers = max(1, min(num_workers or os.cpu_count() or 1, len(train_work)))
    log(f"tokenizing train: {len(train_work)} work items, {workers} workers")
    fn = functools.partial(tokenize_work, source=src, tokenizer_ref=tokenizer_ref, tokenizer_name=tok.name, dtype=dtype)
    supervised_optimize(out, os.path.join(partial, "train"), train_work, fn, CHUNK_TOKENS, workers, start_method,
                        verbose=printer is not None)
    with open(os.path.join(partial, "train", "index.json"), encoding="utf-8") as f:
        chunks = json.load(f)["chunks"]
    splits["train"] = {"tokens": sum(int(c["dim"]) for c in chunks), "chunks": len(chunks)}
    log(f"train: {splits['train']['tokens']} tokens in {len(chunks)} chunks")

    import litdata

    import cable_lightning

    manifest = {
        "format": FORMAT_VERSION, "request": request, "source": src.describe(),
        "tokenizer": {"spec": tokenizer, "identity": tok.identity, "file": TOKENIZER_FILE if bpe_size else None},
        "vocab_size": tok.vocab_size, "eot_id": tok.eot_id, "mask_id": tok.mask_id,
        "special_ids": list(tok.special_ids),
        "dtype": dtype, "chunk_tokens": CHUNK_TOKENS, "splits": splits, "seconds": round(time.time() - started, 1),
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "versions": {"cable_lightning": cable_lightning.__version__, "litdata": litdata.__version__,
                     "python": sys.version.split()[0]},
    }
    with open(os.path.join(partial, MANIFEST), "w", encoding="utf-8") as f:
        json.dump(manifest, f, indent=2)
    if hasattr(src, "file_list"):
        write_file_list(src.file_list(), os.path.join(partial, FILE_LIST))
    swap_in(partial, out, "prepare")
    log(f"wrote {out} in {manifest['seconds']} s: " + ", ".join(f"{k} {v['tokens']} tokens" for k, v in splits.items()))
    return manifest


def _existing(out: str, request: dict[str, Any], overwrite: bool, inputs: Iterable[str]) -> dict[str, Any] | None:
    """The finished manifest when ``out`` already holds this exact request; errors on a conflicting one. ``out`` is
    replaced only when prepare wrote it (its marker or manifest) and it holds none of its inputs (the source's files,
    the tokenizer file)."""
    check_replaceable(out, "prepare", True, inputs)  # ownership and inputs; --overwrite is looked at below
    if overwrite or not os.path.exists(out) or (os.path.isdir(out) and not os.listdir(out)):
        return None
    if not os.path.isfile(os.path.join(out, MANIFEST)):
        raise TargetExistsError(f"{out} was written by prepare but holds no {MANIFEST}; pass --overwrite to replace "
                                "it or choose another --out")
    old = read_manifest(out, check_files=False).get("request", {})
    if old != request:
        raise TargetExistsError(f"{out} already holds data prepared from {old.get('source')!r} "
                                f"with {old.get('tokenizer')!r} (request {json.dumps(old, sort_keys=True)}), not "
                                f"from {request['source']!r} with {request['tokenizer']!r} as asked; pass --overwrite "
                                "to replace it or choose another --out")
    return read_manifest(out)


def _first_chars(docs: Iterator[str], limit: int) -> Iterator[str]:
    seen = 0
    for doc in docs:
        if seen >= limit:
            return
        seen += len(doc)
        yield doc


def main(argv: list[str] | None = None) -> int:
    p = ArgumentParser(prog="python -m cable_lightning prepare", description=__doc__.splitlines()[0],
                       epilog="With no arguments it prepares the defaults: the offline python-docs corpus with a "
                       "bpe:4096 tokenizer into data/pydocs-bpe4096 (the quickstart's data).")
    p.add_argument("--source", default="python-docs", help=VALID_SOURCES)
    p.add_argument("--tokenizer", default="bpe:4096", help=VALID_SPECS)
    p.add_argument("--out", default="data/pydocs-bpe4096", help="output folder, or s3://bucket/prefix")
    p.add_argument("--endpoint_url", help="an S3-compatible store's endpoint for an s3:// --out (default: boto3's "
                   "AWS_ENDPOINT_URL or profile)")
    p.add_argument("--val_fraction", type=float, help=f"share of characters held out (default {DEFAULT_VAL_FRACTION})")
    p.add_argument("--val_tokens", type=int, help="tokens held out for validation (the paper: 100000000)")
    p.add_argument("--num_workers", type=int, help="tokenizing processes, at least 1 (default: all cores)")
    p.add_argument("--bpe_train_chars", type=int, default=200_000_000, help="characters used to train bpe:N")
    p.add_argument("--expect", metavar="FILES_TSV", help="a corpus file list (a prepared python-code folder's "
                   f"{FILE_LIST}, or one kept beside published records): refuse, naming the files that differ, unless "
                   "this machine's corpus is that one")
    p.add_argument("--overwrite", action="store_true", help="replace an output prepared for a different request")
    p.add_argument("--quiet", action="store_true")
    args = vars(p.parse_args(argv))
    with error_boundary():  # one line, exit 2 for a bad request or source, 1 for a run that failed
        try:
            prepare(**{k: v for k, v in args.items() if k != "quiet"}, verbose=not args["quiet"])
        except PrepareStopped as stop:  # 128 + the signal, as fit
            print(f"error: {stop}; the workers were stopped and nothing was written to {args['out']}; run the same "
                  "command again", file=sys.stderr, flush=True)
            sys.exit(128 + stop.signum)
        except ConfigError:
            raise
        except (ValueError, OSError) as exc:  # prepare's own one-line errors about its inputs
            raise ConfigError(str(exc)) from exc
        except RuntimeError as exc:  # a worker failed or was killed
            raise RunFailedError(str(exc)) from exc
    return 0


if __name__ == "__main__":  # an entry point once: say which verb replaced it, never exit 0 having done nothing
    from cable_lightning.verbs import replaced_entry_point

    replaced_entry_point(__spec__.name)
