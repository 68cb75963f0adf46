"""Prepared data in an S3-compatible store, against a real server on 127.0.0.1 (moto's server mode, started by the
``s3_server`` fixture): prepare into it, train, resume and evaluate from it as from a local folder, and the one-line
errors of a store that cannot serve."""

import glob
import json
import os
import socket
import threading
import time
from types import SimpleNamespace

import pytest
import recorders
from conftest import TINY_VAL_FRACTION, args

from cable_lightning.cli import main
from cable_lightning.data import remote
from cable_lightning.data.datamodule import TokenDataModule
from cable_lightning.data.manifest import read_manifest
from cable_lightning.data.prepare import prepare
from cable_lightning.data.remote import Store
from cable_lightning.errors import ConfigError, MissingFileError, TargetExistsError


def test_prepare_into_the_store_publishes_the_local_folders_files(tiny_corpus_s3, tiny_corpus_dir, tiny_corpus_docs):
    """The same request prepared into the store and into a folder gives the same bytes; the same request again is a
    no-op, a different one is refused."""
    store, client = Store(tiny_corpus_s3), Store(tiny_corpus_s3).client
    local = sorted(os.path.relpath(os.path.join(root, f), tiny_corpus_dir)
                   for root, _, files in os.walk(tiny_corpus_dir) for f in files)
    assert sorted(store.sizes()) == local
    for name in local:
        with open(os.path.join(tiny_corpus_dir, name), "rb") as f:
            if name == "train/index.json":  # it records when it was written
                index, remote_index = json.load(f), json.loads(store.read(name))
                assert remote_index["chunks"] == index["chunks"]
                assert remote_index["updated_at"] != index["updated_at"]
            elif name != "manifest.json":  # compared below
                assert store.read(name) == f.read(), name
    uploaded = json.loads(store.read("manifest.json"))
    assert {k: v for k, v in uploaded.items() if k not in ("created", "seconds")} == {
        k: v for k, v in read_manifest(tiny_corpus_dir).items() if k not in ("created", "seconds")}
    assert "tiny-bpe512.lock" not in {o["Key"] for o in client.list_objects_v2(Bucket="cable-tests")["Contents"]}

    again = prepare(source=tiny_corpus_docs[0], tokenizer="bpe:512", out=tiny_corpus_s3,
                    val_fraction=TINY_VAL_FRACTION, verbose=False)
    assert again["created"] == uploaded["created"]
    with pytest.raises(TargetExistsError, match=r"already holds data prepared from .* pass --overwrite") as err:
        prepare(source=tiny_corpus_docs[0], tokenizer="bpe:512", out=tiny_corpus_s3, val_fraction=0.2, verbose=False)
    assert "\n" not in str(err.value)


def test_a_prepare_waits_for_the_one_holding_the_lock_then_finds_its_work_done(
        s3_url, tiny_corpus_dir, tiny_corpus_docs, capsys):
    """Two prepares of one prefix do one preparation: the second waits on the lock object while the first works,
    then returns the first one's manifest without preparing."""
    store = Store(s3_url)
    results = []
    with store.lock(print):
        second = threading.Thread(target=lambda: results.append(prepare(
            source=tiny_corpus_docs[0], tokenizer="bpe:512", out=s3_url, val_fraction=TINY_VAL_FRACTION)))
        second.start()
        waited = ""
        for _ in range(200):
            waited += capsys.readouterr().out
            if "waiting for another prepare" in waited:
                break
            time.sleep(0.1)
        assert "waiting for another prepare" in waited and not results
        store.publish(tiny_corpus_dir, ".cable_lightning.json", print)  # the first prepare's work
    second.join(60)
    assert results and results[0]["created"] == read_manifest(tiny_corpus_dir)["created"]
    assert "nothing to do" in capsys.readouterr().out


def test_a_lock_its_holder_stopped_refreshing_is_taken_over(s3_url, monkeypatch):
    store = Store(s3_url)
    store.client.put_object(Bucket=store.bucket, Key=f"{store.prefix}.lock", Body=b'{"host": "gone", "pid": 1}')
    monkeypatch.setattr(remote, "LOCK_STALE_SECONDS", 1.0)
    monkeypatch.setattr(remote, "LOCK_POLL_SECONDS", 0.2)
    said = []
    lock = dict(Bucket=store.bucket, Key=f"{store.prefix}.lock")
    with store.lock(said.append):
        assert json.loads(store.client.get_object(**lock)["Body"].read())["pid"] == os.getpid()
    assert any("taking over" in line and "gone" in line for line in said)
    with pytest.raises(store.client.exceptions.NoSuchKey):  # released
        store.client.get_object(**lock)


