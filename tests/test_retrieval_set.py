"""The offline long-document retrieval set: each query's passage sits where its row says (so truncating a document
at a length hides or shows it as recorded), queries never appear verbatim, fillers never repeat, the training pairs
come from other source documents, and the same settings give the same files."""

import json
import os
import shutil

import pytest

from cable_lightning.data.retrieval_set import Settings, build, main, passages
from cable_lightning.data.tokenizers import get_tokenizer

DOC_TOKENS = 256


@pytest.fixture(scope="module")
def made(tiny_corpus_docs, tiny_corpus_dir):
    _, documents = tiny_corpus_docs
    tokenizer = get_tokenizer(os.path.join(tiny_corpus_dir, "tokenizer.json"))
    settings = Settings(doc_tokens=DOC_TOKENS, queries=30, train_pairs=40, seed=3)
    return documents, tokenizer, settings, build(documents, tokenizer, settings)


def test_each_passage_lies_between_its_recorded_depth_and_end_inside_the_document(made):
    documents, tokenizer, settings, rows = made
    keys = {p.query: p for p in passages(documents) if p.query is not None}
    docs = {d["_id"]: d["text"] for d in rows["corpus"]}
    assert len(rows["queries"]) == settings.queries and {q for q, _, _ in rows["qrels"]} == {
        q["_id"] for q in rows["queries"]}
    for query in rows["queries"]:
        rest = keys[query["text"]].rest
        ids = tokenizer.encode_batch([docs[query["doc"]]])[0]
        assert 0 <= query["depth"] < query["end"] <= DOC_TOKENS
        shown, hidden = tokenizer.decode(ids[: query["end"]]), tokenizer.decode(ids[: query["depth"]])
        assert rest[-20:] in shown, "a window of `end` tokens holds the whole passage"
        assert rest[:40] not in hidden, "a window of `depth` tokens holds none of it"
    depths = [q["depth"] for q in rows["queries"]]
    assert min(depths) < DOC_TOKENS // 4 and max(depths) > DOC_TOKENS // 2, depths  # spread over the document


def test_queries_are_not_in_any_document_and_fillers_are_used_once(made):
    _, _, _, rows = made
    texts = [d["text"] for d in rows["corpus"]]
    for query in rows["queries"]:
        assert not any(query["text"] in text for text in texts)
    paragraphs = [p for text in texts for p in text.split("\n\n") if len(p) > 80]
    assert len(paragraphs) == len(set(paragraphs))


def test_training_pairs_come_from_other_source_documents(made):
    documents, _, _, rows = made
    evaluation_text = "\n".join(d["text"] for d in rows["corpus"])
    assert len(rows["train_pairs"]) == 40
    for pair in rows["train_pairs"]:
        assert pair["positive"] not in evaluation_text and pair["positive"] != pair["negative"]
    query_sources = {p.source_doc for p in passages(documents) if p.query in {q["text"] for q in rows["queries"]}}
    pair_sources = {p.source_doc for p in passages(documents) if p.query in {r["query"] for r in rows["train_pairs"]}}
    assert query_sources and pair_sources and not query_sources & pair_sources


def test_query_in_passage_puts_each_query_at_the_head_of_its_passage_and_nowhere_else(made):
    documents, tokenizer, settings, _ = made
    rows = build(documents, tokenizer, Settings(**{**settings.__dict__, "query_in_passage": True}))
    keys = {p.query: p for p in passages(documents) if p.query is not None}
    docs = {d["_id"]: d["text"] for d in rows["corpus"]}
    for query in rows["queries"]:
        ids = tokenizer.encode_batch([docs[query["doc"]]])[0]
        shown, hidden = tokenizer.decode(ids[: query["end"]]), tokenizer.decode(ids[: query["depth"]])
        assert f"{query['text']} {keys[query['text']].rest}" in docs[query["doc"]]
        assert query["text"][:40] not in hidden and keys[query["text"]].rest[-20:] in shown
        assert [d for d, text in docs.items() if query["text"] in text] == [query["doc"]]
    for pair in rows["train_pairs"]:
        assert pair["positive"] == f"{pair['query']} {keys[pair['query']].rest}"


