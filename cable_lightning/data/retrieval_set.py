"""A long-document retrieval set made offline, where the evaluation length decides what an encoder can see (MLDR's
situation: the passage a query asks about may lie deep in a long document).

How it is made, from any text source (default: the offline python-docs corpus) and the run's own tokenizer:

- Source documents are split into paragraphs. A prose paragraph with a first sentence of 6-40 words and at least
  12 more words (and at most half a document's tokens) is a *key passage*: its first sentence becomes a query, the
  rest of the paragraph goes into a document. The query's own words are not in the document: what links them is
  that they were written one after the other about one thing (the same function, the same concept), so a match
  needs the content, not a copied sentence.
- Each document is ``doc_tokens`` tokens of *filler* paragraphs (prose, code, tables) drawn from other source
  documents (each used once, so no filler links two documents), with one key passage's rest placed at a depth
  drawn uniformly from where it fits. A window of W tokens therefore holds the passage a query asks about for
  about W / doc_tokens of the queries: at the training length it is mostly hidden, at 16x it is always in view, and
  what else the window holds is unrelated text, so an encoder must find one passage's signal among many.
- Source documents are split in two by a seeded draw: the evaluation set uses one part; the contrastive training
  pairs (``train_pairs.jsonl``: a query, its passage's rest as the positive, another passage's rest as the negative,
  never the positive's own text, which a repeated paragraph would give) come from the other part, so no evaluation
  text is trained on in the fine-tuning step. One pair per key passage there (``--train_pairs``: that many of them;
  more than there are is an error naming the count).
- ``--query_in_passage`` keeps the query's sentence at the head of its passage (in the documents and in the training
  positives): query and passage then share words, the easy, lexical form of the set (BM25 finds it wherever it is in
  view), for telling an encoder that cannot retrieve at all from one that cannot see far enough.

Written in the BEIR layout the ``retrieval evaluate`` verb reads: ``corpus.jsonl`` (``_id``, ``text``),
``queries.jsonl`` (``_id``, ``text``, plus ``depth`` and ``end``: the token offsets where its passage starts and
ends, and ``doc``),
``qrels.tsv``; and ``manifest.json`` with the settings, the tokenizer and the counts. The same settings, source and
tokenizer give the same files. A lexical baseline (BM25 on the same set, truncated to each length) comes with
``python -m cable_lightning retrieval evaluate --bm25``: lexical overlap helps where the passage shares rare words
with its first sentence, and cannot help at all where the window hides the passage.

    python -m cable_lightning retrieval-set --tokenizer data/pydocs-bpe4096/tokenizer.json --doc_tokens 1024 \
        --queries 200 --out data/retrieval-1024
"""

from __future__ import annotations

import json
import os
import re
import shutil
from dataclasses import asdict, dataclass
from typing import Optional

import numpy as np

from ..errors import ArgumentParser, ConfigError
from ..owned import check_replaceable, staging_folder, swap_in

