"""The corpora (data/sources.py, data/python_code.py): python-docs, the hub sources through a local stand-in,
wikitext's articles, the Python source on this machine. CPU only, no network."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch
from conftest import fast_prepare, joined, one_line, read_split_tokens

from cable_lightning.data.datamodule import TokenDataModule
from cable_lightning.data.manifest import read_manifest
from cable_lightning.data.prepare import main as prepare_main
from cable_lightning.data.sources import get_source, python_docs
from cable_lightning.data.tokenizers import EOT_TOKEN, get_tokenizer

pytestmark = pytest.mark.usefixtures("no_network")


def test_python_docs_is_real_text_and_deterministic():
    docs = python_docs()
    assert len(docs) >= 300
    assert sum(len(d) for d in docs) > 1_000_000
    assert any(d.startswith("Module json\n") for d in docs)
    assert any(d.startswith("Topic ") for d in docs)
    assert all(d.strip() for d in docs)
    # torch (imported here) replaces inspect.getfile; the corpus comes from a clean interpreter regardless.
    assert any("\ngetfile\n\nWork out which source or compiled file" in d for d in docs)
    assert python_docs() == docs


@pytest.mark.parametrize("source,repo", [("fineweb-edu", "HuggingFaceFW/fineweb-edu"),
                                         ("wikitext-103", "Salesforce/wikitext")])
def test_offline_hub_is_one_clear_line(source, repo, monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    kwargs = {"val_tokens": 1000} if source == "fineweb-edu" else {}
    with pytest.raises(RuntimeError) as exc:
        fast_prepare(source=source, tokenizer="bpe:512", out=str(tmp_path / "hub"), **kwargs)
    message = one_line(exc)
    assert repo in message and "python-docs" in message and "HF_HUB_OFFLINE" in message  # said before any retry
    assert not os.path.exists(tmp_path / "hub")


class StandIn:
    """A one-shard stand-in for a `datasets` streaming dataset."""

    n_shards = 1

    def __init__(self, rows):
        self.rows = rows

    def shard(self, num_shards, index):
        return iter(self.rows)


def test_wikitext_articles_split_on_titles():
    from cable_lightning.data.sources import WikiText103Source

    lines = ["", " = Alpha = \n", "", " text a \n", " = = Section = = \n", " more a \n", " = Beta = \n", " text b \n"]
    src = WikiText103Source()
    src.files, src.streams = ["lines"], {"lines": ("text", {"data_files": ["lines"]})}
    src._open["lines"] = StandIn([{"text": line} for line in lines])  # what the hub stream yields: one row per line
    docs = list(src.read(("lines", 0)))
    assert docs == ["\n = Alpha = \n\n text a \n = = Section = = \n more a \n", " = Beta = \n text b \n"]




def code(name: str, lines: int = 12) -> str:
    """A distinct Python file's text."""
    return "".join(f"def {name}_{i}(value):\n    return value * {i} + len({name!r})\n\n" for i in range(lines))


def fake_distribution(site, name: str, version: str, files: dict[str, bytes | None], record: bool = True) -> None:
    """``files`` written under ``site`` and listed in ``<name>-<version>.dist-info``'s RECORD, as pip leaves them."""
    info = site / f"{name.replace('-', '_')}-{version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    for path, data in files.items():
        (site / path).parent.mkdir(parents=True, exist_ok=True)
        if data is not None:
            (site / path).write_bytes(data)
        else:  # listed, but a folder: a file that cannot be read
            (site / path).mkdir()
    if record:
        (info / "RECORD").write_text("".join(f"{p},,\n" for p in [*files, f"{info.name}/METADATA"]))