def test_an_unfinished_prefix_reads_as_not_prepared_and_is_prepared_again(s3_url, tiny_corpus_dir, tiny_corpus_docs):
    """Objects of a prepare that stopped before its manifest: readers refuse them, the next prepare replaces them."""
    store = Store(s3_url)
    store.client.put_object(Bucket=store.bucket, Key=store.key(".cable_lightning.json"),
                            Body=b'{"written_by": "prepare"}')
    store.client.put_object(Bucket=store.bucket, Key=store.key("train/chunk-0-0.bin"), Body=b"partial")
    with pytest.raises(MissingFileError, match="has no manifest.json .not prepared, or its prepare has not finished"):
        TokenDataModule(s3_url).describe()
    manifest = prepare(source=tiny_corpus_docs[0], tokenizer="bpe:512", out=s3_url, val_fraction=TINY_VAL_FRACTION,
                       num_workers=1, start_method="fork", verbose=False)
    with open(os.path.join(tiny_corpus_dir, "train", "chunk-0-0.bin"), "rb") as f:
        assert store.read("train/chunk-0-0.bin") == f.read()
    assert json.loads(store.read("manifest.json"))["created"] == manifest["created"]


def test_a_prefix_prepare_did_not_write_is_refused(s3_url, tiny_corpus_docs):
    store = Store(s3_url)
    store.client.put_object(Bucket=store.bucket, Key=store.key("photos/cat.jpg"), Body=b"meow")
    with pytest.raises(TargetExistsError, match=r"holds 1 objects not written by prepare"):
        prepare(source=tiny_corpus_docs[0], tokenizer="bpe:512", out=s3_url, verbose=False)
    assert store.read("photos/cat.jpg") == b"meow"


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_a_store_that_cannot_serve_is_one_line_before_any_work(s3_server, tiny_corpus_s3, tiny_corpus_docs,
                                                               monkeypatch, tmp_path):
    cases = [
        (dict(path=tiny_corpus_s3, endpoint_url=f"http://127.0.0.1:{_closed_port()}"),
         r"cannot reach the object store at http://127.0.0.1:\d+ \(EndpointConnectionError\) while opening"),
        (dict(path="s3://no-such-bucket/data"), r"bucket 'no-such-bucket' does not exist at http://127.0.0.1"),
        (dict(path=tiny_corpus_s3.rsplit("/", 1)[0] + "/nothing-here"),
         r"s3://cable-tests/nothing-here holds no prepared data; run python -m cable_lightning prepare"),
        (dict(path="gs://bucket/data"), r"remote data must be an s3:// URL"),
        (dict(path="s3://bucket"), r"give s3://bucket/prefix"),
    ]
    for settings, message in cases:
        with pytest.raises(ConfigError, match=message) as err:
            TokenDataModule(**settings, cache_dir=str(tmp_path)).describe()
        assert "\n" not in str(err.value)
    with pytest.raises(ConfigError, match=r"cannot reach the object store .* while opening s3://cable-tests/x"):
        prepare(source=tiny_corpus_docs[0], tokenizer="bpe:512", out="s3://cable-tests/x",
                endpoint_url=f"http://127.0.0.1:{_closed_port()}", verbose=False)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-the-secret")
    with s3_server.checking_signatures():
        for attempt in (lambda: TokenDataModule(tiny_corpus_s3, cache_dir=str(tmp_path)).describe(),
                        lambda: prepare(source=tiny_corpus_docs[0], tokenizer="bpe:512", out=tiny_corpus_s3)):
            with pytest.raises(ConfigError, match=r"refused the credentials \(403\) while opening s3://cable-tests"):
                attempt()
    assert not os.listdir(tmp_path), "nothing was fetched"


