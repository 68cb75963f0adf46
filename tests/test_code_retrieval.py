"""The long-file code retrieval set on a fake Python environment: CodeSearchNet's filters, the docstring
removed from exactly its own lines, the split by distribution (no held-out function in a training pair), each
query's function at its recorded token offset, the same files and hash from the same environment, one-line
errors."""

import json
import os

import pytest
from test_sources import fake_distribution

from cable_lightning.__main__ import main as run
from cable_lightning.data import code_retrieval, python_code
from cable_lightning.data.code_retrieval import CodeSettings, build, parse, source_lines
from cable_lightning.data.sources import get_source
from cable_lightning.data.tokenizers import train_bpe

TRAINED = '''"""A module of helpers."""
import os


def join_home(path):
    """Join the path with the home folder of the user.

    The second paragraph is not part of the query.
    """
    home = os.path.expanduser("~")
    full = os.path.join(home, path)
    return full


def __call__(self):
    """A dunder method has its docstring too."""
    a = 1
    b = 2
    return a + b


def check_testing_helper():
    """Check that the helpers work well."""
    a = 1
    b = 2
    assert a + b == 3


def doubled(x):
    """Return the value doubled, twice."""
    return x * 2


def tripled(x):
    """Triples."""
    y = x
    z = y * 3
    return z


def inline(x):
    """An inline docstring shares its line."""; y = x; z = y
    return z


class Reader:
    @staticmethod
    def read_lines(name):
        """Read every line of the named file into a list."""
        with open(name) as f:
            # a comment line does not count as a body line
            lines = f.readlines()
        return lines
'''

# The same code as join_home (another name, spacing and comments) under another docstring; the same docstring (other
# case and punctuation) over other code: both near-duplicates of training pairs. And a copy of a held-out function.
COPIES = '''def home_joined(path):
    """Build a path below the home folder."""
    home = os.path.expanduser( "~" )   # where the user lives
    full = os.path.join(home,path)
    return full


def joins_home(path):
    """JOIN the path, with the home folder of the user!"""
    base = os.environ["HOME"]
    where = base + "/" + path
    return where


def vendored_parse(text):
    """A vendored copy's own docstring."""
    words = text.split()
    count = len(words)
    return words, count
'''

HELD = {  # held-out files: three with a query each, one without a documented function, one that does not parse
    "held/parser.py": '''"""Parsing."""


def parse_words(text):
    """Split the text into words and count them."""
    words = text.split()
    count = len(words)
    return words, count


def other_function(value):
    """Another documented function that stays documented."""
    doubled = value * 2
    tripled = value * 3
    return doubled + tripled
''',
    "held/shapes.py": '''import math
\x0c
# a form feed above: Python does not count it as a line break, str.splitlines does


class Circle:
    def __init__(self, radius):
        self.radius = radius

    async def area_of_circle(self, scale=1):
        """Compute the area of the circle,
        scaled by the given factor.

        Returns a float.
        """
        radius = self.radius * scale
        squared = radius ** 2
        return math.pi * squared
''',
    "held/windows.py": 'import sys\r\n\r\n\r\ndef platform_name():\r\n'
                       '    """Name the platform this runs on, in words."""\r\n    name = sys.platform\r\n'
                       '    lower = name.lower()\r\n    return lower\r\n',
    "held/constants.py": "LIMIT = 10\nNAMES = ['a', 'b']\n",
    "held/python2.py": 'print "this is Python 2"\n',
}


# A licence above the module docstring (and a file that is nothing else): not part of the held-out documents.
LICENSED = {
    "held/licensed.py": '#!/usr/bin/env python\n# Copyright The Authors.\n#\n# Licensed under the Apache License.\n\n'
                        '"""Sums."""\nimport math\n\n\ndef total_of_squares(values):\n'
                        '    """Add up the squares of the given values."""\n    # a comment in the code stays\n'
                        '    squares = [v * v for v in values]\n    total = math.fsum(squares)\n    return total\n',
    "held/notice.py": "# Copyright The Authors.\n# Licensed under the Apache License.\n\n",
}