@pytest.fixture
def fake_python(tmp_path, monkeypatch):
    """A standard library and a site-packages folder with three distributions, two trained and one held out (names
    chosen by the source's own rule), with a vendored copy, files that are not text, an empty one and a file no
    distribution lists. Returns ({split: its documents in order}, the distributions' names in order (the stdlib,
    two trained, one held out), a file of the held-out one)."""
    import sys

    from cable_lightning.data import python_code

    def first(prefix, held):
        return next(f"{prefix}-{i}" for i in range(10_000) if python_code.held_out(f"{prefix}-{i}") == held)

    alpha, beta, gamma = first("alpha", False), first("beta", False), first("gamma", True)
    stdlib, site = tmp_path / "stdlib", tmp_path / "site"
    std = {"json/__init__.py": code("json_init"), "abc.py": code("abc")}
    for path, text in std.items():
        (stdlib / path).parent.mkdir(parents=True, exist_ok=True)
        (stdlib / path).write_text(text)
    (stdlib / "latin1.py").write_bytes("x = 'café'\n".encode("latin-1"))  # not UTF-8
    (stdlib / "site-packages").mkdir()
    (stdlib / "site-packages" / "other.py").write_text(code("another_interpreters_package"))
    fake_distribution(site, alpha, "1.0", {"alpha/core.py": code("core").encode(), "alpha/__init__.py": b"\n",
                                           "alpha/blob.py": b"x = 1\0\n", "alpha/data.txt": b"not python"})
    fake_distribution(site, beta, "2.5", {"beta/mod.py": code("mod").encode(),
                                          "beta/_vendor/core.py": code("core").encode()})  # a vendored copy
    fake_distribution(site, gamma, "0.3", {"gamma/util.py": code("util").encode(),
                                           "gamma/a.py": code("gamma_a").encode(),
                                           "gamma/_vendor/abc.py": code("abc").encode()})  # the stdlib's copy
    (site / "stray.py").write_text(code("stray"))
    monkeypatch.setattr(python_code, "python_environment", lambda: (str(stdlib), [str(site)]))
    stdlib_name = f"python-{sys.version_info.major}.{sys.version_info.minor}"
    by_dist = {stdlib_name: [code("abc"), code("json_init")], alpha: [code("core")], beta: [code("mod")],
               gamma: [code("gamma_a"), code("util")]}
    splits = {name: "val" if name != stdlib_name and python_code.held_out(name) else "train" for name in by_dist}
    expected = {split: [doc for name, docs in by_dist.items() if splits[name] == split for doc in docs]
                for split in ("train", "val")}
    return expected, [*by_dist], site / "gamma" / "util.py"


def stream_documents(out: str, split: str) -> list[str]:
    tok = get_tokenizer(os.path.join(out, "tokenizer.json"), name="bpe:300")
    text = tok.decode(read_split_tokens(out, split).tolist())
    assert text.endswith(EOT_TOKEN)
    return text.split(EOT_TOKEN)[:-1]


def test_python_code_reads_each_text_file_once_in_order(fake_python, capsys):
    """One document per .py file: the stdlib first, then distributions by name, files by path; a vendored copy, files
    that are not text, an empty one and one that no distribution lists are left out, each said in one line."""
    expected, names, _ = fake_python
    source = get_source("python-code")
    assert list(source.documents("train")) == expected["train"]
    assert list(source.documents("val")) == expected["val"]
    said = capsys.readouterr().err.splitlines()
    assert len(said) == 4 and all(line.startswith("source python-code: skipping ") for line in said), said
    assert "2 files (exact copies" in said[0] and "_vendor/core.py" in said[0] and "_vendor/abc.py" in said[0]
    assert "2 files (not UTF-8 text, or NUL bytes)" in said[1] and "1 files (empty)" in said[2]
    assert "stray.py" in said[3]
    described = source.describe()
    assert described["documents"] == {"train": len(expected["train"]), "val": len(expected["val"])}
    assert described["dropped"] == {"duplicates": 2, "not_text": 2, "empty": 1, "editable": 0, "scripts": 0,
                                    "unowned": 1}
    stdlib, alpha, _, gamma = names  # a selection, in any spelling, keeps those distributions in the same order
    chosen = get_source(f"python-code:{gamma.upper()}, {stdlib.replace('-', '_')},{alpha}")
    assert chosen.name == f"python-code:{stdlib},{alpha},{gamma}"
    assert [d["name"] for d in chosen.describe()["distributions"]] == [stdlib, alpha, gamma]


def test_python_code_holds_out_whole_distributions(fake_python, tmp_path, monkeypatch):
    """Validation is every file of the held-out distributions and nothing else; the manifest says which went where.
    The standard library always trains, whatever its version's name hashes to (python-3.12's is in the held-out
    share: a Python 3.12 machine would otherwise validate on its whole library)."""
    from types import SimpleNamespace

    from cable_lightning.data import python_code
    from cable_lightning.data.python_code import held_out

    assert held_out("python-3.12")
    with monkeypatch.context() as patch:
        patch.setattr(python_code, "sys", SimpleNamespace(version_info=SimpleNamespace(major=3, minor=12)))
        library = python_code._stdlib(str(tmp_path))
    assert (library.name, library.split) == ("python-3.12", "train")

    expected, names, _ = fake_python
    gamma = names[-1]
    out = str(tmp_path / "code")
    manifest = fast_prepare(source="python-code", tokenizer="bpe:300", out=out)
    train, val = stream_documents(out, "train"), stream_documents(out, "val")
    assert train == expected["train"] and val == expected["val"]
    dists = manifest["source"]["distributions"]
    assert [d["split"] for d in dists] == ["train"] + ["val" if held_out(d["name"]) else "train" for d in dists[1:]]
    assert {d["name"]: d["version"] for d in dists if d["split"] == "val"}.get(gamma) == "0.3"
    gamma_files = [code("gamma_a"), code("util")]
    assert not set(gamma_files) & set(train) and set(gamma_files) <= set(val)
    assert manifest["splits"]["val"]["tokens"] == len(read_split_tokens(out, "val"))