def test_a_chunk_of_the_wrong_size_in_the_store_is_named(tiny_corpus_s3, tiny_corpus_dir, s3_url, tmp_path):
    store = Store(s3_url)
    store.publish(tiny_corpus_dir, ".cable_lightning.json", lambda *_: None)
    store.client.put_object(Bucket=store.bucket, Key=store.key("train/chunk-0-0.bin"), Body=b"truncated")
    with pytest.raises(ConfigError, match=rf"chunk {s3_url}/train/chunk-0-0.bin is 9 bytes, its index says \d+"):
        TokenDataModule(s3_url, cache_dir=str(tmp_path)).describe()


def test_fit_resume_and_evaluation_from_the_store_equal_the_local_folder(tiny_corpus_dir, tiny_corpus_s3, tmp_path):
    """Same batches, losses and validation records as from the folder; the resumed run keeps its chunks in another
    cache folder (as on another node) and continues the exact stream."""
    recorders.BATCHES.clear(), recorders.LOSSES.clear()
    main(["fit", *args(tiny_corpus_dir, str(tmp_path / "local"), steps=4, every=2,
                       extra=["--trainer.callbacks+=recorders.RecordBatches"])])
    local_batches, local_losses = list(recorders.BATCHES), list(recorders.LOSSES)

    recorders.BATCHES.clear(), recorders.LOSSES.clear()
    streamed = ["--trainer.callbacks+=recorders.RecordBatches", "--data.cache_dir"]
    main(["fit", *args(tiny_corpus_s3, str(tmp_path / "s3"), steps=4, every=2,
                       extra=[*streamed, str(tmp_path / "cache-a"), "--trainer.callbacks+=recorders.StopAt",
                              "--trainer.callbacks.step=2"])])
    assert len(recorders.BATCHES) == 2
    main(["fit", *args(tiny_corpus_s3, str(tmp_path / "s3"), steps=4, every=2,
                       extra=[*streamed, str(tmp_path / "cache-b"), "--ckpt_path", "last"])])
    assert recorders.BATCHES == local_batches
    assert recorders.LOSSES == pytest.approx(local_losses, abs=1e-6)
    assert os.listdir(tmp_path / "cache-b"), "the resumed run streamed into its own cache"

    def records(root):
        rows = []
        for path in glob.glob(os.path.join(root, "test", "cable", "version_*", "length_eval.jsonl")):
            with open(path) as f:
                rows += [(r["step"], r["length"], r["loss"], r["tokens"]) for r in map(json.loads, f) if r["step"] == 4]
        return sorted(rows)

    local, s3 = records(tmp_path / "local"), records(tmp_path / "s3")
    assert local and [row[:2] + row[3:] for row in s3] == [row[:2] + row[3:] for row in local]
    assert [row[2] for row in s3] == pytest.approx([row[2] for row in local], abs=1e-5)


def test_the_nodes_other_ranks_read_the_store_index_only_after_local_rank_zero_has(tiny_corpus_s3, tmp_path,
                                                                                   monkeypatch):
    """Two ranks of one node share a cache folder. Local rank 0's dataset is slowed as a loaded machine slows its
    index download; rank 1 must still wait for it (LitData waits a second for another rank's download, then reads a
    file that is not there: Lightning-AI/litData#337), and both ranks stream the same dataset."""
    import litdata

    real, finished = litdata.StreamingDataset, []

    def slow_on_rank_zero(*args, **kwargs):
        if threading.current_thread().name == "rank0":
            time.sleep(1.0)
        dataset = real(*args, **kwargs)
        finished.append(threading.current_thread().name)
        return dataset

    monkeypatch.setattr(litdata, "StreamingDataset", slow_on_rank_zero)
    barrier, loaders, errors = threading.Barrier(2, timeout=60), {}, []
    modules = [TokenDataModule(tiny_corpus_s3, block_size=32, cache_dir=str(tmp_path)) for _ in range(2)]
    for rank, module in enumerate(modules):
        module.describe()  # the mirror, one rank after the other: its lock is per process, these are threads
        module.trainer = SimpleNamespace(world_size=2, local_rank=rank,
                                         strategy=SimpleNamespace(barrier=lambda name: barrier.wait()))

    def load(rank):
        try:
            loaders[rank] = modules[rank].train_dataloader()
        except Exception as exc:  # reported below, in the test's thread
            errors.append(exc)

    threads = [threading.Thread(target=load, args=(rank,), name=f"rank{rank}") for rank in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors, errors
    assert finished == ["rank0", "rank1"]
    assert len(loaders[0].dataset) == len(loaders[1].dataset) > 0