FORMAT = 1
SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=[A-Z`'\"(])")


@dataclass(frozen=True)
class Passage:
    source_doc: int  # which source document it came from (the train/evaluation split is by source document)
    text: str
    query: str | None  # its first sentence, when it qualifies as a key passage
    rest: str | None  # the paragraph without that sentence


def prose(paragraph: str) -> bool:
    """Running text, not code, a table or a signature list: mostly letters, no interpreter prompts."""
    letters = sum(c.isalpha() or c.isspace() for c in paragraph)
    return ">>>" not in paragraph and letters >= 0.85 * len(paragraph)


def passages(documents, min_words: int = 12) -> list[Passage]:
    """Every paragraph of every document, in order (code and tables included: they serve as filler); prose
    paragraphs that qualify as key passages carry their query and rest."""
    out = []
    for index, document in enumerate(documents):
        for paragraph in re.split(r"\n\s*\n", document):
            text = paragraph.strip()
            if not text:
                continue
            first, rest = (SENTENCE_END.split(" ".join(text.split()), maxsplit=1) + [""])[:2]
            key = prose(text) and 6 <= len(first.split()) <= 40 and len(rest.split()) >= min_words
            out.append(Passage(index, text, first if key else None, rest if key else None))
    return out


@dataclass(frozen=True)
class Settings:
    doc_tokens: int = 1024  # 16x the encoder config's 64-token training length
    queries: int = 200
    train_pairs: Optional[int] = None  # None: one per key passage outside the evaluation documents
    eval_fraction: float = 0.7  # of the source documents, by a seeded draw
    seed: int = 0
    query_in_passage: bool = False  # the query's own sentence stays at the head of its passage

    def __post_init__(self):
        if self.doc_tokens < 64:
            raise ConfigError(f"doc_tokens must be >= 64, got {self.doc_tokens}")
        if self.queries < 1 or (self.train_pairs or 0) < 0:
            raise ConfigError(f"need queries >= 1 and train_pairs >= 0, got {self.queries} and {self.train_pairs}")
        if not 0 < self.eval_fraction < 1:
            raise ConfigError(f"eval_fraction must be in (0, 1), got {self.eval_fraction}")


def build(documents: list[str], tokenizer, settings: Settings) -> dict:
    """The set as rows: ``{"corpus", "queries", "qrels", "train_pairs"}`` (see the module docstring)."""

    def placed(key: Passage) -> str:
        """What of a key passage goes into its document and its training positive."""
        return f"{key.query} {key.rest}" if settings.query_in_passage else key.rest

    rng = np.random.default_rng(settings.seed)
    found = passages(documents)
    evaluation = rng.random(len(documents)) < settings.eval_fraction
    held = [p for p in found if evaluation[p.source_doc]]
    trained = [p for p in found if not evaluation[p.source_doc]]
    train_keys = [p for p in trained if p.query is not None]  # the training pairs: checked before any document is made
    wanted = len(train_keys) if settings.train_pairs is None else settings.train_pairs
    if wanted > len(train_keys):
        raise ConfigError(f"the source has {len(train_keys)} key passages outside the evaluation documents (one "
                          f"training pair each), {wanted} --train_pairs were asked for; ask for fewer --train_pairs or "
                          "a smaller --eval_fraction, or use a larger source")
    texts = [placed(p) for p in train_keys]
    if wanted and len(set(texts)) < 2:
        raise ConfigError(f"the source has {len(train_keys)} key passages outside the evaluation documents, all with "
                          "one text, and a training pair's negative must be another; ask for --train_pairs 0 or a "
                          "smaller --eval_fraction, or use a larger source")
    candidates = [p for p in held if p.query is not None]
    placed_lengths = dict(zip(map(id, candidates), map(len, tokenizer.encode_batch([placed(p) for p in candidates]))))
    # A key passage takes at most half a document, so it always fits with room to place it at many depths.
    keys = [candidates[i] for i in rng.permutation(len(candidates))
            if placed_lengths[id(candidates[i])] <= settings.doc_tokens // 2][: settings.queries]
    if len(keys) < settings.queries:
        raise ConfigError(f"the source has {len(keys)} key passages that fit documents of {settings.doc_tokens} "
                          f"tokens, {settings.queries} queries were asked for; ask for fewer --queries or a larger "
                          "--eval_fraction, or use a larger source")
    key_ids = {id(p) for p in keys}
    lengths = dict(zip((id(p) for p in held), map(len, tokenizer.encode_batch([p.text + "\n\n" for p in held]))))
    longest = settings.doc_tokens // 8  # fillers stay short, so a document overshoots doc_tokens by at most this
    fillers = [held[i] for i in rng.permutation(len(held))
               if id(held[i]) not in key_ids and lengths[id(held[i])] <= longest]

    corpus, queries, qrels = [], [], []
    next_filler = 0
    for number, key in enumerate(keys):
        # The passage lies within the first doc_tokens tokens: "before" overshoots its target by one filler at most
        # (and tokens merge differently across paragraph joins: a margin of 1/32).
        room = settings.doc_tokens - placed_lengths[id(key)] - longest - settings.doc_tokens // 32
        target_depth = int(rng.integers(0, room + 1))
        before, after, size, before_size = [], [], placed_lengths[id(key)], 0
        while size < settings.doc_tokens:
            if next_filler == len(fillers):
                raise ConfigError(f"the source has filler text for {number} documents of {settings.doc_tokens} "
                                  f"tokens, {settings.queries} were asked for; ask for fewer --queries, shorter "
                                  "--doc_tokens or a larger --eval_fraction, or use a larger source")
            filler = fillers[next_filler]
            next_filler += 1
            if before_size < target_depth:
                before.append(filler)
                before_size += lengths[id(filler)]
            else:
                after.append(filler)
            size += lengths[id(filler)]
        prefix = "\n\n".join(p.text for p in before)
        text = "\n\n".join([*(p.text for p in before), placed(key), *(p.text for p in after)])
        depth = len(tokenizer.encode_batch([prefix + "\n\n"])[0]) if before else 0
        end = len(tokenizer.encode_batch([prefix + "\n\n" + placed(key) if before else placed(key)])[0])
        doc_id, query_id = f"d{number}", f"q{number}"
        corpus.append({"_id": doc_id, "text": text})
        queries.append({"_id": query_id, "text": key.query, "depth": depth, "end": end, "doc": doc_id})
        qrels.append((query_id, doc_id, 1))

    pairs = []
    for i in rng.permutation(len(train_keys))[:wanted]:
        negative = int(rng.integers(0, len(train_keys)))
        while texts[negative] == texts[i]:  # itself, or a repeated paragraph: the pair would contradict itself
            negative = int(rng.integers(0, len(train_keys)))
        pairs.append({"query": train_keys[i].query, "positive": texts[i], "negative": texts[negative]})
    return {"corpus": corpus, "queries": queries, "qrels": qrels, "train_pairs": pairs}


def write(rows: dict, out: str, manifest: dict, overwrite: bool = False, inputs: tuple = ()) -> str:
    """The files, staged and swapped in whole: a failed or killed build leaves no half-written set."""
    check_replaceable(out, "retrieval set", overwrite, inputs)
    staged = staging_folder(out, "retrieval set")
    try:
        for name in ("corpus", "queries", "train_pairs"):
            with open(os.path.join(staged, f"{name}.jsonl"), "w", encoding="utf-8") as f:
                f.writelines(json.dumps(row, ensure_ascii=False) + "\n" for row in rows[name])
        with open(os.path.join(staged, "qrels.tsv"), "w", encoding="utf-8") as f:
            f.write("query-id\tcorpus-id\tscore\n")
            f.writelines(f"{q}\t{d}\t{s}\n" for q, d, s in rows["qrels"])
        with open(os.path.join(staged, "manifest.json"), "w", encoding="utf-8") as f:
            json.dump(manifest, f, indent=2)
        swap_in(staged, out, "retrieval set")
    finally:
        shutil.rmtree(staged, ignore_errors=True)
    return out


def main(argv: list[str] | None = None) -> None:
    from . import code_retrieval
    from .sources import VALID_SOURCES, get_source
    from .tokenizers import get_tokenizer

    defaults = Settings()
    parser = ArgumentParser(prog="python -m cable_lightning retrieval-set",
                            description=__doc__.split("\n\n")[0] + " With --source python-code[:NAME,...]: a "
                            "long-file code retrieval set (cable_lightning/data/code_retrieval.py).")
    parser.add_argument("--source", default="python-docs", help=f"the text: {VALID_SOURCES}")
    parser.add_argument("--tokenizer", required=True,
                        help="the run's tokenizer (a prepared folder's tokenizer.json, gpt2, bert-base-uncased)")
    parser.add_argument("--out", required=True)
    parser.add_argument("--doc_tokens", type=int,
                        help=f"each document's length in tokens (default {defaults.doc_tokens}; 16x the training "
                        "length evaluates it whole; not for python-code, whose documents are whole files)")
    parser.add_argument("--queries", type=int, default=defaults.queries, help="queries (prose: = documents)")
    parser.add_argument("--documents", type=int, help="python-code only: held-out files in the corpus, every query's "
                        "file and distractors (default: every held-out file that parses)")
    parser.add_argument("--train_pairs", type=int, default=defaults.train_pairs,
                        help="contrastive training pairs (default: every one the source gives)")
    parser.add_argument("--eval_fraction", type=float, help=f"prose only (default {defaults.eval_fraction}); "
                        "python-code's evaluation is its held-out distributions")
    parser.add_argument("--seed", type=int, default=defaults.seed)
    parser.add_argument("--query_in_passage", action="store_true",
                        help="prose only: keep each query's sentence at the head of its passage")
    parser.add_argument("--overwrite", action="store_true", help="replace a retrieval set this command wrote")
    args = parser.parse_args(argv)
    code = args.source.partition(":")[0] == "python-code"
    prose_only = [flag for flag, value in (("--doc_tokens", args.doc_tokens), ("--eval_fraction", args.eval_fraction),
                                           ("--query_in_passage", args.query_in_passage or None)) if value is not None]
    if code and prose_only:
        parser.error(f"{', '.join(prose_only)}: not for --source python-code, whose documents are whole held-out "
                     "files; valid there: --queries, --documents, --train_pairs, --seed")
    if not code and args.documents is not None:
        parser.error("--documents is for --source python-code; a prose set has one document per query")
    if code:
        settings = code_retrieval.CodeSettings(args.queries, args.documents, args.train_pairs, args.seed)
    else:
        settings = Settings(args.doc_tokens or defaults.doc_tokens, args.queries, args.train_pairs,
                            args.eval_fraction or defaults.eval_fraction, args.seed, args.query_in_passage)
    inputs = (args.tokenizer if os.path.exists(args.tokenizer) else None, args.source)
    check_replaceable(args.out, "retrieval set", args.overwrite, inputs)  # before reading the source
    tokenizer = get_tokenizer(args.tokenizer)
    try:  # the sources' own errors about the source (unknown, missing, unreadable): one line, as prepare's
        source = get_source(args.source)
        documents = None if code else list(source.documents())
    except (ValueError, OSError) as exc:
        raise ConfigError(f"--source {args.source}: {exc}") from exc
    if code:
        manifest = code_retrieval.make(source, tokenizer, args.tokenizer, settings, args.out, args.overwrite, inputs)
        print(code_retrieval.summary(args.out, manifest))
        return
    rows = build(documents, tokenizer, settings)
    manifest = {"format": FORMAT, "kind": "retrieval set", "source": source.describe(),
                "tokenizer": args.tokenizer, **asdict(settings),
                "counts": {name: len(rows[name]) for name in ("corpus", "queries", "train_pairs")}}
    write(rows, args.out, manifest, args.overwrite, inputs)
    depths = np.array([q["depth"] for q in rows["queries"]])
    print(f"wrote {args.out}: {len(rows['corpus'])} documents of about {settings.doc_tokens} tokens, "
          f"{len(rows['queries'])} queries (passage depth median {int(np.median(depths))} tokens), "
          f"{len(rows['train_pairs'])} training pairs")


if __name__ == "__main__":  # an entry point once: say which verb replaced it, never exit 0 having done nothing
    from cable_lightning.verbs import replaced_entry_point

    replaced_entry_point(__spec__.name)