def make_environment(tmp_path, monkeypatch, held):
    """A standard library and two trained distributions, one (``held``'s files) held out (names by the source's own
    rule)."""

    def first(prefix, is_held):
        return next(f"{prefix}-{i}" for i in range(10_000) if python_code.held_out(f"{prefix}-{i}") == is_held)

    stdlib, site = tmp_path / "stdlib", tmp_path / "site"
    stdlib.mkdir()
    (stdlib / "helpers.py").write_text(TRAINED)
    fake_distribution(site, first("alpha", False), "1.0", {"alpha/copies.py": COPIES.encode()})
    fake_distribution(site, first("gamma", True), "0.3", {path: text.encode() for path, text in held.items()})
    monkeypatch.setattr(python_code, "python_environment", lambda: (str(stdlib), [str(site)]))
    return tmp_path


@pytest.fixture
def environment(tmp_path, monkeypatch):
    return make_environment(tmp_path, monkeypatch, HELD)


@pytest.fixture(scope="module")
def tokenizer():
    return train_bpe([TRAINED, COPIES, *HELD.values()] * 3, 300)


def test_codesearchnet_filters_and_what_a_pair_holds():
    found = {f.name: f for f in parse(TRAINED)}
    assert {name: f.skip for name, f in found.items()} == {
        "join_home": None, "__call__": "dunder", "check_testing_helper": "test", "doubled": "short body",
        "tripled": "short docstring", "inline": "inline docstring", "read_lines": None}
    join_home = found["join_home"]
    assert join_home.query == "Join the path with the home folder of the user."
    assert join_home.code == ('def join_home(path):\n    home = os.path.expanduser("~")\n'
                              '    full = os.path.join(home, path)\n    return full\n')
    method = found["read_lines"]  # a method, from its decorator, indented as in the file
    assert method.code.startswith("    @staticmethod\n    def read_lines(name):\n        with open(name)")
    assert '"""' not in method.code and method.code.endswith("        return lines\n")
    assert parse('print "Python 2"\n') is None


def test_a_query_document_is_its_file_without_that_docstring_and_the_pairs_are_the_rest(environment, tokenizer):
    rows, counts = build(get_source("python-code"), tokenizer, CodeSettings(queries=3))
    held = {text.replace("\r\n", "\n") for text in HELD.values()}
    by_id = {d["_id"]: d["text"] for d in rows["corpus"]}
    assert len(by_id) == 4 and counts["files"]["val"] == {"parsed": 4, "comments_only": 0, "not_parsed": 1}
    assert {q["function"] for q in rows["queries"]} == {"parse_words", "area_of_circle", "platform_name"}
    for query in rows["queries"]:
        document = by_id[query["doc"]]
        original = next(text for text in HELD.values() if text.startswith(document[:9]))
        lines, kept = source_lines(original), source_lines(document)
        first = next(i for i, (a, b) in enumerate(zip(lines, kept)) if a != b)
        past = first + len(lines) - len(kept)  # lines[first:past] went, and nothing else
        assert lines[:first] + lines[past:] == kept
        assert lines[first].lstrip().startswith('"""') and lines[past - 1].rstrip().endswith('"""')
        assert "".join(lines[first:past]).count('"""') == 2
        assert query["text"][:25] not in document.replace("\n", " ")
    assert "Another documented function that stays documented." in by_id[
        next(q["doc"] for q in rows["queries"] if q["function"] == "parse_words")]
    assert rows["queries"][[q["function"] for q in rows["queries"]].index("area_of_circle")]["text"] == (
        "Compute the area of the circle, scaled by the given factor.")
    assert any(text in held for text in by_id.values())  # the distractor, as it is
    short = {d["_id"]: d["text"] for d in rows["short_corpus"]}
    assert [short[f] for _, f, _ in rows["short_qrels"]][0].startswith("def parse_words(text):\n    words =")
    for query, function in zip(rows["short_queries"], rows["short_corpus"]):  # the function whole, from token 0
        size = len(tokenizer.encode_batch([function["text"]])[0])
        assert (query["doc"], query["depth"], query["end"]) == (function["_id"], 0, size)


def test_a_held_out_document_starts_at_its_first_line_of_code_and_offsets_count_from_there(tmp_path, monkeypatch,
                                                                                           tokenizer):
    """A licence above the module docstring would fill the first window of most files with the same words: it goes,
    comments inside the code stay, a file of comments alone is no document, and the function's token offsets are
    those of the document as the encoder reads it."""
    make_environment(tmp_path, monkeypatch, {**HELD, **LICENSED})
    rows, counts = build(get_source("python-code"), tokenizer, CodeSettings(queries=4))
    assert counts["files"]["val"] == {"parsed": 6, "comments_only": 1, "not_parsed": 1}
    documents = [d["text"] for d in rows["corpus"]]
    assert len(documents) == 5 and not any("Licensed under" in text for text in documents)
    query = next(q for q in rows["queries"] if q["function"] == "total_of_squares")
    document = next(d["text"] for d in rows["corpus"] if d["_id"] == query["doc"])
    assert document.startswith('"""Sums."""\nimport math\n') and "    # a comment in the code stays\n" in document
    ids = tokenizer.encode_batch([document])[0]
    start = document.index("def total_of_squares")
    assert len(tokenizer.decode(ids[:query["depth"]])) <= start < len(tokenizer.decode(ids[:query["depth"] + 1]))
    assert query["tokens"] == len(ids)