def test_python_code_two_workers_give_one_workers_tokens_and_the_hash_tells_corpora_apart(fake_python, tmp_path,
                                                                                         monkeypatch):
    """Work items of one file each, read by two workers, give the one-worker stream token for token; the corpus hash
    is the same for the same files and changes with a file's content."""
    from cable_lightning.data import python_code

    _, _, gamma_file = fake_python
    monkeypatch.setattr(python_code, "ITEM_BYTES", 1)
    assert len(get_source("python-code").work_items("train")) >= 4
    one = fast_prepare(source="python-code", tokenizer="bpe:300", out=str(tmp_path / "one"))
    tokenizer = str(tmp_path / "one" / "tokenizer.json")
    two = fast_prepare(source="python-code", tokenizer=tokenizer, out=str(tmp_path / "two"), num_workers=2)
    for split in ("train", "val"):
        np.testing.assert_array_equal(read_split_tokens(str(tmp_path / "two"), split),
                                      read_split_tokens(str(tmp_path / "one"), split))
    assert two["source"]["corpus_hash"] == one["source"]["corpus_hash"]
    assert two["source"]["distributions"] == one["source"]["distributions"]
    gamma_file.write_text(gamma_file.read_text().replace("value", "values"))
    assert get_source("python-code").describe()["corpus_hash"] != one["source"]["corpus_hash"]


def test_python_code_hash_does_not_depend_on_where_an_editable_project_lives(fake_python, tmp_path, capsys):
    """An editable install lists only the installer's generated finder, which holds the checkout's absolute path: two
    checkouts at different paths give one corpus and one hash, and the left-out file is said in one line."""
    from cable_lightning.data import python_code

    site = tmp_path / "site"
    editable = next(f"mine-{i}" for i in range(10_000) if not python_code.held_out(f"mine-{i}"))
    finder = f"__editable___{editable.replace('-', '_')}_0_1_finder.py"
    fake_distribution(site, editable, "0.1", {finder: b""})
    info = site / f"{editable.replace('-', '_')}-0.1.dist-info"
    (info / "direct_url.json").write_text('{"dir_info": {"editable": true}, "url": "file:///one"}')
    hashes, trained = [], []
    for checkout in ("/home/a/checkout", "/srv/b/another/checkout"):
        (site / finder).write_text(f"MAPPING = {{'mine': {checkout + '/mine'!r}}}\n" + code("finder"))
        source = get_source("python-code")
        hashes.append(source.describe()["corpus_hash"])
        trained.append(list(source.documents("train")))
    assert hashes[0] == hashes[1] and trained[0] == trained[1]
    assert not any("checkout" in doc for doc in trained[0])
    said = [line for line in capsys.readouterr().err.splitlines() if "editable install" in line]
    assert said and said[0].startswith("source python-code: skipping 1 files (generated by an editable install")
    assert source.describe()["dropped"]["editable"] == 1


def test_python_code_hash_does_not_depend_on_where_the_virtualenv_lives(fake_python, tmp_path, capsys):
    """pip rewrites the first line of a script it installs outside site-packages (``../bin/tool.py``) to the
    interpreter's absolute path: two virtualenvs at different paths give one corpus and one hash, the script is left
    out, and that is said in one line."""
    from cable_lightning.data import python_code

    site = tmp_path / "site"
    name = next(f"tool-{i}" for i in range(10_000) if not python_code.held_out(f"tool-{i}"))
    fake_distribution(site, name, "1.0", {"../bin/tool.py": b"", "tool/cli.py": code("cli").encode()})
    hashes, trained = [], []
    for venv in ("/tmp/tmp.AbCdEfGhIj/venv", "/work/checkout/.venv"):
        (tmp_path / "bin" / "tool.py").write_text(f"#!{venv}/bin/python\n" + code("tool_script"))
        source = get_source("python-code")
        hashes.append(source.describe()["corpus_hash"])
        trained.append(list(source.documents("train")))
    assert hashes[0] == hashes[1] and trained[0] == trained[1]
    assert code("cli") in trained[0] and not any("bin/python" in doc for doc in trained[0])
    said = [line for line in capsys.readouterr().err.splitlines() if "outside site-packages" in line]
    assert said and said[0].startswith("source python-code: skipping 1 files (installed outside site-packages")
    assert str(tmp_path / "bin" / "tool.py") in said[0]
    assert source.describe()["dropped"]["scripts"] == 1


