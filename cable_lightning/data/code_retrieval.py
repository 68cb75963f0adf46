"""A long-file code retrieval set from the offline code corpus: CodeSearchNet's task, with whole source
files as the documents, so that an encoder must see far enough into a file to find the function a query describes.

``python -m cable_lightning retrieval-set --source python-code[:NAME,...] --tokenizer TOKENIZER.json --out DIR``

Every function (``def`` or ``async def``, methods and nested ones too) of every ``.py`` file of the corpus that
Python's ``ast`` parses is read with its docstring (files that do not parse, e.g. Python 2 code or test data, are
skipped and counted). A function is a *pair* (query: the docstring's first paragraph, whitespace collapsed; code: the
function's lines, from its first decorator to its last line, without the docstring's lines) when it passes
CodeSearchNet's filters:

- its name is no dunder (``__init__``) and does not hold ``test`` (any case);
- its docstring's first paragraph has more than 2 words;
- its body after the docstring has more than 2 lines (lines that are not blank and not only a comment);
- its docstring stands on its own lines (nothing before it or after it on them), so removing those lines leaves the
  rest of the file as it was.

The split is the corpus's own: whole distributions, by the hash of the name (``python-code``'s ``val``).

- **Training pairs** (``train_pairs.jsonl``: ``query``, ``positive`` = the code): every pair of the training
  distributions, after dropping duplicates in corpus order. Two keys say that two pairs are the same: the docstring's
  words (lower case, punctuation and spacing dropped) and the code's syntax tree (``ast.dump`` of the function with its
  name blanked and its docstring removed: formatting, comments and the name do not count). A pair is dropped when
  either key was seen before, and when either key belongs to any documented function of the held-out distributions
  (a vendored copy there would leak an evaluation answer into training). Kept in a seeded order; ``--train_pairs N``
  keeps the first N.
- **Evaluation** (``corpus.jsonl``, ``queries.jsonl``, ``qrels.tsv``): only the held-out distributions, each file
  without its leading comment block (the lines before its first line of code: a licence, a shebang, an encoding
  line; files that are nothing else are left out). 83% of the held-out files open with a licence of 128 tokens or
  more, the same text in every file of a package: kept, it would fill the first window of most documents with words
  that tell no file from another. A query is a pair's docstring, its one relevant document the whole file that holds
  the function, with that docstring's lines removed; at most one query per file, and only docstrings that no other
  documented held-out function shares (so no distractor holds the query's text). Every other held-out file that
  parses is a distractor, its comment block removed as well. ``--documents
  N`` keeps N files (every query's file, and distractors drawn by the seed; default: all). Each query row records
  where its function lies in its document in tokens of ``--tokenizer``: ``depth`` (the token that holds its first
  character) and ``end`` (tokens up to its last character), and ``tokens``, the document's length: a window of W
  tokens holds the whole function when ``end <= W`` (``retrieval evaluate`` prints that share at each length).
- **The short-document check** (``short/``, the same BEIR layout): the same queries, each against the functions of
  all queries, alone (the code as in the training pairs): fine-tuning's skill apart from the length's effect.

``manifest.json`` records the source (its ``corpus_hash``, as prepare's), the tokenizer's identity, the settings and
every count (files parsed and not, functions dropped by each filter, duplicate pairs). The same environment, settings
and tokenizer give the same files.
"""

from __future__ import annotations

import ast
import bisect
import copy
import hashlib
import io
import json
import os
import re
import shutil
import warnings
from collections import Counter
from dataclasses import asdict, dataclass
from typing import Optional

import numpy as np

from ..errors import ConfigError
from ..owned import check_replaceable, staging_folder, swap_in

FORMAT = 2  # 2: held-out files without their leading comment block
KIND = "code retrieval set"
WRITER = "retrieval set"  # the owned-folder marker: the same writer as the prose retrieval set
IN_VIEW_LENGTHS = (64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)  # the manifest's in-view shares


@dataclass(frozen=True)
class Function:
    """One documented function of a file."""

    name: str
    query: str  # the docstring's first paragraph, whitespace collapsed
    code: str  # its lines without the docstring's
    lines: tuple[int, int, int, int]  # 0-based: its first line, the docstring's first and past-last, its past-last
    doc_key: str
    code_key: str
    skip: Optional[str]  # the filter that drops it as a pair, or None