def test_training_pairs_come_from_training_distributions_without_duplicates_or_held_out_copies(environment,
                                                                                               tokenizer):
    rows, counts = build(get_source("python-code"), tokenizer, CodeSettings(queries=3))
    assert sorted(pair["query"] for pair in rows["train_pairs"]) == [
        "Join the path with the home folder of the user.", "Read every line of the named file into a list."]
    assert counts["dropped"]["train"] == {"dunder": 1, "duplicate": 2, "in the held-out distributions": 1,
                                          "inline docstring": 1, "short body": 1, "short docstring": 1, "test": 1}
    assert counts["functions"]["train"] == {"documented": 10, "pairs": 2}
    held_code = "".join(d["text"] for d in rows["corpus"])
    assert not any(pair["positive"] in held_code or pair["query"] in held_code for pair in rows["train_pairs"])
    one = build(get_source("python-code"), tokenizer, CodeSettings(queries=3, train_pairs=1))[0]["train_pairs"]
    assert len(one) == 1 and one[0] in rows["train_pairs"]


def test_each_functions_text_starts_at_its_recorded_token_offset(environment, tokenizer):
    rows, _ = build(get_source("python-code"), tokenizer, CodeSettings(queries=3))
    by_id = {d["_id"]: d["text"] for d in rows["corpus"]}
    code = {q: f for (q, f, _), f in zip(rows["short_qrels"], (d["text"] for d in rows["short_corpus"]))}
    assert all(q["depth"] > 5 for q in rows["queries"])  # the function is never the file's first line here
    for query in rows["queries"]:
        document = by_id[query["doc"]]
        ids = tokenizer.encode_batch([document])[0]
        start = document.index(code[query["_id"]])  # the function, without its docstring, is in its file as is
        end = start + len(code[query["_id"]])

        def chars(tokens):  # how much of the document the first `tokens` tokens hold
            held = tokenizer.decode(ids[:tokens])
            assert document.startswith(held)
            return len(held)

        assert query["tokens"] == len(ids) and 0 < query["depth"] < query["end"] <= len(ids)
        assert chars(query["depth"]) <= start < chars(query["depth"] + 1), "depth: the token holding its first char"
        assert chars(query["end"] - 1) < end <= chars(query["end"]), "end: the tokens up to its last char"


def test_the_same_environment_gives_the_same_files_and_hash(environment, tokenizer, capsys):
    tokenizer.save(str(environment / "tokenizer.json"))
    argv = ["retrieval-set", "--source", "python-code", "--tokenizer", str(environment / "tokenizer.json"),
            "--queries", "2", "--documents", "3"]
    outputs = []
    for name in ("one", "two"):
        run([*argv, "--out", str(environment / name)])
        outputs.append({f: (environment / name / f).read_bytes() for f in (
            "corpus.jsonl", "queries.jsonl", "qrels.tsv", "train_pairs.jsonl", "manifest.json", "short/corpus.jsonl",
            "short/qrels.tsv")})
    assert outputs[0] == outputs[1]
    said = capsys.readouterr().out
    assert "wrote " in said and "2 training pairs" in said and "2 queries against 3 held-out files" in said
    manifest = json.loads(outputs[0]["manifest.json"])
    assert manifest["kind"] == "code retrieval set" and manifest["counts"]["documents"] == 3
    assert manifest["tokenizer_identity"]["hash"] == tokenizer.identity["hash"]
    first_hash = manifest["source"]["corpus_hash"]
    held_file = next(environment.glob("site/held/parser.py"))
    held_file.write_text(held_file.read_text().replace("count them", "count the words"))
    run([*argv, "--out", str(environment / "three")])
    assert json.loads((environment / "three" / "manifest.json").read_text())["source"]["corpus_hash"] != first_hash