def test_python_code_keeps_its_file_list_and_expect_names_the_files_that_differ(fake_python, tmp_path, capsys):
    """A prepared python-code folder keeps every kept file (distribution, path in its folder, size, content hash) in
    files.tsv, whose sum is the manifest's corpus hash; ``--expect`` with that list prepares, and against another
    machine's corpus refuses in one line naming the changed file, before anything is written."""
    from cable_lightning.data.python_code import FILE_LIST, list_hash, read_file_list

    _, names, gamma_file = fake_python
    manifest = fast_prepare(source="python-code", tokenizer="bpe:300", out=str(tmp_path / "one"))
    listed = read_file_list(str(tmp_path / "one" / FILE_LIST))
    assert list_hash(listed) == manifest["source"]["corpus_hash"]
    assert [row.distribution for row in listed][0] == names[0] and len(listed) == sum(manifest["source"]["documents"]
                                                                                        .values())
    assert {row.path for row in listed if row.distribution == names[-1]} == {"gamma/a.py", "gamma/util.py"}
    expected = str(tmp_path / "published.tsv")
    os.replace(tmp_path / "one" / FILE_LIST, expected)
    fast_prepare(source="python-code", tokenizer="bpe:300", out=str(tmp_path / "same"), expect=expected)
    capsys.readouterr()
    gamma_file.write_text(gamma_file.read_text() + "# one more line\n")
    with pytest.raises(SystemExit) as exit_info:
        prepare_main(["--source", "python-code", "--tokenizer", "bpe:300", "--out", str(tmp_path / "two"), "--quiet",
                      "--expect", expected])
    lines = [line for line in capsys.readouterr().err.splitlines() if not line.startswith("source python-code: skip")]
    assert exit_info.value.code == 2 and len(lines) == 1, lines
    assert f"is not the corpus {expected} lists" in lines[0]
    assert f"1 changed ({names[-1]} 0.3 gamma/util.py: " in lines[0], lines[0]
    assert not (tmp_path / "two").exists()


def test_every_prepared_source_has_a_corpus_hash_of_its_text_wherever_it_lies(tiny_corpus_dir, tmp_path):
    """python-docs (its cache's jsonl parts) and local files had no corpus hash, so report mixed their runs with
    python-code runs without a word: the hash is over the files' contents in order, not their paths."""
    from cable_lightning.data.sources import local_files

    assert read_manifest(tiny_corpus_dir)["source"]["corpus_hash"]
    hashes = []
    for folder in ("one", "elsewhere/two"):
        parts = tmp_path / folder
        parts.mkdir(parents=True)
        for i in range(2):
            (parts / f"part-{i:02d}.jsonl").write_text(json.dumps({"text": f"document {i}"}) + "\n")
        hashes.append(local_files(str(parts), name="python-docs").describe()["corpus_hash"])
    assert hashes[0] == hashes[1] and len(hashes[0]) == 64
    (tmp_path / "one" / "part-01.jsonl").write_text(json.dumps({"text": "document 2"}) + "\n")
    assert local_files(str(tmp_path / "one"), name="python-docs").describe()["corpus_hash"] != hashes[0]


