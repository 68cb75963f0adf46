"""Retrieval with an exported encoder (the paper's Table 3): sentence-transformers fine-tuning, nDCG@10 by length.

    # (b) fine-tune with MultipleNegativesRankingLoss on (query, positive, negative) triples: MS MARCO with mined
    #     hard negatives from the hub, or any local jsonl of {"query", "positive", "negative"} rows
    python -m cable_lightning retrieval finetune --model exports/bert-cable --triples msmarco \
        --out exports/bert-cable-msmarco --max_seq_length 512 --batch_size 32 --max_steps 20000 --trust_remote_code
    # (c) nDCG@10 (and, on a local set, MRR@10 and Recall@100) at several maximum input lengths: MLDR (English)
    #     through MTEB, or a local BEIR-style set
    python -m cable_lightning retrieval evaluate --models cable=exports/bert-cable-msmarco \
        alibi=exports/bert-alibi-msmarco --lengths 512 1024 2048 4096 8192 --mldr --out results/mldr --trust_remote_code
    python -m cable_lightning retrieval evaluate --models cable=DIR --lengths 128 512 --corpus corpus.jsonl \
        --queries queries.jsonl --qrels qrels.tsv --out results/local --trust_remote_code

(a) An export is a sentence-transformers model as is: transformers' ``AutoModel`` (the folder's own code) under
mean pooling over the real tokens; ``max_seq_length`` truncates every input to the length being evaluated.
A fine-tuned model is saved as an export again (the input folder with the new ``model.safetensors``).
Local sets use the BEIR layout: ``corpus.jsonl`` and ``queries.jsonl`` rows ``{"_id", "text"}`` (corpus rows may
have a ``title``), ``qrels.tsv`` with a header and ``query-id<TAB>corpus-id<TAB>score`` rows; a query row's
``end`` (where its passage or function ends, in tokens: ``retrieval-set`` writes it) adds an "in view" column, the
share of queries whose passage lies within the length. Writes ``<out>/table.md`` (nDCG@10, then MRR@10 and
Recall@100, x 100), ``table.csv`` (rows: length, columns: model, nDCG@10 x 100) and ``metrics.csv`` (every value),
and prints the tables. Training rows without a ``negative`` (the code set's) train on in-batch negatives alone;
``--mini_batch_size`` uses CachedMultipleNegativesRankingLoss, the same loss for a batch too large to run at once.
"""

from __future__ import annotations

import csv
import json
import os
import shutil

from cable_lightning.errors import ArgumentParser, ConfigError, MissingFileError
from cable_lightning.eval.tables import markdown_table, write_markdown
from cable_lightning.owned import check_replaceable, discard, staging_folder, swap_in
from cable_lightning.records.io import append_records, content_hash, read_jsonl, read_records, write_records
from cable_lightning.records.schema import LossPoint, RetrievalRecord

MSMARCO = ("sentence-transformers/msmarco-msmarco-distilbert-base-tas-b", "triplet-hard")  # 11.6M mined triples
MLDR = "MultiLongDocRetrieval"
WEIGHTS = "model.safetensors"


def encoder(folder: str, max_seq_length: int, device: str | None = None, trust_remote_code: bool = False):
    """An exported encoder as a sentence-transformers model: the folder's AutoModel, then mean pooling. An export
    runs its own code (``modeling_cable.py``): that needs ``trust_remote_code``."""
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.modules import Pooling, Transformer

    from cable_lightning.hf.export import check_remote_code

    check_remote_code(folder, trust_remote_code)
    trust = {"trust_remote_code": trust_remote_code}
    words = Transformer(folder, max_seq_length=max_seq_length, model_kwargs=trust, config_kwargs=trust,
                        processor_kwargs=trust)
    pooling = Pooling(words.get_embedding_dimension(), pooling_mode="mean")
    return SentenceTransformer(modules=[words, pooling], device=device)