@pytest.mark.parametrize("extra, message", [
    (["--doc_tokens", "512"], "error: --doc_tokens: not for --source python-code, whose documents are whole held-out"),
    (["--queries", "4"], "error: python-code's held-out distributions have 3 files with a function that can be a "
                         "query, 4 --queries were asked for; ask for at most 3"),
    (["--documents", "9"], "error: python-code's held-out distributions have 4 files that parse, 9 --documents were "
                           "asked for; ask for at most 4"),
    (["--documents", "1"], "error: --documents 1 is fewer than --queries 2: each query's file is a document"),
    (["--train_pairs", "3"], "error: python-code's training distributions hold 2 pairs after the filters and "
                             "de-duplication, 3 --train_pairs were asked for; ask for at most 2"),
])
def test_bad_requests_are_one_line(environment, tokenizer, capsys, extra, message):
    tokenizer.save(str(environment / "tokenizer.json"))
    with pytest.raises(SystemExit) as stop:
        run(["retrieval-set", "--source", "python-code", "--tokenizer", str(environment / "tokenizer.json"),
             "--out", str(environment / "out"), "--queries", "2", *extra])
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert stop.value.code == 2 and "Traceback" not in err and len(lines) == 1 and lines[0].startswith(message), err
    assert not os.path.exists(environment / "out")


def test_documents_is_refused_for_a_prose_source(capsys, tmp_path):
    with pytest.raises(SystemExit) as stop:
        run(["retrieval-set", "--source", "python-docs", "--tokenizer", "x.json", "--out", str(tmp_path / "o"),
             "--documents", "5"])
    assert stop.value.code == 2
    assert capsys.readouterr().err.strip().splitlines()[-1].startswith(
        "error: --documents is for --source python-code; a prose set has one document per query")


def test_the_manifest_names_the_in_view_share(environment, tokenizer):
    code_retrieval.make(get_source("python-code"), tokenizer, "bpe", CodeSettings(queries=3), str(environment / "set"))
    manifest = json.loads((environment / "set" / "manifest.json").read_text())
    ends = [json.loads(line)["end"] for line in (environment / "set" / "queries.jsonl").open()]
    assert manifest["counts"]["in_view"]["64"] == sum(end <= 64 for end in ends) / 3


def test_the_sweep_scores_a_code_set_and_its_short_check_and_can_cache_the_loss(tmp_path, capsys):
    """One command a run: --stage retrieval on a set with short/ adds the short-document check at the first length
    (recorded as <set>-short), and --finetune_mini_batch fine-tunes with the cached loss."""
    from cable_lightning import sweep
    from cable_lightning.hf.retrieval import passage_ends

    folder = tmp_path / "code-set"
    (folder / "short").mkdir(parents=True)
    for name in ("train_pairs.jsonl", "short/queries.jsonl"):
        (folder / name).write_text(json.dumps({"_id": "q0", "text": "query", "end": 3}) + "\n")
    sweep.main(["--config", "configs/paper/bert_base_code.yaml", "--pes", "cable", "--seeds", "0", "--experiment",
                "e", "--stage", "retrieval", "--retrieval_set", str(folder), "--retrieval_lengths", "512", "1024",
                "--finetune_mini_batch", "16", "--print_only"])
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 4 and "--mini_batch_size 16" in lines[1]
    assert f"--lengths 512 --corpus {folder}/short/corpus.jsonl" in lines[3]
    assert "--records runs/e/cable/seed0" in lines[3]
    sweep.main(["--config", "configs/encoder/mlm_code.yaml", "--pes", "cable", "alibi", "--seeds", "0",
                "--experiment", "e", "--stage", "fit+retrieval", "--retrieval_set", str(folder), "--retrieval_lengths",
                "128", "2048", "--print_only", "--", "--trainer.max_steps", "5"])
    lines = capsys.readouterr().out.splitlines()  # run by run: each fit, then its export, fine-tuning, evaluations
    assert [line.split(" ")[3:5] for line in lines] == [["fit", "--config"], ["export", "--ckpt_path"],
                                                        ["retrieval", "finetune"], ["retrieval", "evaluate"],
                                                        ["retrieval", "evaluate"]] * 2
    assert lines[0].endswith("--trainer.max_steps 5") and "alibi" in lines[5] and "runs/e/alibi/seed0" in lines[6]
    corpus = str(folder / "short" / "corpus.jsonl")
    assert passage_ends((corpus, str(folder / "short" / "queries.jsonl"), "")) == ("code-set-short", [3])
