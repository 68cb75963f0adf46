"""Prepared data in an S3-compatible object store: ``s3://bucket/prefix`` as ``prepare --out`` and as ``data.path``.

The layout under the prefix is a local prepared folder's (``manifest.json``, ``train/`` chunks and ``index.json``,
``val.npy``, ``tokenizer.json`` for bpe:N, the owner marker). What a local folder gets from a rename, a prefix gets
from order: prepare builds the folder on local disk, uploads the marker first and ``manifest.json`` last, in one
PUT, so a prefix without a manifest reads as unfinished and one with it as complete. A lock object beside the prefix
(``<prefix>.lock``, created only where absent, kept fresh while its holder works) makes prepares started on any
machine run one after the other. Readers fetch the small files (manifest, chunk index, held-out arrays, tokenizer)
once per node into a local cache, check every chunk's size against the bucket's listing, and stream the chunks
through LitData.

Endpoint, region and credentials come from boto3's own chain (``AWS_ENDPOINT_URL``, ``AWS_REGION``,
``AWS_ACCESS_KEY_ID``/``AWS_SECRET_ACCESS_KEY``, ``AWS_PROFILE`` and ``~/.aws/config``, instance roles); an explicit
endpoint URL (``data.endpoint_url``, ``prepare --endpoint_url``) wins over them.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import socket
import tempfile
import threading
import time
import urllib.parse
from collections.abc import Callable, Iterator
from typing import Any

from ..errors import ConfigError, MissingFileError
from .manifest import MANIFEST, check_chunks, fix_command, parse_manifest

SCHEME = "s3://"
LOCK_SUFFIX = ".lock"
LOCK_REFRESH_SECONDS = 20.0  # the holder rewrites its lock this often ...
LOCK_STALE_SECONDS = 120.0  # ... and a lock older than this (by the store's clock) belongs to a dead prepare
LOCK_POLL_SECONDS = 2.0
REFUSED = {"AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch", "InvalidToken", "ExpiredToken", "403",
           "InvalidClientTokenId", "UnrecognizedClientException"}


def is_remote(path: Any) -> bool:
    """A URL (``scheme://...``) rather than a local folder."""
    return "://" in str(path)


def default_cache_dir() -> str:
    """LitData's chunk cache (``$LITDATA_CACHE_DIR``, else ``~/.lightning/chunks``): streamed chunks go there, and
    this module's small files under its ``cable_lightning/`` folder."""
    from litdata.utilities.dataset_utilities import get_default_cache_dir

    return get_default_cache_dir()


class Store:
    """One prefix of one bucket, reached through boto3 with a short retry budget (LitData's own client retries up to
    1000 times: a wrong endpoint would hang instead of failing), every failure a one-line :class:`ConfigError`."""

    def __init__(self, url: str, endpoint_url: str | None = None):
        url = str(url)
        if not url.startswith(SCHEME):
            raise ConfigError(f"{url}: remote data must be an s3:// URL (any S3-compatible store: AWS, MinIO, Ceph, "
                              "Cloudflare R2, Google Cloud Storage through https://storage.googleapis.com with HMAC "
                              "keys; set its endpoint with data.endpoint_url, --endpoint_url or AWS_ENDPOINT_URL)")
        bucket, _, prefix = url[len(SCHEME):].partition("/")
        if not bucket or not prefix.strip("/"):
            raise ConfigError(f"{url}: give s3://bucket/prefix (the prepared data lives under a prefix, not at the "
                              "root of a bucket)")
        self.bucket, self.prefix = bucket, prefix.strip("/")
        self.url, self.endpoint_url = f"{SCHEME}{bucket}/{self.prefix}", endpoint_url or None
        try:
            endpoint = urllib.parse.urlsplit(self.endpoint_url or "http://default")
            valid = endpoint.scheme in ("http", "https") and bool(endpoint.hostname) and endpoint.port != 0
        except ValueError:  # a bad port or IPv6 address
            valid = False
        if not valid:
            raise ConfigError(f"endpoint URL {endpoint_url!r} is not an http(s) URL with a host; give the store's "
                              "endpoint (e.g. https://s3.example.com or http://127.0.0.1:9000) with data.endpoint_url "
                              "or --endpoint_url")
        self._client: Any = None

    def __getstate__(self) -> dict[str, Any]:  # a boto3 client is neither picklable nor fork-safe: made again
        return {**self.__dict__, "_client": None}

    # --- the client and its errors -------------------------------------------------------------------------------

    @property
    def client(self) -> Any:
        if self._client is None:
            import boto3
            from botocore.config import Config

            config = Config(connect_timeout=5, read_timeout=60, retries={"max_attempts": 3, "mode": "standard"})
            self._client = boto3.session.Session().client("s3", endpoint_url=self.endpoint_url, config=config)
        return self._client

    @property
    def endpoint(self) -> str:
        return str(self.client.meta.endpoint_url)

    def storage_options(self) -> dict[str, Any]:
        """What LitData's client needs besides boto3's own chain (which already reads AWS_ENDPOINT_URL). LitData
        0.2.76 fetches chunks through obstore with client options that refuse a plain-http endpoint ("builder
        error"); for such an endpoint (a store on a private network, the tests' server) they are told to allow it."""
        if self.endpoint.startswith("http://"):
            from litdata.streaming import downloader

            downloader._OBSTORE_CLIENT_OPTIONS["allow_http"] = True
        return {"endpoint_url": self.endpoint_url} if self.endpoint_url else {}

    @contextlib.contextmanager
    def answers(self, doing: str) -> Iterator[None]:
        """boto3's failures as one line naming the store, the URL and what to change."""
        from botocore import exceptions as bx

        try:
            yield
        except (bx.EndpointConnectionError, bx.ConnectTimeoutError, bx.ReadTimeoutError,
                bx.ConnectionClosedError) as exc:
            raise ConfigError(f"cannot reach the object store at {self.endpoint} ({type(exc).__name__}) while "
                              f"{doing} {self.url}; check the endpoint (data.endpoint_url, --endpoint_url or "
                              "AWS_ENDPOINT_URL) and that the store is running") from None
        except bx.NoCredentialsError:
            raise ConfigError(f"no credentials for {self.url}: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or "
                              "AWS_PROFILE (boto3's usual places)") from None
        except bx.ClientError as exc:
            error = exc.response.get("Error", {})
            code = str(error.get("Code"))
            if code in REFUSED:
                raise ConfigError(f"the object store at {self.endpoint} refused the credentials ({code}) while "
                                  f"{doing} {self.url}; check AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY or AWS_PROFILE "
                                  "and the bucket's permissions") from None
            if code in ("NoSuchBucket", "404"):
                raise MissingFileError(f"bucket {self.bucket!r} does not exist at {self.endpoint} (while {doing} "
                                       f"{self.url}); create it or fix the URL") from None
            raise ConfigError(f"the object store at {self.endpoint} answered {code} ({error.get('Message')}) while "
                              f"{doing} {self.url}") from None

    def key(self, name: str) -> str:
        return f"{self.prefix}/{name}"

    def check(self) -> None:
        """Reachable, the bucket there, the credentials accepted: before any work starts."""
        with self.answers("opening"):
            self.client.head_bucket(Bucket=self.bucket)

    # --- objects -------------------------------------------------------------------------------------------------

    def read(self, name: str) -> bytes | None:
        """The object ``<prefix>/<name>``, or None when there is none."""
        with self.answers(f"reading {name} of"):
            try:
                return self.client.get_object(Bucket=self.bucket, Key=self.key(name))["Body"].read()
            except self.client.exceptions.NoSuchKey:
                return None

    def sizes(self, under: str = "") -> dict[str, int]:
        """{name relative to the prefix: size} of every object under ``<prefix>/<under>``."""
        start, found = self.key(under), {}
        with self.answers("listing"):
            for page in self.client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=start):
                found.update({o["Key"][len(self.prefix) + 1:]: int(o["Size"]) for o in page.get("Contents", [])})
        return found

    def download(self, name: str, local_path: str) -> None:
        with self.answers(f"downloading {name} of"):
            self.client.download_file(self.bucket, self.key(name), local_path)

    def delete_all(self) -> None:
        """Every object under the prefix, the manifest first (so the prefix reads as unfinished at once)."""
        with self.answers("deleting"):
            self.client.delete_object(Bucket=self.bucket, Key=self.key(MANIFEST))
            names = sorted(self.sizes())
            for start in range(0, len(names), 1000):
                self.client.delete_objects(Bucket=self.bucket, Delete={
                    "Objects": [{"Key": self.key(n)} for n in names[start:start + 1000]], "Quiet": True})

    def publish(self, folder: str, first: str, log: Callable[..., None]) -> None:
        """Upload a finished local prepared folder: ``first`` (the owner marker) before everything, ``manifest.json``
        after everything, so the prefix reads as prepared only once every other object is in place."""
        names = sorted(os.path.relpath(os.path.join(root, f), folder).replace(os.sep, "/")
                       for root, _, files in os.walk(folder) for f in files)
        if MANIFEST not in names or first not in names:
            raise RuntimeError(f"{folder} is not a finished prepared folder (no {MANIFEST} or {first})")
        ordered = [first] + [n for n in names if n not in (first, MANIFEST)] + [MANIFEST]
        total = sum(os.path.getsize(os.path.join(folder, n)) for n in names)
        log(f"uploading {len(ordered)} files ({total / 1e6:.1f} MB) to {self.url}")
        with self.answers("uploading to"):
            for name in ordered:
                self.client.upload_file(os.path.join(folder, name), self.bucket, self.key(name))

    # --- the prepare lock ----------------------------------------------------------------------------------------

    @contextlib.contextmanager
    def lock(self, log: Callable[..., None]) -> Iterator[None]:
        """``<prefix>.lock``, created only where absent (S3 conditional writes); its holder rewrites it every
        :data:`LOCK_REFRESH_SECONDS`, and a lock the store has not seen rewritten for :data:`LOCK_STALE_SECONDS`
        (its holder was killed) is taken over. A store that ignores conditional writes lets two prepares run at
        once, and they may delete each other's uploads: readers then find a chunk missing (checked, one line)."""
        key, me = f"{self.prefix}{LOCK_SUFFIX}", json.dumps({"host": socket.gethostname(), "pid": os.getpid()})
        told = False
        with self.answers("locking"):
            while True:
                try:
                    self.client.put_object(Bucket=self.bucket, Key=key, Body=me.encode(), IfNoneMatch="*")
                    break
                except self.client.exceptions.ClientError as exc:
                    if exc.response.get("Error", {}).get("Code") not in ("PreconditionFailed",
                                                                         "ConditionalRequestConflict"):
                        raise
                holder = self._lock_age(key)
                if holder is not None and holder[1] > LOCK_STALE_SECONDS:
                    log(f"taking over the lock {SCHEME}{self.bucket}/{key} of a prepare not seen for "
                        f"{holder[1]:.0f} s ({holder[0]})")
                    self.client.delete_object(Bucket=self.bucket, Key=key)
                    continue
                if not told and holder is not None:
                    log(f"waiting for another prepare of {self.url} ({holder[0]}) to finish")
                    told = True
                time.sleep(LOCK_POLL_SECONDS)
        done = threading.Event()

        def refresh() -> None:
            while not done.wait(LOCK_REFRESH_SECONDS):
                with contextlib.suppress(Exception):  # a missed refresh is retried; the lock goes stale only after many
                    self.client.put_object(Bucket=self.bucket, Key=key, Body=me.encode())

        keeper = threading.Thread(target=refresh, name="prepare-lock", daemon=True)
        keeper.start()
        try:
            yield
        finally:
            done.set()
            keeper.join()
            with contextlib.suppress(Exception):
                self.client.delete_object(Bucket=self.bucket, Key=key)

    def _lock_age(self, key: str) -> tuple[str, float] | None:
        """(holder, seconds since the store last saw the lock written, by the store's own clock), or None if gone."""
        from email.utils import parsedate_to_datetime

        try:
            head = self.client.head_object(Bucket=self.bucket, Key=key)
            body = self.client.get_object(Bucket=self.bucket, Key=key)["Body"].read().decode(errors="replace")
        except self.client.exceptions.ClientError:
            return None
        now = parsedate_to_datetime(head["ResponseMetadata"]["HTTPHeaders"]["date"])
        return body, (now - head["LastModified"]).total_seconds()

    # --- reading prepared data -----------------------------------------------------------------------------------

    def manifest(self) -> tuple[bytes, dict[str, Any]]:
        """The prefix's manifest (raw and parsed); a prefix without one is a one-line error."""
        raw = self.read(MANIFEST)
        if raw is None:
            what = ("holds no prepared data" if not self.sizes() else
                    f"has no {MANIFEST} (not prepared, or its prepare has not finished)")
            raise MissingFileError(f"{self.url} {what}; run {fix_command(self.url)}")
        return raw, parse_manifest(raw, self.url)

    def check_train(self, manifest: dict[str, Any], index: bytes | None) -> None:
        """Every training chunk the index names is in the bucket at the size the index says."""
        check_chunks(self.url, manifest, index, self.sizes("train/"))

    def mirror(self, cache_dir: str | None = None) -> str:
        """A local folder holding this prefix's manifest, chunk index, held-out arrays and tokenizer (not the training
        chunks, which stream): fetched once per node (one process downloads, the others wait for it) into
        ``<cache>/cable_lightning/<url hash>/<manifest hash>``, and checked like a local prepared folder."""
        from .manifest import read_manifest

        self.check()
        raw, manifest = self.manifest()
        index = self.read("train/index.json")
        self.check_train(manifest, index)
        home = os.path.join(cache_dir or default_cache_dir(), "cable_lightning",
                            hashlib.sha256(self.url.encode()).hexdigest()[:16])
        folder = os.path.join(home, hashlib.sha256(raw).hexdigest()[:16])
        os.makedirs(home, exist_ok=True)
        with open(os.path.join(home, LOCK_SUFFIX), "a") as lock:
            fcntl.lockf(lock, fcntl.LOCK_EX)
            if not os.path.isfile(os.path.join(folder, MANIFEST)):
                staged = tempfile.mkdtemp(prefix=".partial-", dir=home)
                os.makedirs(os.path.join(staged, "train"))
                with open(os.path.join(staged, "train", "index.json"), "wb") as f:
                    f.write(index or b"")
                for name in [s["file"] for s in manifest["splits"].values() if "file" in s] + (
                        [manifest["tokenizer"]["file"]] if manifest["tokenizer"].get("file") else []):
                    self.download(name, os.path.join(staged, name))
                with open(os.path.join(staged, MANIFEST), "wb") as f:  # last: the folder is whole once it is there
                    f.write(raw)
                for old in os.listdir(home):  # an earlier preparation of this URL, or a killed download
                    if old not in (LOCK_SUFFIX, os.path.basename(staged)):
                        shutil.rmtree(os.path.join(home, old), ignore_errors=True)
                os.rename(staged, folder)
        read_manifest(folder, check_train=False)  # the held-out arrays against the manifest
        return folder