def source_lines(text: str) -> list[str]:
    """The lines as Python numbers them (``\\n``, ``\\r\\n``, ``\\r``; not form feeds, which ``splitlines`` splits
    on), with their ends."""
    return io.StringIO(text, newline="").readlines()


def is_code(line: str) -> bool:
    """A line that is neither blank nor only a comment: what a body's length counts and where a file's head ends."""
    return bool(line.strip()) and not line.lstrip().startswith("#")


def doc_key(query: str) -> str:
    return " ".join(re.findall(r"\w+", query.lower()))


def code_key(node: ast.AST) -> str:
    """The function's syntax without its name and docstring (formatting and comments are not in a tree)."""
    bare = copy.copy(node)
    bare.name, bare.body = "", node.body[1:]
    return hashlib.sha256(ast.dump(bare, annotate_fields=False).encode()).hexdigest()[:32]


def parse(text: str) -> Optional[list[Function]]:
    """Every documented function of a file's ``text`` in source order, or None when Python's ``ast`` cannot parse it."""
    try:
        with warnings.catch_warnings():  # invalid escape sequences and the like: the file still parses
            warnings.simplefilter("ignore")
            tree = ast.parse(text)
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return None
    lines = source_lines(text)
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) or ast.get_docstring(node) is None:
            continue
        docstring = node.body[0]
        first = (node.decorator_list[0].lineno if node.decorator_list else node.lineno) - 1
        doc_first, doc_end, end = docstring.lineno - 1, docstring.end_lineno, node.end_lineno
        own_lines = (not lines[doc_first].encode()[:docstring.col_offset].strip()
                     and lines[doc_end - 1].encode()[docstring.end_col_offset:].strip()[:1] in (b"", b"#"))
        body = sum(map(is_code, lines[doc_end:end]))
        query = " ".join(re.split(r"\n\s*\n", ast.get_docstring(node).strip(), maxsplit=1)[0].split())
        skip = ("dunder" if node.name.startswith("__") and node.name.endswith("__") else
                "test" if "test" in node.name.lower() else
                "inline docstring" if not own_lines or len(node.body) < 2 else
                "short docstring" if len(query.split()) <= 2 else
                "short body" if body <= 2 else None)
        found.append(Function(node.name, query, "".join(lines[first:doc_first] + lines[doc_end:end]),
                              (first, doc_first, doc_end, end), doc_key(query), code_key(node), skip))
    found.sort(key=lambda f: f.lines)
    return found


def without_header(text: str) -> str:
    """``text`` from its first line that is neither blank nor only a comment: a file's licence, shebang and encoding
    line go, the module docstring and the code stay ("" for a file of comments alone)."""
    lines = source_lines(text)
    first = next((i for i, line in enumerate(lines) if is_code(line)), len(lines))
    return "".join(lines[first:])


def without_docstring(text: str, function: Function) -> tuple[str, int, int]:
    """The file ``text`` without ``function``'s docstring lines, and the character span of the function in it."""
    lines = source_lines(text)
    first, doc_first, doc_end, end = function.lines
    starts = np.cumsum([0, *map(len, lines)])
    removed = int(starts[doc_end] - starts[doc_first])
    return "".join(lines[:doc_first] + lines[doc_end:]), int(starts[first]), int(starts[end]) - removed


def token_span(tokenizer, text: str, start: int, end: int) -> tuple[int, int, int]:
    """(the index of the token that holds character ``start``, the number of tokens that begin before character
    ``end``, the number of tokens of ``text``) in ``tokenizer``'s encoding of the whole text."""
    starts = tokenizer.char_starts([text])[0]
    return max(bisect.bisect_right(starts, start) - 1, 0), bisect.bisect_left(starts, end), len(starts)


@dataclass(frozen=True)
class CodeSettings:
    queries: int = 200
    documents: Optional[int] = None  # held-out files in the corpus (None: every one that parses)
    train_pairs: Optional[int] = None  # None: every pair the training distributions hold
    seed: int = 0

    def __post_init__(self):
        if self.queries < 1 or (self.train_pairs is not None and self.train_pairs < 0):
            raise ConfigError(f"need --queries >= 1 and --train_pairs >= 0, got {self.queries} and {self.train_pairs}")
        if self.documents is not None and self.documents < self.queries:
            raise ConfigError(f"--documents {self.documents} is fewer than --queries {self.queries}: each query's "
                              "file is a document; ask for at least as many documents as queries")


def files(source, split: str):
    """(path, text) of each kept file of ``split``, in the corpus's order."""
    for item in source.work_items(split):
        yield from zip((path for path, _ in item), source.read(item))