def test_python_code_bad_environments_are_one_line_errors(tmp_path, monkeypatch, capsys):
    """An empty environment, an unknown or one-sided selection, a distribution whose file cannot be read or whose
    RECORD is missing: one line, exit 2, before any output is written."""
    from cable_lightning.data import python_code

    stdlib, site = tmp_path / "stdlib", tmp_path / "site"
    stdlib.mkdir()
    site.mkdir()
    monkeypatch.setattr(python_code, "python_environment", lambda: (str(stdlib), [str(site)]))
    trained = next(f"lib-{i}" for i in range(10_000) if not python_code.held_out(f"lib-{i}"))

    def error(spec, *extra):
        with pytest.raises(SystemExit) as exit_info:
            prepare_main(["--source", spec, "--tokenizer", "bpe:300", "--out", str(tmp_path / "out"), "--quiet",
                          *extra])
        lines = capsys.readouterr().err.splitlines()
        assert exit_info.value.code == 2 and len(lines) == 1 and lines[0].startswith("error: "), lines
        assert not (tmp_path / "out").exists()
        return lines[0]

    assert "python-code found no .py files in the standard library" in error("python-code")
    (stdlib / "os.py").write_text(code("os"))
    fake_distribution(site, trained, "1.0", {"lib/a.py": code("a").encode()})
    assert "has no val files" in error(f"python-code:{trained}")  # not held out
    assert "no distribution named nosuch-pkg here" in error("python-code:nosuch_pkg")
    assert "python-code: has an empty name" in error("python-code:")
    held = next(f"lib-{i}" for i in range(10_000) if python_code.held_out(f"lib-{i}"))
    fake_distribution(site, held, "2.0", {"held/a.py": code("held_a").encode(), "held/b.py": None})
    message = error(f"python-code:{held}")
    assert "has no train files" in message and trained in message.partition("e.g. one of ")[2]
    assert f"held/b.py of {held} 2.0 cannot be read (IsADirectoryError" in error("python-code")
    assert "own validation split" in error(f"python-code:{held},{trained}", "--val_tokens", "100")
    fake_distribution(site, "no-record", "1.0", {"nr/a.py": code("nr").encode()}, record=False)
    assert "distribution no-record 1.0 lists no files (its RECORD" in error("python-code")


def test_hub_sources_with_a_local_stand_in(monkeypatch, tmp_path):
    """The hub code path (streaming, shards, wikitext's own splits and articles) end to end, with
    `datasets.load_dataset` answering from local parquet files instead of the hub."""
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    from cable_lightning.data import sources

    def parquet(name, texts):
        path = str(tmp_path / f"{name}.parquet")
        pq.write_table(pa.table({"text": texts}), path)
        return path

    web = [[f"web page {shard}.{i}: " + "education matters. " * (5 + i) for i in range(20)] for shard in range(3)]
    wiki = {
        "train": ["", " = Alpha = \n", "", " alpha text \n", " = Beta = \n", " beta text \n"],
        "validation": ["", " = Gamma = \n", " gamma text \n"] * 40,
        "test": ["", " = Delta = \n", " delta text \n"] * 40,
    }
    files = {("HuggingFaceFW/fineweb-edu", "train"): [parquet(f"web{i}", t) for i, t in enumerate(web)]}
    files.update({("Salesforce/wikitext", s): [parquet(f"wiki-{s}", lines)] for s, lines in wiki.items()})
    real_load = datasets.load_dataset

    def load_dataset(repo, name=None, split=None, streaming=False):
        assert streaming and name in ("sample-10BT", "wikitext-103-raw-v1")
        return real_load("parquet", data_files=files[(repo, split)], split="train", streaming=True)

    monkeypatch.setattr(datasets, "load_dataset", load_dataset)
    monkeypatch.setattr(sources, "check_hub", lambda repo: None)

    out = str(tmp_path / "web")
    manifest = fast_prepare(source="fineweb-edu", tokenizer="bpe:300", out=out, val_tokens=200, num_workers=2)
    stream = np.concatenate([read_split_tokens(out, "val"), read_split_tokens(out, "train")])
    tok = get_tokenizer(os.path.join(out, "tokenizer.json"), name="bpe:300")
    assert tok.decode(stream.tolist()) == joined([t for shard in web for t in shard])
    assert manifest["source"]["repo"] == "HuggingFaceFW/fineweb-edu"

    out = str(tmp_path / "wiki")
    manifest = fast_prepare(source="wikitext-103", tokenizer="bpe:300", out=out)
    assert set(manifest["splits"]) == {"train", "val", "test"}
    tok = get_tokenizer(os.path.join(out, "tokenizer.json"), name="bpe:300")
    assert tok.decode(read_split_tokens(out, "train").tolist()) == joined(["\n = Alpha = \n\n alpha text \n",
                                                                          " = Beta = \n beta text \n"])
    assert tok.decode(read_split_tokens(out, "val").tolist()).count(EOT_TOKEN) == 40
    dm = TokenDataModule(out, block_size=16, eval_tokens=64)
    assert torch.equal(dm.test_dataloader().dataset.tokens, dm.eval_stream("test"))
    assert torch.equal(dm.eval_stream("test"), torch.from_numpy(read_split_tokens(out, "test")[:65].astype(np.int64)))