def test_a_negative_is_never_its_positive_and_too_few_pairs_is_an_error_naming_the_count(made):
    """A small training part (seed 3, eval_fraction 0.9: 13 key passages) holds paragraphs the corpus repeats: a pair
    drew a copy of its positive as its negative; 20 pairs asked for gave 13; one key passage was its own negative."""
    documents, tokenizer, _, _ = made
    small = Settings(doc_tokens=DOC_TOKENS, queries=5, eval_fraction=0.9, seed=3, query_in_passage=True)
    for train_pairs in (13, None):  # None: one per key passage
        pairs = build(documents, tokenizer, Settings(**{**small.__dict__, "train_pairs": train_pairs}))["train_pairs"]
        assert len(pairs) == 13 and all(pair["positive"] != pair["negative"] for pair in pairs)
    with pytest.raises(ValueError, match=r"^the source has 13 key passages outside the evaluation documents \(one "
                                         r"training pair each\), 20 --train_pairs were asked for; ask for fewer"):
        build(documents, tokenizer, Settings(**{**small.__dict__, "train_pairs": 20}))
    with pytest.raises(ValueError, match=r"^the source has 1 key passages outside the evaluation documents, all with "
                                         "one text, and a training pair's negative must be another"):
        build(documents, tokenizer, Settings(**{**small.__dict__, "eval_fraction": 0.97, "seed": 2}))


def test_the_same_settings_give_the_same_set_and_another_seed_another(made):
    documents, tokenizer, settings, rows = made
    assert build(documents, tokenizer, settings) == rows
    other = build(documents, tokenizer, Settings(**{**settings.__dict__, "seed": 4}))
    assert other["queries"] != rows["queries"]


def test_too_small_a_source_is_one_error_naming_what_fits(made):
    documents, tokenizer, _, _ = made
    with pytest.raises(ValueError, match=r"filler text for \d+ documents of 4096 tokens, 100 were asked for"):
        build(documents, tokenizer, Settings(doc_tokens=4096, queries=100))
    with pytest.raises(ValueError, match=r"the source has \d+ key passages that fit documents of 256 tokens, 5000 "):
        build(documents, tokenizer, Settings(doc_tokens=256, queries=5000))
    with pytest.raises(ValueError, match="eval_fraction must be in"):
        Settings(eval_fraction=1.5)


def test_the_command_writes_a_beir_set_the_retrieval_tool_reads(tiny_corpus_docs, tiny_corpus_dir, tmp_path):
    from cable_lightning.hf import retrieval

    jsonl, _ = tiny_corpus_docs
    tokenizer = os.path.join(tiny_corpus_dir, "tokenizer.json")
    out = tmp_path / "set"
    argv = ["--source", jsonl, "--tokenizer", tokenizer, "--out", str(out), "--doc_tokens", str(DOC_TOKENS),
            "--queries", "10", "--train_pairs", "5"]
    main(argv)
    docs, questions, relevant = retrieval.read_beir(str(out / "corpus.jsonl"), str(out / "queries.jsonl"),
                                          str(out / "qrels.tsv"))
    assert len(docs) == len(questions) == len(relevant) == 10
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["counts"] == {"corpus": 10, "queries": 10, "train_pairs": 5}
    assert manifest["doc_tokens"] == DOC_TOKENS
    with pytest.raises(FileExistsError, match="pass --overwrite"):
        main(argv)
    main([*argv, "--overwrite"])  # its own folder: replaced
    inputs = tmp_path / "inputs"
    inputs.mkdir()
    shutil.copy(tokenizer, inputs / "tokenizer.json")
    with pytest.raises(FileExistsError, match="holds this command's input"):  # an overwrite never takes an input
        main([*argv[:2], "--tokenizer", str(inputs / "tokenizer.json"), "--out", str(inputs), *argv[6:],
              "--overwrite"])
    assert (inputs / "tokenizer.json").exists()