def build(source, tokenizer, settings: CodeSettings) -> tuple[dict, dict]:
    """The set's rows (``corpus``, ``queries``, ``qrels``, ``train_pairs``, and ``short_`` ``corpus``, ``queries`` and
    ``qrels``) and
    its counts, from a ``python-code`` source (see the module docstring)."""
    counts: dict = {"files": {}, "functions": {}, "dropped": {}}
    held: list[tuple[str, str, list[Function]]] = []
    comments_only = 0
    for path, text in files(source, "val"):
        document = without_header(text)  # comments are not syntax: it parses as the file does
        found = parse(document)
        if found is not None and not document.strip():
            comments_only += 1
        elif found is not None:
            held.append((path, document, found))
    counts["files"]["val"] = {"parsed": len(held) + comments_only, "comments_only": comments_only,
                              "not_parsed": source.describe()["documents"]["val"] - len(held) - comments_only}
    held_docs = Counter(f.doc_key for *_, found in held for f in found)
    held_code = {f.code_key for *_, found in held for f in found}

    pairs, seen_doc, seen_code, filtered = [], set(), set(), Counter()
    parsed = not_parsed = 0
    for _, text in files(source, "train"):
        found = parse(text)
        if found is None:
            not_parsed += 1
            continue
        parsed += 1
        for function in found:
            if function.skip:
                filtered[function.skip] += 1
            elif function.doc_key in held_docs or function.code_key in held_code:
                filtered["in the held-out distributions"] += 1
            elif function.doc_key in seen_doc or function.code_key in seen_code:
                filtered["duplicate"] += 1
            else:
                pairs.append({"query": function.query, "positive": function.code})
                seen_doc.add(function.doc_key)
                seen_code.add(function.code_key)
    counts["files"]["train"] = {"parsed": parsed, "not_parsed": not_parsed}
    counts["functions"]["train"] = {"documented": sum(filtered.values()) + len(pairs), "pairs": len(pairs)}
    counts["dropped"]["train"] = dict(sorted(filtered.items()))
    wanted = len(pairs) if settings.train_pairs is None else settings.train_pairs
    if wanted > len(pairs):
        raise ConfigError(f"{source.name}'s training distributions hold {len(pairs)} pairs after the filters and "
                          f"de-duplication, {wanted} --train_pairs were asked for; ask for at most {len(pairs)}")

    rng = np.random.default_rng(settings.seed)
    eligible = [[f for f in found if not f.skip and held_docs[f.doc_key] == 1] for *_, found in held]
    counts["functions"]["val"] = {"documented": sum(len(found) for *_, found in held),
                                  "queries_possible": sum(map(len, eligible)),
                                  "files_with_a_query": sum(map(bool, eligible))}
    counts["dropped"]["val"] = dict(sorted(Counter(f.skip or ("shared docstring" if held_docs[f.doc_key] > 1 else "")
                                                   for *_, found in held for f in found).items()))
    counts["dropped"]["val"].pop("", None)
    with_query = [i for i, options in enumerate(eligible) if options]
    if len(with_query) < settings.queries:
        raise ConfigError(f"{source.name}'s held-out distributions have {len(with_query)} files with a function that "
                          f"can be a query, {settings.queries} --queries were asked for; ask for at most "
                          f"{len(with_query)}")
    documents = len(held) if settings.documents is None else settings.documents
    if documents > len(held):
        raise ConfigError(f"{source.name}'s held-out distributions have {len(held)} files that parse, {documents} "
                          f"--documents were asked for; ask for at most {len(held)}")
    query_files = [with_query[i] for i in rng.permutation(len(with_query))[: settings.queries]]
    others = sorted(set(range(len(held))) - set(query_files))
    chosen = sorted(query_files + [others[i] for i in rng.permutation(len(others))[: documents - settings.queries]])
    doc_ids = {file: f"d{n}" for n, file in enumerate(chosen)}
    picked = {file: eligible[file][int(rng.integers(len(eligible[file])))] for file in query_files}

    corpus, queries, qrels, short_corpus, short_queries, short_qrels = [], [], [], [], [], []
    for file in chosen:
        path, text, _ = held[file]
        function = picked.get(file)
        if function is None:
            corpus.append({"_id": doc_ids[file], "text": text})
            continue
        document, start, end = without_docstring(text, function)
        depth, end_token, length = token_span(tokenizer, document, start, end)
        query_id = f"q{len(queries)}"
        corpus.append({"_id": doc_ids[file], "text": document})
        queries.append({"_id": query_id, "text": function.query, "doc": doc_ids[file], "depth": depth,
                        "end": end_token, "tokens": length, "function": function.name,
                        "file": os.path.basename(path)})
        qrels.append((query_id, doc_ids[file], 1))
        short_corpus.append({"_id": f"f{len(short_corpus)}", "text": function.code})
        short_qrels.append((query_id, short_corpus[-1]["_id"], 1))
    for query, function, size in zip(queries, short_corpus, map(len, tokenizer.encode_batch(
            [f["text"] for f in short_corpus]))):  # the short check's documents are the functions: whole from token 0
        short_queries.append({**query, "doc": function["_id"], "depth": 0, "end": size, "tokens": size})
    ends = np.array([q["end"] for q in queries])
    counts.update(train_pairs=wanted, queries=len(queries), documents=len(corpus),
                  document_tokens_median=int(np.median([q["tokens"] for q in queries])),
                  function_depth_median=int(np.median([q["depth"] for q in queries])),
                  in_view={length: round(float(np.mean(ends <= length)), 4) for length in IN_VIEW_LENGTHS})
    train_pairs = [pairs[i] for i in rng.permutation(len(pairs))[:wanted]]
    return {"corpus": corpus, "queries": queries, "qrels": qrels, "train_pairs": train_pairs,
            "short_corpus": short_corpus, "short_queries": short_queries, "short_qrels": short_qrels}, counts


