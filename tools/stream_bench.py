"""Training-loader throughput streaming from an S3-compatible server on 127.0.0.1 against the same chunks on disk.

Builds a prepared folder of random token ids (``--tokens``, in the prepared format's 4M-token chunks; or takes
``--data``), starts moto's S3 server in a child process on the loopback address, publishes the folder there, then
measures in this one process, for the folder and for ``s3://bench/data``: the time to the first batch (from
building the data module: manifest, index and held-out arrays fetched, chunk sizes checked, loader started) and
the tokens/s of the training loader alone over the rest of one epoch (no model). Every streamed repeat starts from
an empty cache; the folder's repeats read from the page cache after the first. moto is a Python server: its
figures are a floor for a real store, not a forecast of one.

    python tools/stream_bench.py --tokens 67108864 --block-size 1024 --batch 8 --repeats 3
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

from cable_lightning.data.datamodule import TokenDataModule
from cable_lightning.data.manifest import FORMAT_VERSION, MANIFEST
from cable_lightning.data.prepare import CHUNK_TOKENS
from cable_lightning.data.remote import Store
from cable_lightning.owned import MARKER

VOCAB = 50257


def synthetic_folder(folder: str, tokens: int) -> str:
    """A prepared folder of random ids: ``tokens`` training tokens in 4M-token chunks, 1M held out."""
    import functools

    from litdata import TokensLoader, optimize

    pieces = [min(1 << 20, tokens - start) for start in range(0, tokens, 1 << 20)]
    optimize(fn=functools.partial(_random_piece, sizes=pieces), inputs=list(range(len(pieces))),
             output_dir=os.path.join(folder, "train"), chunk_size=CHUNK_TOKENS, item_loader=TokensLoader(),
             num_workers=1, keep_data_ordered=True, reorder_files=False, start_method="fork", verbose=False)
    np.save(os.path.join(folder, "val.npy"), np.random.default_rng(len(pieces)).integers(0, VOCAB, 1 << 20, np.uint16))
    with open(os.path.join(folder, "train", "index.json")) as f:
        chunks = json.load(f)["chunks"]
    manifest = {
        "format": FORMAT_VERSION, "request": {"source": "random", "tokenizer": "gpt2"}, "source": {"name": "random"},
        "tokenizer": {"spec": "gpt2", "identity": {"kind": "tiktoken", "name": "gpt2", "hash": "0" * 64},
                      "file": None},
        "vocab_size": VOCAB, "eot_id": VOCAB - 1, "mask_id": None, "special_ids": [VOCAB - 1], "dtype": "uint16",
        "chunk_tokens": CHUNK_TOKENS, "splits": {"val": {"tokens": 1 << 20, "file": "val.npy"},
                                                 "train": {"tokens": sum(int(c["dim"]) for c in chunks),
                                                           "chunks": len(chunks)}},
    }
    with open(os.path.join(folder, MANIFEST), "w") as f:
        json.dump(manifest, f)
    with open(os.path.join(folder, MARKER), "w") as f:
        json.dump({"written_by": "prepare"}, f)
    return folder


def _random_piece(index: int, sizes: list[int]):
    yield np.random.default_rng(index).integers(0, VOCAB, sizes[index], dtype=np.uint16)


def measure(path: str, args, cache_dir: str | None) -> dict[str, float]:
    started = time.perf_counter()
    data = TokenDataModule(path, block_size=args.block_size, micro_batch_size=args.batch, num_workers=args.num_workers,
                           cache_dir=cache_dir, max_cache_size="1TB")
    data.describe()
    it = iter(data.train_dataloader())
    next(it)
    first = time.perf_counter() - started
    started, tokens = time.perf_counter(), 0
    for _, batch in zip(range(args.batches) if args.batches else iter(int, 1), it):
        tokens += batch.numel()
    return {"first_batch_s": first, "tokens_per_s": tokens / (time.perf_counter() - started), "tokens": tokens}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", help="a prepared folder (default: random ids, --tokens of them)")
    p.add_argument("--tokens", type=int, default=1 << 26)
    p.add_argument("--block-size", type=int, default=1024)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--num-workers", type=int, default=0)
    p.add_argument("--batches", type=int, help="batches timed after the first (default: the rest of one epoch)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--json", help="write the results here")
    args = p.parse_args()

    work = tempfile.mkdtemp(prefix="stream-bench-")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    server = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        folder = args.data or synthetic_folder(os.path.join(work, "data"), args.tokens)
        os.environ.update(AWS_ENDPOINT_URL=f"http://127.0.0.1:{port}", AWS_ACCESS_KEY_ID="bench",
                          AWS_SECRET_ACCESS_KEY="bench", AWS_DEFAULT_REGION="us-east-1")
        store = Store("s3://bench/data")
        for _ in range(100):  # the server is starting
            try:
                store.client.create_bucket(Bucket="bench")
                break
            except Exception:  # noqa: BLE001 - not listening yet
                time.sleep(0.1)
        store.publish(folder, MARKER, print)
        results: dict[str, list[dict[str, float]]] = {"disk": [], "s3": []}
        for repeat in range(args.repeats):
            results["disk"].append(measure(folder, args, None))
            cache = os.path.join(work, f"cache-{repeat}")  # empty: every chunk is streamed
            results["s3"].append(measure(store.url, args, cache))
            shutil.rmtree(cache, ignore_errors=True)
            print(f"repeat {repeat}: " + ", ".join(
                f"{k} {v[-1]['tokens_per_s'] / 1e6:.2f} M tokens/s, first batch {v[-1]['first_batch_s']:.2f} s"
                for k, v in results.items()), flush=True)
        summary = {k: {"tokens_per_s_median": statistics.median(r["tokens_per_s"] for r in v),
                       "first_batch_s_median": statistics.median(r["first_batch_s"] for r in v),
                       "runs": v} for k, v in results.items()}
        summary["settings"] = {**vars(args), "machine": platform.platform(), "cpus": os.cpu_count()}
        for k in ("disk", "s3"):
            print(f"{k}: median {summary[k]['tokens_per_s_median'] / 1e6:.2f} M tokens/s, first batch "
                  f"{summary[k]['first_batch_s_median']:.2f} s")
        if args.json:
            with open(args.json, "w") as f:
                json.dump(summary, f, indent=2)
    finally:
        server.terminate()
        server.wait(10)
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