def load_triples(triples: str):
    """``msmarco`` (the hub) or a local jsonl of query/positive(/negative) rows, as a datasets.Dataset: without a
    negative, the other rows' positives in the batch are the only negatives (in-batch negatives)."""
    from datasets import load_dataset

    if triples == "msmarco":
        try:
            return load_dataset(*MSMARCO, split="train")
        except Exception as exc:  # datasets raises several types for "no network"
            raise ConfigError(f"cannot load {MSMARCO[0]} ({MSMARCO[1]}) from the Hugging Face hub "
                             f"({type(exc).__name__}); offline, pass --triples a local jsonl of "
                             "query/positive/negative rows")
    if not os.path.isfile(triples):
        raise ConfigError(f"--triples {triples!r} is neither 'msmarco' nor a jsonl file")
    dataset = load_dataset("json", data_files=triples, split="train")
    columns = ["query", "positive", "negative"][: 3 if "negative" in dataset.column_names else 2]
    if dataset.column_names[: len(columns)] != columns:
        raise ConfigError(f"{triples} has columns {dataset.column_names}; valid: query, positive (and negative)")
    return dataset.select_columns(columns)


def finetune(model: str, triples: str, out: str, max_seq_length: int = 512, batch_size: int = 32,
             max_steps: int = 1000, lr: float = 2e-5, warmup_ratio: float = 0.1, seed: int = 42,
             trust_remote_code: bool = False, overwrite: bool = False, mini_batch_size: int | None = None) -> str:
    """Fine-tune an exported encoder with MultipleNegativesRankingLoss (in-batch and, where the rows have them, hard
    negatives; with ``mini_batch_size``, its cached form, CachedMultipleNegativesRankingLoss: the same loss over the
    whole batch, computed in mini-batches of that size, for a batch whose activations would not fit); save the result
    as an export (the input folder's files with the new weights, its provenance with the fine-tuning's settings:
    :func:`tuned_provenance`) at ``out``, which may replace only an export (``overwrite``) that holds neither input,
    swapped in by rename. An ``out`` that already is this fine-tuning (:func:`finetuned_already`) is said in one line
    and kept."""
    if mini_batch_size is not None and not 0 < mini_batch_size <= batch_size:
        raise ConfigError(f"--mini_batch_size must be from 1 to --batch_size ({batch_size}), got {mini_batch_size}")
    if not os.path.isdir(model):  # transformers would take it for a hub id and fail in a traceback
        raise MissingFileError(f"--model {model} is not a folder; give an encoder folder written by "
                               "`python -m cable_lightning export`")
    import tempfile

    from safetensors.torch import save_file
    from sentence_transformers import SentenceTransformerTrainer, SentenceTransformerTrainingArguments
    from sentence_transformers.base.sampler import BatchSamplers
    from sentence_transformers.sentence_transformer.losses import (
        CachedMultipleNegativesRankingLoss,
        MultipleNegativesRankingLoss,
    )

    if os.path.isfile(triples) or triples == "msmarco":  # a missing file is load_triples' error
        settings = finetune_settings(triples, max_seq_length, batch_size, max_steps, lr, warmup_ratio, seed,
                                     mini_batch_size)
        if done := finetuned_already(model, out, settings):
            print(done)
            return out
    check_replaceable(out, "export", overwrite, (model, triples))  # before any work
    st_model = encoder(model, max_seq_length, trust_remote_code=trust_remote_code)
    dataset = load_triples(triples)
    with tempfile.TemporaryDirectory() as scratch:
        args = SentenceTransformerTrainingArguments(
            output_dir=scratch, max_steps=max_steps, per_device_train_batch_size=batch_size, learning_rate=lr,
            warmup_steps=warmup_ratio, seed=seed, save_strategy="no", report_to=[],  # a float below 1: a ratio
            logging_steps=max(1, max_steps // 20),
            batch_sampler=BatchSamplers.NO_DUPLICATES, use_cpu=not _cuda())
        trainer = SentenceTransformerTrainer(model=st_model, args=args, train_dataset=dataset,
                                             loss=MultipleNegativesRankingLoss(st_model) if mini_batch_size is None
                                             else CachedMultipleNegativesRankingLoss(st_model, mini_batch_size))
        trainer.train()
    weights = {k: v.detach().contiguous().cpu() for k, v in st_model[0].auto_model.state_dict().items()}
    staged = staging_folder(out, "export")
    try:
        shutil.copytree(model, staged, dirs_exist_ok=True)
        save_file(weights, os.path.join(staged, WEIGHTS), metadata={"format": "pt"})
        config_path = os.path.join(staged, "config.json")
        with open(config_path, encoding="utf-8") as f:
            config = json.load(f)
        config["provenance"] = tuned_provenance(config, settings)  # what the rows measured on it record
        with open(config_path, "w", encoding="utf-8") as f:
            json.dump(config, f, indent=2, sort_keys=True)
        write_records(os.path.join(staged, LossPoint.FILE),  # the contrastive loss curve
                      [LossPoint(step=row["step"], loss=row["loss"]) for row in trainer.state.log_history
                       if "loss" in row])
        swap_in(staged, out, "export")
    finally:
        discard(staged)
    print(f"saved {out}")
    return out


def finetune_settings(triples: str, max_seq_length: int, batch_size: int, max_steps: int, lr: float,
                      warmup_ratio: float, seed: int, mini_batch_size: int | None) -> dict:
    """What defines a fine-tuning besides the export it starts from, as a tuned export's ``config.json`` keeps it
    (``provenance["finetune"]``) and its retrieval rows record it (:attr:`RetrievalRecord.finetune`): the settings,
    and the triples' content hash (``msmarco``: the hub's set)."""
    return {"max_steps": max_steps, "batch_size": batch_size, "lr": lr, "warmup_ratio": warmup_ratio, "seed": seed,
            "max_seq_length": max_seq_length, "mini_batch_size": mini_batch_size,
            "triples": triples if triples == "msmarco" else content_hash([triples])[:16]}


def tuned_provenance(config: dict, settings: dict) -> dict:
    """A tuned export's provenance: its input's (the pre-trained run's identity) with the fine-tuning's settings."""
    return {**(config.get("provenance") or {}), "finetune": settings}


def finetuned_already(model: str, out: str, settings: dict) -> str | None:
    """The line ``retrieval finetune`` says instead of training when ``out`` is a complete tuned export (its weights
    and loss curve are there: it is swapped in whole) of ``model``'s run with these settings (its provenance is
    :func:`tuned_provenance`'s); None otherwise."""
    from cable_lightning.hf.export import read_export_config

    if not all(os.path.isfile(os.path.join(out, name)) for name in (WEIGHTS, LossPoint.FILE)):
        return None
    try:
        done, start = read_export_config(out), read_export_config(model)
    except (ConfigError, MissingFileError):
        return None
    if done.get("provenance") != tuned_provenance(start, settings):
        return None
    return f"{out} is {model} fine-tuned with these settings: already done; nothing to do"


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def read_beir(corpus: str, queries: str, qrels: str) -> tuple[dict, dict, dict]:
    docs = {str(r["_id"]): (r.get("title", "") + " " + r["text"]).strip() for r in read_jsonl(corpus, ("_id", "text"))}
    questions = {str(r["_id"]): r["text"] for r in read_jsonl(queries, ("_id", "text"))}
    relevant: dict[str, set] = {}
    try:
        with open(qrels, encoding="utf-8") as f:
            rows = list(csv.reader(f, delimiter="\t"))
    except FileNotFoundError:
        raise MissingFileError(f"{qrels} does not exist") from None
    for number, row in enumerate(rows[1:], 2):  # after the header
        try:
            query_id, doc_id, score = row
            score = float(score)
        except ValueError:
            raise ConfigError(f"{qrels}:{number}: {row!r} is not query-id<TAB>corpus-id<TAB>score (columns "
                              "separated by tabs, the score a number); fix that line") from None
        if score > 0:
            relevant.setdefault(query_id, set()).add(doc_id)
    return docs, questions, relevant


def scores_local(st_model, docs: dict, questions: dict, relevant: dict, batch_size: int = 16) -> dict[str, float]:
    """``{"ndcg", "mrr", "recall"}``: nDCG@10, MRR@10 and Recall@100 of the model's cosine ranking."""
    from sentence_transformers.sentence_transformer.evaluation import InformationRetrievalEvaluator

    evaluator = InformationRetrievalEvaluator(questions, docs, relevant, ndcg_at_k=[10], mrr_at_k=[10],
                                              precision_recall_at_k=[100], accuracy_at_k=[1], map_at_k=[10],
                                              name="local", batch_size=batch_size, show_progress_bar=False)
    found = evaluator(st_model)
    return {key: float(found[f"local_cosine_{metric.lower()}"]) for key, metric in RetrievalRecord.METRICS.items()}


def scores_bm25(docs: dict, questions: dict, relevant: dict, length: int, tokenizer) -> dict[str, float]:
    """nDCG@10, MRR@10 and Recall@100 (as :func:`scores_local`) of BM25 (bm25s, English stopwords) over each
    document cut to its first ``length`` tokens of ``tokenizer``, as the encoders see it: the lexical baseline at that
    length, for scale."""
    import bm25s
    import numpy as np

    doc_ids = list(docs)
    cut = [tokenizer.decode(ids[:length]) for ids in tokenizer([docs[i] for i in doc_ids],
                                                                add_special_tokens=False).input_ids]
    retriever = bm25s.BM25()
    retriever.index(bm25s.tokenize(cut, stopwords="en", show_progress=False), show_progress=False)
    query_ids = [q for q in questions if q in relevant]
    words = bm25s.tokenize([questions[q] for q in query_ids], stopwords="en", return_ids=False, show_progress=False)
    scores = np.stack([retriever.get_scores(w) for w in words])
    truth = np.array([[doc in relevant[q] for doc in doc_ids] for q in query_ids], dtype=float)
    shuffled = np.random.default_rng(0).permutation(len(doc_ids))  # ties (no query word in view): a fixed random
    truth, scores = truth[:, shuffled], scores[:, shuffled]        # order, not the corpus's
    ranked = np.take_along_axis(truth, np.argsort(-scores, axis=1, kind="stable"), axis=1)
    gains = 1 / np.log2(np.arange(2, 2 + min(10, len(doc_ids))))
    ideal = np.array([gains[: min(int(count), 10)].sum() for count in truth.sum(axis=1)])
    first = np.where(ranked[:, :10].any(axis=1), ranked[:, :10].argmax(axis=1) + 1, np.inf)
    return {"ndcg": float(np.mean((ranked[:, :10] * gains).sum(axis=1) / ideal)), "mrr": float(np.mean(1 / first)),
            "recall": float(np.mean(ranked[:, :100].sum(axis=1) / truth.sum(axis=1)))}


def ndcg_mldr(st_model, batch_size: int = 16) -> float:
    """nDCG@10 on MLDR's English test split through MTEB (it downloads mteb's copy of the data from the hub)."""
    import mteb

    tasks = mteb.get_tasks(tasks=[MLDR], languages=["eng"], eval_splits=["test"])
    try:
        result = mteb.evaluate(st_model, tasks, cache=None, encode_kwargs={"batch_size": batch_size},
                               show_progress_bar=False)
    except Exception as exc:
        first = (str(exc).strip().splitlines() or [""])[0][:200]
        raise ConfigError(f"MTEB could not run {MLDR} ({type(exc).__name__}: {first}); it needs the Hugging "
                         "Face hub the first time; offline, evaluate a local set with --corpus/--queries/--qrels")
    return float(result.task_results[0].get_score(splits=["test"], getter=lambda scores: scores["ndcg_at_10"]))


def evaluate(models: dict[str, str], lengths: list[int], local: tuple[str, str, str] | None = None,
             batch_size: int = 16, trust_remote_code: bool = False, bm25: bool = False) -> dict[int, dict[str, dict]]:
    """``{length: {model name: {"ndcg", "mrr", "recall"}}}``: each model truncates queries and documents to each
    length (None past the longest a model can serve: a learned table's size); ``bm25`` adds BM25 on the same local
    set, its documents cut with the first model's tokenizer. MLDR gives nDCG@10 only."""
    data = read_beir(*local) if local else None
    scores: dict[int, dict[str, float]] = {length: {} for length in lengths}
    if bm25:
        from transformers import PreTrainedTokenizerFast  # what an export's tokenizer is: no model code runs

        tokenizer = PreTrainedTokenizerFast.from_pretrained(next(iter(models.values())))
        for length in lengths:
            scores[length]["bm25"] = scores_bm25(*data, length, tokenizer)
    for name, folder in models.items():
        longest = longest_length(folder)
        for length in lengths:
            if longest is not None and length > longest:  # a learned table: the paper's dash, not a crash
                print(f"{name} serves at most {longest} tokens: no score at {length}")
                scores[length][name] = None
                continue
            st_model = encoder(folder, length, trust_remote_code=trust_remote_code)
            scores[length][name] = (scores_local(st_model, *data, batch_size=batch_size) if data
                                    else {"ndcg": ndcg_mldr(st_model, batch_size)})
    return scores


def longest_length(folder: str) -> int | None:
    """The longest input the exported encoder's encoding can serve (None: any length)."""
    from cable_lightning.hf.export import read_export_config
    from cable_lightning.lit.checkpoint_format import saved_backbone

    backbone = saved_backbone(read_export_config(folder)["backbone"])
    return backbone.pos_encoding.longest_length(backbone.block_size)


def passage_ends(local: tuple[str, str, str] | None) -> tuple[str, list]:
    """(the set's name, each query's passage end in tokens): ``end`` as ``cable_lightning.data.retrieval_set`` writes
    it in ``queries.jsonl``, None for a set that does not record it (MLDR: no queries read)."""
    if not local:
        return MLDR, []
    ends = [row.get("end") for row in read_jsonl(local[1], ("_id", "text"))]
    folder = os.path.dirname(os.path.abspath(local[0]))
    name = os.path.basename(folder)  # a code set's short-document check is <set>-short
    return (f"{os.path.basename(os.path.dirname(folder))}-short" if name == "short" else name), ends


def set_hash(local: tuple[str, str, str] | None) -> str | None:
    """A local set's content hash (:func:`content_hash` of its corpus, queries and qrels), which names the set in
    its rows whatever its folder is called; None for MLDR."""
    return content_hash(local) if local else None


def retrieval_records(folder: str, scores: dict[int, dict | None], dataset: str, ends: list,
                      dataset_hash: str | None = None) -> list:
    """One :class:`RetrievalRecord` per length for the export ``folder``: its encoding and training length from its
    config, the run it came from as its length records name it (``provenance``: the checkpoint's step and path, the
    run's seed, learning rate, corpus hash, recipe and settings) and the fine-tuning it had (``provenance``'s
    ``finetune``), the set's name and content hash, and where the set records where its passages end
    (:func:`passage_ends`), the share of queries whose passage fits the length."""
    from cable_lightning.hf.export import read_export_config
    from cable_lightning.lit.checkpoint_format import saved_backbone

    config = read_export_config(folder)
    provenance = config.get("provenance") or {}
    backbone = saved_backbone(config["backbone"])
    return [RetrievalRecord(pe=backbone.label(), model=backbone.shape(),
                            train_length=config["max_position_embeddings"], step=provenance.get("step") or 0,
                            run_seed=provenance.get("run_seed"), checkpoint=provenance.get("checkpoint"),
                            lr=provenance.get("lr"), corpus_hash=provenance.get("corpus_hash"),
                            recipe=provenance.get("recipe"), settings=provenance.get("settings"),
                            finetune=provenance.get("finetune"), dataset=dataset, dataset_hash=dataset_hash,
                            length=length, ndcg=found["ndcg"], mrr=found.get("mrr"), recall=found.get("recall"),
                            queries=len(ends), visible=in_view(ends, length))
            for length, found in scores.items() if found is not None]


def evaluated_already(models: dict[str, str], lengths: list[int], records: str, dataset: str, ends: list,
                      dataset_hash: str | None) -> tuple[str | None, set]:
    """What ``<records>/retrieval.jsonl`` already holds of this evaluation (:meth:`RetrievalRecord.evaluation`: the
    same run, fine-tuning, set content and length), and the line to say instead of evaluating when it holds every
    row the evaluation would write (each model at each length it can serve), else None."""
    path = os.path.join(records, RetrievalRecord.FILE)
    written = {r.evaluation() for r in read_records(path, RetrievalRecord)} if os.path.isfile(path) else set()
    planned = []
    for folder in models.values():
        longest = longest_length(folder)  # past it, evaluate writes no row
        served = {length: {"ndcg": 0.0} for length in lengths if longest is None or length <= longest}
        planned += retrieval_records(folder, served, dataset, ends, dataset_hash)
    if not planned or any(record.evaluation() not in written for record in planned):
        return None, written
    return (f"{path} holds {', '.join(models)} on {dataset} at {' '.join(map(str, lengths))}: already done; nothing "
            "to do"), written


def in_view(ends: list, length: int) -> float | None:
    """The share of queries whose passage (or function) ends within ``length`` tokens; None where the set does not
    record where they end."""
    return sum(end <= length for end in ends) / len(ends) if ends and None not in ends else None


def cell(value: float | None) -> str:
    """A metric x 100, or "-" where the model cannot serve the length (or the set does not give the metric)."""
    return "-" if value is None else f"{100 * value:.2f}"


def write_table(scores: dict[int, dict[str, dict | None]], out: str, ends: list = ()) -> str:
    """The paper's Table 3 layout: rows length, columns model, nDCG@10 x 100, best per row in bold (``table.csv``),
    then the same for MRR@10 and Recall@100 where measured; with ``ends`` (where each query's passage ends, in
    tokens), an "in view" column: the share of queries whose passage lies within the length. ``metrics.csv`` has
    every value, one row per length and model."""
    os.makedirs(out, exist_ok=True)
    names = list(next(iter(scores.values())))
    shares = {length: in_view(list(ends), length) for length in scores}
    view = [] if None in shares.values() else ["in view"]

    def value(row, name, metric):
        return None if row[name] is None else row[name].get(metric)

    with open(os.path.join(out, "table.csv"), "w", newline="", encoding="utf-8") as f:
        writer = csv.writer(f)
        writer.writerow(["length", *view, *names])
        writer.writerows([length, *([cell(shares[length])] if view else []),
                          *(cell(value(row, n, "ndcg")) for n in names)] for length, row in scores.items())
    with open(os.path.join(out, "metrics.csv"), "w", newline="", encoding="utf-8") as f:
        writer = csv.writer(f)
        writer.writerow(["length", "in_view", "model", *RetrievalRecord.METRICS])
        writer.writerows([length, shares[length], name, *(value(row, name, m) for m in RetrievalRecord.METRICS)]
                         for length, row in scores.items() for name in names)
    sections = []
    for metric, title in RetrievalRecord.METRICS.items():
        if all(value(row, n, metric) is None for row in scores.values() for n in names):
            continue  # MLDR: nDCG@10 only
        lines = []
        for length, row in scores.items():
            values = [value(row, n, metric) for n in names]
            best = max((v for v in values if v is not None), default=None)
            cells = [f"**{cell(v)}**" if v == best and len(names) > 1 else cell(v) for v in values]
            lines.append([length, *([cell(shares[length])] if view else []), *cells])
        sections.append(f"{title} (x100)\n\n" + markdown_table(["length", *view, *names], lines))
    markdown = "\n\n".join(sections)
    write_markdown(os.path.join(out, "table.md"), markdown)
    return markdown + "\n"


def _named_models(pairs: list[str]) -> dict[str, str]:
    models = {}
    for pair in pairs:
        name, sep, folder = pair.partition("=")
        if not sep or not name or not os.path.isdir(folder):
            raise ConfigError(f"--models entry {pair!r} is not NAME=EXPORTED_FOLDER (an existing folder)")
        models[name] = folder
    return models


def main(argv: list[str] | None = None) -> None:
    parser = ArgumentParser(prog="python -m cable_lightning retrieval", description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    tune = commands.add_parser("finetune", help="MultipleNegativesRankingLoss on query/positive/negative triples")
    tune.add_argument("--model", required=True, help="an exported encoder (python -m cable_lightning export)")
    tune.add_argument("--triples", default="msmarco", help="'msmarco' (the hub) or a local jsonl of triples")
    tune.add_argument("--out", required=True)
    tune.add_argument("--max_seq_length", type=int, default=512)
    tune.add_argument("--batch_size", type=int, default=32)
    tune.add_argument("--max_steps", type=int, default=1000)
    tune.add_argument("--lr", type=float, default=2e-5)
    tune.add_argument("--warmup_ratio", type=float, default=0.1)
    tune.add_argument("--seed", type=int, default=42)
    tune.add_argument("--mini_batch_size", type=int, help="CachedMultipleNegativesRankingLoss in mini-batches of this "
                      "size (the same loss over the whole --batch_size, for a batch that would not fit at once)")
    tune.add_argument("--overwrite", action="store_true", help="replace an existing --out export (never an input; "
                      "one that is already this fine-tuning, the same export with the same settings, is left as it "
                      "is: nothing to do)")
    ev = commands.add_parser("evaluate", help="nDCG@10 at several maximum input lengths (Table 3)")
    ev.add_argument("--models", nargs="+", required=True, help="NAME=EXPORTED_FOLDER, one per table column")
    ev.add_argument("--lengths", nargs="+", type=int, required=True)
    where = ev.add_mutually_exclusive_group(required=True)
    where.add_argument("--mldr", action="store_true", help="MLDR (English) through MTEB (needs the hub)")
    where.add_argument("--corpus", help="a local BEIR corpus.jsonl (with --queries and --qrels)")
    ev.add_argument("--queries")
    ev.add_argument("--qrels")
    ev.add_argument("--bm25", action="store_true", help="add BM25 on the local set at each length (a lexical "
                    "baseline; documents cut with the first model's tokenizer)")
    ev.add_argument("--records", help="append each model's nDCG@10 by length to <records>/retrieval.jsonl, as its "
                    "run's (the report reads them; sweep --stage retrieval passes the run folder)")
    ev.add_argument("--batch_size", type=int, default=16)
    ev.add_argument("--out", required=True)
    for command in (tune, ev):
        command.add_argument("--trust_remote_code", action="store_true", help="let the model run its own code (an "
                             "export's modeling_cable.py needs it), as transformers' trust_remote_code=True")
    args = parser.parse_args(argv)
    if args.command == "finetune":
        finetune(args.model, args.triples, args.out, args.max_seq_length, args.batch_size, args.max_steps,
                 args.lr, args.warmup_ratio, args.seed, args.trust_remote_code, args.overwrite, args.mini_batch_size)
        return
    if min(args.lengths) < 1:
        parser.error(f"--lengths must be positive, got {args.lengths}")
    if args.corpus and not (args.queries and args.qrels):
        parser.error("--corpus needs --queries and --qrels")
    local = (args.corpus, args.queries, args.qrels) if args.corpus else None
    if args.bm25 and not local:
        parser.error("--bm25 needs a local set (--corpus, --queries, --qrels); MLDR's own BM25 is in its paper")
    models = _named_models(args.models)
    dataset, ends = passage_ends(local)  # read once for every model
    dataset_hash, written = set_hash(local), set()
    if args.records:
        done, written = evaluated_already(models, args.lengths, args.records, dataset, ends, dataset_hash)
        if done:
            print(done)
            return
    scores = evaluate(models, args.lengths, local, args.batch_size, args.trust_remote_code, args.bm25)
    print(write_table(scores, args.out, ends), end="")
    if args.records:  # each row once: those already written are not written again
        append_records(args.records, [record for name, folder in models.items()
                                      for record in retrieval_records(folder, {n: row[name] for n, row in
                                                                               scores.items()}, dataset, ends,
                                                                      dataset_hash)
                                      if record.evaluation() not in written])


if __name__ == "__main__":  # an entry point once: say which verb replaced it, never exit 0 having done nothing
    from cable_lightning.verbs import replaced_entry_point

    replaced_entry_point(__spec__.name)