def write(rows: dict, out: str, manifest: dict, overwrite: bool = False, inputs: tuple = ()) -> str:
    """The files, staged and swapped in whole (a failed or killed build leaves no half-written set)."""

    def jsonl(path, items):
        with open(path, "w", encoding="utf-8") as f:
            f.writelines(json.dumps(row, ensure_ascii=False) + "\n" for row in items)

    def tsv(path, items):
        with open(path, "w", encoding="utf-8") as f:
            f.write("query-id\tcorpus-id\tscore\n")
            f.writelines(f"{q}\t{d}\t{s}\n" for q, d, s in items)

    check_replaceable(out, WRITER, overwrite, inputs)
    staged = staging_folder(out, WRITER)
    try:
        os.mkdir(os.path.join(staged, "short"))
        for name in ("corpus", "queries", "train_pairs"):
            jsonl(os.path.join(staged, f"{name}.jsonl"), rows[name])
        tsv(os.path.join(staged, "qrels.tsv"), rows["qrels"])
        jsonl(os.path.join(staged, "short", "corpus.jsonl"), rows["short_corpus"])
        jsonl(os.path.join(staged, "short", "queries.jsonl"), rows["short_queries"])
        tsv(os.path.join(staged, "short", "qrels.tsv"), rows["short_qrels"])
        with open(os.path.join(staged, "manifest.json"), "w", encoding="utf-8") as f:
            json.dump(manifest, f, indent=2)
        swap_in(staged, out, WRITER)
    finally:
        shutil.rmtree(staged, ignore_errors=True)
    return out


def make(source, tokenizer, tokenizer_spec: str, settings: CodeSettings, out: str, overwrite: bool = False,
         inputs: tuple = ()) -> dict:
    """Build, write and describe the set; returns its manifest."""
    rows, counts = build(source, tokenizer, settings)
    manifest = {"format": FORMAT, "kind": KIND, "source": source.describe(), "tokenizer": tokenizer_spec,
                "tokenizer_identity": tokenizer.identity, **asdict(settings), "counts": counts}
    write(rows, out, manifest, overwrite, inputs)
    return manifest


def summary(out: str, manifest: dict) -> str:
    counts = manifest["counts"]
    files = counts["files"]
    shares = ", ".join(f"{length}: {100 * share:.0f}%" for length, share in counts["in_view"].items())
    return (f"wrote {out}: {counts['train_pairs']} training pairs (of {counts['functions']['train']['pairs']} after "
            f"filters and de-duplication, from {counts['functions']['train']['documented']} documented functions in "
            f"{files['train']['parsed']} training files; {files['train']['not_parsed']} did not parse), "
            f"{counts['queries']} queries against {counts['documents']} held-out files (median "
            f"{counts['document_tokens_median']} tokens, function at token {counts['function_depth_median']}; "
            f"{files['val']['not_parsed']} did not parse, {files['val']['comments_only']} held comments alone); whole "
            f"function in view at {shares}")
