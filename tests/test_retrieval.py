"""The retrieval verb offline: an exported encoder under sentence-transformers (mean pooling, truncation at the
requested length), a few steps of MultipleNegativesRankingLoss on local triples, nDCG@10 on a local BEIR set where
the answers are known, the Table-3 layout, and MLDR's one-line error when the hub cannot be reached."""

import csv
import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

pytest.importorskip("sentence_transformers")  # the hf extra: tools/install.sh installs it, so this runs in CI

from safetensors.torch import load_file

from cable_lightning.data.tokenizers import get_tokenizer
from cable_lightning.errors import ConfigError
from cable_lightning.hf import export_backbone, retrieval
from cable_lightning.models import BackboneConfig, build_backbone
from cable_lightning.records.io import read_records
from cable_lightning.records.schema import RetrievalRecord

TRAIN_LEN = 16
# Each query shares a rare made-up word with its one relevant document; the rest of the corpus is distractors.
ANSWERS = {"q1": ("zygomorphic quokka", "d1", "the zygomorphic quokka sleeps in the afternoon sun"),
           "q2": ("xylofrint bells", "d2", "xylofrint bells ring at the old harbour every evening"),
           "q3": ("plumbrask soup", "d3", "a bowl of plumbrask soup is served with bread")}
DISTRACTORS = ["The os module provides a portable way of using operating system dependent functionality.",
               "Return the value of the named attribute of object.", "This module implements pseudo-random numbers.",
               "Open file and return a corresponding file object.", "The sys module gives access to the interpreter."]
EXTRA_TRIPLES = [("vrentish lamps", "vrentish lamps light the long hallway", "Return the absolute value of a number."),
                 ("glorbax stones", "glorbax stones are found near rivers", "Format a string with the given values."),
                 ("snivvel birds", "snivvel birds sing before the rain comes", "The pickle module serialises objects.")]


@pytest.fixture(autouse=True)
def hub_offline(monkeypatch):
    """Offline mode for these tests (the libraries read HF_HUB_OFFLINE once, at import): nothing may wait on the hub."""
    import datasets
    import huggingface_hub

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)


@pytest.fixture(scope="module")
def encoder_folder(tiny_corpus_dir, tmp_path_factory):
    tok = get_tokenizer(os.path.join(tiny_corpus_dir, "tokenizer.json"))
    torch.manual_seed(0)
    backbone = build_backbone(BackboneConfig(preset="bert-base", pos_encoding="cable", n_layer=2, n_head=2, n_embd=64,
                                             vocab_size=tok.vocab_size, block_size=TRAIN_LEN))
    return export_backbone(backbone, str(tmp_path_factory.mktemp("retrieval") / "encoder"), tok), tok


def write_beir(folder, relevant: dict[str, str]) -> list[str]:
    folder.mkdir(exist_ok=True)
    docs = [{"_id": doc_id, "text": text} for _, doc_id, text in ANSWERS.values()]
    docs += [{"_id": f"x{i}", "text": text} for i, text in enumerate(DISTRACTORS)]
    (folder / "corpus.jsonl").write_text("".join(json.dumps(d) + "\n" for d in docs))
    queries = [{"_id": qid, "text": query} for qid, (query, _, _) in ANSWERS.items()]
    (folder / "queries.jsonl").write_text("".join(json.dumps(q) + "\n" for q in queries))
    qrels = "".join(f"{query}\t{doc}\t1\n" for query, doc in relevant.items())
    (folder / "qrels.tsv").write_text("query-id\tcorpus-id\tscore\n" + qrels)
    return [str(folder / name) for name in ("corpus.jsonl", "queries.jsonl", "qrels.tsv")]


def test_qrels_separated_by_spaces_are_one_error_naming_the_line(tmp_path):
    corpus, queries, qrels = write_beir(tmp_path, {qid: doc_id for qid, (_, doc_id, _) in ANSWERS.items()})
    lines = open(qrels).read().splitlines()
    with open(qrels, "w") as f:
        f.write("\n".join([*lines[:2], lines[2].replace("\t", " "), *lines[3:]]) + "\n")
    with pytest.raises(ConfigError) as error:
        retrieval.read_beir(corpus, queries, qrels)
    assert str(error.value) == (f"{qrels}:3: [{lines[2].replace(chr(9), ' ')!r}] is not query-id<TAB>corpus-id<TAB>"
                                "score (columns separated by tabs, the score a number); fix that line")


@pytest.mark.parametrize("length", [8, 24])  # 24: past the training length
def test_encoder_mean_pools_and_truncates_inputs_at_the_requested_length(encoder_folder, length):
    folder, tok = encoder_folder
    model = retrieval.encoder(folder, length, trust_remote_code=True)
    seen = []
    model[0].auto_model.backbone.wte.register_forward_hook(lambda module, args, out: seen.append(args[0].shape[1]))
    long_text, short_text = " ".join(DISTRACTORS), "short"
    embeddings = model.encode([long_text, short_text], batch_size=1, convert_to_tensor=True)
    assert seen == [length, len(tok.encode_batch([short_text])[0])]
    assert len(tok.encode_batch([long_text])[0]) > length
    ids = torch.tensor([tok.encode_batch([long_text])[0][:length]])
    with torch.no_grad():  # mean over the real tokens of the truncated input
        expected = model[0].auto_model.backbone.hidden_states(ids).mean(dim=1)[0]
    torch.testing.assert_close(embeddings[0], expected, rtol=0, atol=1e-5)


def test_finetune_then_ndcg_beats_a_shuffled_ranking_and_table_layout(encoder_folder, tmp_path):
    folder, _ = encoder_folder
    triples = [(q, text, DISTRACTORS[i]) for i, (q, _, text) in enumerate(ANSWERS.values())] + EXTRA_TRIPLES
    (tmp_path / "triples.jsonl").write_text(
        "".join(json.dumps({"query": q, "positive": p, "negative": n}) + "\n" for q, p, n in triples))
    tuned = retrieval.finetune(folder, str(tmp_path / "triples.jsonl"), str(tmp_path / "tuned"), max_seq_length=32,
                               batch_size=3, max_steps=10, lr=1e-3, trust_remote_code=True)
    assert {"model.safetensors", "config.json", "cable_core", "tokenizer.json"} <= set(os.listdir(tuned))
    before, after = (load_file(os.path.join(f, "model.safetensors")) for f in (folder, tuned))
    assert before.keys() == after.keys()
    assert not torch.equal(before["backbone.wte.weight"], after["backbone.wte.weight"])
    truth = {qid: doc_id for qid, (_, doc_id, _) in ANSWERS.items()}
    shuffled = dict(zip(truth, list(truth.values())[1:] + list(truth.values())[:1]))  # every query's answer is wrong
    model = retrieval.encoder(tuned, 32, trust_remote_code=True)
    trained = retrieval.scores_local(model, *retrieval.read_beir(*write_beir(tmp_path / "truth", truth)))["ndcg"]
    wrong = retrieval.scores_local(model, *retrieval.read_beir(*write_beir(tmp_path / "shuffled", shuffled)))["ndcg"]
    assert 0 <= wrong < trained <= 1 and trained > 0.8, (trained, wrong)

    corpus, queries, qrels = write_beir(tmp_path / "truth", truth)
    retrieval.main(["evaluate", "--models", f"tuned={tuned}", f"base={folder}", "--lengths", "8", "32",
                    "--corpus", corpus, "--queries", queries, "--qrels", qrels, "--out", str(tmp_path / "table"),
                    "--trust_remote_code"])
    lines = (tmp_path / "table" / "table.md").read_text().splitlines()
    assert lines[2] == "| length | tuned | base |" and [line.split(" | ")[0] for line in lines[4:6]] == ["| 8", "| 32"]
    assert f"{100 * trained:.2f}" in lines[5]


def test_mldr_offline_is_one_line(encoder_folder):
    with pytest.raises(ConfigError) as stop:
        retrieval.ndcg_mldr(retrieval.encoder(encoder_folder[0], 16, trust_remote_code=True))
    message = str(stop.value)
    assert message.startswith("MTEB could not run MultiLongDocRetrieval") and "\n" not in message
    assert "--corpus/--queries/--qrels" in message


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def tool(*argv: str) -> subprocess.CompletedProcess:
    """A tool as its user runs it (this checkout's package first on the path)."""
    env = {**os.environ, "PYTHONPATH": ROOT, "HF_HUB_OFFLINE": "1"}
    env.pop("CABLE_LIGHTNING_DEBUG", None)
    return subprocess.run([sys.executable, *argv], capture_output=True, text=True, env=env, cwd=ROOT)


def test_an_export_runs_its_own_code_only_behind_trust_remote_code(encoder_folder, tmp_path):
    folder = encoder_folder[0]
    with pytest.raises(ConfigError, match=r"runs its own code when loaded \(configuration_cable.py, modeling_cable.py"
                                          r"\); pass --trust_remote_code"):
        retrieval.encoder(folder, 16)
    corpus, queries, qrels = write_beir(tmp_path / "beir", {qid: doc_id for qid, (_, doc_id, _) in ANSWERS.items()})
    done = tool("-m", "cable_lightning", "retrieval", "evaluate", "--models", f"base={folder}", "--lengths", "8",
                "--corpus", corpus, "--queries", queries, "--qrels", qrels, "--out", str(tmp_path / "table"))
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    assert [line for line in done.stderr.splitlines() if line.startswith("error:")] == [
        f"error: {folder} runs its own code when loaded (configuration_cable.py, modeling_cable.py); pass "
        "--trust_remote_code to allow it (transformers' trust_remote_code=True)"]
    assert not (tmp_path / "table").exists()


def test_core_files_must_stay_inside_the_export_and_be_there(encoder_folder, tmp_path):
    from transformers import AutoModel

    from cable_lightning.hf.export import load_backbone

    folder = tmp_path / "export"
    shutil.copytree(encoder_folder[0], folder)
    config = json.loads((folder / "config.json").read_text())
    (tmp_path / "evil.py").write_text("raise SystemExit('ran code from outside the export')\n")
    for escape in ("../../evil.py", str(tmp_path / "evil.py")):
        (folder / "config.json").write_text(json.dumps({**config, "core_files": [*config["core_files"], escape]}))
        with pytest.raises(ConfigError, match=f"core_files entry '{escape}' in .* leaves cable_core/"):
            load_backbone(str(folder))
        with pytest.raises(ValueError, match=f"core_files entry '{escape}' in .* leaves cable_core/"):
            AutoModel.from_pretrained(str(folder), trust_remote_code=True)
    (folder / "config.json").write_text(json.dumps(config))
    shutil.rmtree(folder / "cable_core" / "positional")
    with pytest.raises(ConfigError, match=f"{folder} is not a complete export"):
        retrieval.encoder(str(folder), 16, trust_remote_code=True)


def test_finetune_out_replaces_only_an_export_that_is_not_its_input(encoder_folder, tmp_path):
    folder = encoder_folder[0]
    triples = tmp_path / "triples.jsonl"
    triples.write_text("".join(json.dumps({"query": q, "positive": p, "negative": n}) + "\n"
                               for q, p, n in EXTRA_TRIPLES))

    def tune(out, overwrite=False):
        return retrieval.finetune(folder, str(triples), str(out), max_seq_length=16, batch_size=3, max_steps=1,
                                  trust_remote_code=True, overwrite=overwrite)

    with pytest.raises(ConfigError, match=f"--out {folder} holds this command's input {folder}"):
        tune(folder, overwrite=True)  # in place would replace the model being read
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep")
    with pytest.raises(ConfigError, match="was not written by export"):
        tune(mine, overwrite=True)
    assert os.listdir(mine) == ["notes.txt"]
    other = tmp_path / "other-export"
    shutil.copytree(folder, other)
    (other / "stale.bin").write_text("from the old export")
    with pytest.raises(ConfigError, match=r"already exists \(written by export\); pass --overwrite"):
        tune(other)
    tune(other, overwrite=True)
    assert not (other / "stale.bin").exists() and (other / "model.safetensors").is_file()  # replaced, not mixed
    assert [p for p in os.listdir(tmp_path) if ".partial-" in p or ".old-" in p] == []


def test_bm25_baseline_finds_a_shared_rare_word_only_where_the_cut_keeps_it(encoder_folder, tmp_path):
    """The lexical baseline at a length sees what an encoder at that length sees: documents cut to its first tokens.
    Each query's rare words are in its document only, so uncut BM25 ranks every answer first (nDCG@10 = 1); cut to
    one token, no document holds a query word and the ranking is a tie (below 1). The command adds a bm25 column."""
    from transformers import PreTrainedTokenizerFast

    folder, _ = encoder_folder
    local = write_beir(tmp_path, {qid: doc_id for qid, (_, doc_id, _) in ANSWERS.items()})
    tokenizer = PreTrainedTokenizerFast.from_pretrained(folder)
    data = retrieval.read_beir(*local)
    assert retrieval.scores_bm25(*data, 64, tokenizer) == {"ndcg": 1.0, "mrr": 1.0, "recall": 1.0}
    assert retrieval.scores_bm25(*data, 1, tokenizer)["ndcg"] < 0.9
    retrieval.main(["evaluate", "--models", f"base={folder}", "--lengths", "1", "64", "--corpus", local[0],
                    "--queries", local[1], "--qrels", local[2], "--bm25", "--out", str(tmp_path / "out"),
                    "--trust_remote_code"])
    rows = list(csv.DictReader(open(tmp_path / "out" / "table.csv")))
    assert [row["bm25"] for row in rows][1] == "100.00" and set(rows[0]) == {"length", "bm25", "base"}


def test_a_learned_table_gets_a_dash_past_its_size_and_no_record(tiny_corpus_dir, tmp_path):
    """The paper's Table 3 has "-" for learnable past 512: evaluate scores the lengths an export can serve, marks the
    rest, and records only what it scored (it once stopped the whole sweep)."""
    tok = get_tokenizer(os.path.join(tiny_corpus_dir, "tokenizer.json"))
    backbone = build_backbone(BackboneConfig(preset="bert-base", pos_encoding="learnable", n_layer=1, n_head=2,
                                             n_embd=32, vocab_size=tok.vocab_size, block_size=16))
    folder = export_backbone(backbone, str(tmp_path / "learnable"), tok)
    assert retrieval.longest_length(folder) == 16
    truth = {qid: doc_id for qid, (_, doc_id, _) in ANSWERS.items()}
    corpus, queries, qrels = write_beir(tmp_path / "truth", truth)
    retrieval.main(["evaluate", "--models", f"learnable={folder}", "--lengths", "8", "16", "32", "--corpus", corpus,
                    "--queries", queries, "--qrels", qrels, "--out", str(tmp_path / "table"), "--records",
                    str(tmp_path), "--trust_remote_code"])
    rows = (tmp_path / "table" / "table.md").read_text().splitlines()[4:7]  # nDCG@10's table (MRR@10's follows)
    assert [row.endswith("| - |") for row in rows] == [False, False, True] and rows[2] == "| 32 | - |"
    assert [r.length for r in read_records(str(tmp_path / RetrievalRecord.FILE), RetrievalRecord)] == [8, 16]


def test_pairs_without_negatives_train_on_in_batch_negatives_also_with_the_cached_loss(encoder_folder, tmp_path):
    """A code set's training rows are (query, positive) only: the other rows' positives in a batch are the negatives;
    --mini_batch_size computes that loss in mini-batches (CachedMultipleNegativesRankingLoss); a mini-batch larger
    than the batch is one error before any work."""
    folder = encoder_folder[0]
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text("".join(json.dumps({"query": q, "positive": p}) + "\n" for q, p, _ in EXTRA_TRIPLES))
    assert retrieval.load_triples(str(pairs)).column_names == ["query", "positive"]
    tuned = retrieval.finetune(folder, str(pairs), str(tmp_path / "tuned"), max_seq_length=16, batch_size=3,
                               max_steps=2, lr=1e-3, trust_remote_code=True, mini_batch_size=1)
    before, after = (load_file(os.path.join(f, "model.safetensors")) for f in (folder, tuned))
    assert not torch.equal(before["backbone.wte.weight"], after["backbone.wte.weight"])
    with pytest.raises(ConfigError, match=r"^--mini_batch_size must be from 1 to --batch_size \(3\), got 4$"):
        retrieval.finetune(folder, str(pairs), str(tmp_path / "other"), batch_size=3, mini_batch_size=4)


def test_mrr_recall_and_the_in_view_share_by_length(encoder_folder, tmp_path):
    """BM25's MRR@10 and Recall@100 from its ranking; a set whose queries record where their passage ends gets an
    "in view" column (the share whose passage ends within the length) and MRR@10 and Recall@100 tables; metrics.csv
    has every value."""
    folder, _ = encoder_folder
    truth = {qid: doc_id for qid, (_, doc_id, _) in ANSWERS.items()}
    corpus, queries, qrels = write_beir(tmp_path / "set", truth)
    rows = [json.loads(line) for line in open(queries)]
    with open(queries, "w") as f:  # where each query's answer ends, in tokens
        f.writelines(json.dumps({**row, "end": end}) + "\n" for row, end in zip(rows, (4, 8, 30)))
    retrieval.main(["evaluate", "--models", f"base={folder}", "--lengths", "4", "8", "16", "--corpus", corpus,
                    "--queries", queries, "--qrels", qrels, "--bm25", "--out", str(tmp_path / "out"),
                    "--trust_remote_code"])
    table = (tmp_path / "out" / "table.md").read_text()
    assert "| length | in view | bm25 | base |" in table.splitlines()[2]
    assert [line.split(" | ")[1] for line in table.splitlines()[4:7]] == ["33.33", "66.67", "66.67"]
    assert "MRR@10 (x100)" in table and "Recall@100 (x100)" in table
    metrics = list(csv.DictReader(open(tmp_path / "out" / "metrics.csv")))
    assert {row["model"] for row in metrics} == {"bm25", "base"} and len(metrics) == 6
    for row in metrics:
        assert float(row["mrr"]) <= 1 and float(row["recall"]) == 1.0  # 8 documents: every answer in the top 100
        assert float(row["ndcg"]) >= float(row["mrr"])  # one relevant each: 1/log2(1+r) >= 1/r


def test_rows_name_the_run_its_fine_tuning_and_the_set_and_a_rerun_does_nothing_twice(encoder_folder, tmp_path,
                                                                                        capsys, monkeypatch):
    """An export's provenance (the pre-trained run's identity) and the fine-tuning's settings reach every retrieval
    row, with the set's content hash; finetune and evaluate --records run again with the same settings say they are
    done and write nothing (a new length adds its rows alone); other settings fine-tune again, and a set rebuilt
    under its folder name is evaluated again under its new hash. Without these a rerun appended every row again,
    and the rows told neither apart."""
    base, tuned, run = tmp_path / "base", tmp_path / "tuned", tmp_path / "run"
    shutil.copytree(encoder_folder[0], base)
    config = json.loads((base / "config.json").read_text())
    provenance = {"step": 4, "run_seed": 0, "checkpoint": "/runs/enc/cable/last.ckpt", "checkpoint_hash": "c" * 64,
                  "lr": 3e-4, "corpus_hash": "d" * 64, "recipe": {"steps": 4}, "settings": {"dropout": 0.0}}
    (base / "config.json").write_text(json.dumps({**config, "provenance": provenance}))
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text("".join(json.dumps({"query": q, "positive": p}) + "\n" for q, p, _ in EXTRA_TRIPLES))
    tune = ["finetune", "--model", str(base), "--triples", str(pairs), "--out", str(tuned), "--max_seq_length", "16",
            "--batch_size", "3", "--max_steps", "1", "--seed", "0", "--overwrite", "--trust_remote_code"]
    hashed = []
    content_hash = retrieval.content_hash
    monkeypatch.setattr(retrieval, "content_hash", lambda paths: hashed.append(paths) or content_hash(paths))
    retrieval.main(tune)
    assert capsys.readouterr().out.splitlines()[-1] == f"saved {tuned}"
    assert hashed == [[str(pairs)]]  # the triples are read for their hash once, by the check and the provenance alike
    settings = {"max_steps": 1, "batch_size": 3, "lr": 2e-5, "warmup_ratio": 0.1, "seed": 0, "max_seq_length": 16,
                "mini_batch_size": None, "triples": retrieval.content_hash([str(pairs)])[:16]}
    assert json.loads((tuned / "config.json").read_text())["provenance"] == {**provenance, "finetune": settings}
    written = os.stat(tuned / "model.safetensors").st_mtime_ns
    retrieval.main(tune)
    assert capsys.readouterr().out == f"{tuned} is {base} fine-tuned with these settings: already done; nothing to do\n"
    assert os.stat(tuned / "model.safetensors").st_mtime_ns == written

    corpus, queries, qrels = write_beir(tmp_path / "set", {qid: doc_id for qid, (_, doc_id, _) in ANSWERS.items()})
    evaluate = ["evaluate", "--models", f"cable={tuned}", "--lengths", "8", "16", "--corpus", corpus, "--queries",
                queries, "--qrels", qrels, "--records", str(run), "--out", str(tmp_path / "table"),
                "--trust_remote_code"]
    retrieval.main(evaluate)
    rows = read_records(str(run / RetrievalRecord.FILE), RetrievalRecord)
    first_hash = retrieval.content_hash([corpus, queries, qrels])
    assert [(r.length, r.dataset, r.dataset_hash, r.finetune) for r in rows] == [
        (8, "set", first_hash, settings), (16, "set", first_hash, settings)]
    assert {(r.lr, r.corpus_hash, json.dumps(r.recipe), json.dumps(r.settings), r.step, r.run_seed) for r in rows} == {
        (3e-4, "d" * 64, '{"steps": 4}', '{"dropout": 0.0}', 4, 0)}
    capsys.readouterr()
    retrieval.main(evaluate)
    assert capsys.readouterr().out == (f"{run / RetrievalRecord.FILE} holds cable on set at 8 16: already done; "
                                       "nothing to do\n")
    retrieval.main([*evaluate[:5], "16", "32", *evaluate[6:]])  # one length new: only its row is written
    assert [r.length for r in read_records(str(run / RetrievalRecord.FILE), RetrievalRecord)] == [8, 16, 32]

    with open(qrels, "a") as f:  # the set built again under its name, with other contents: evaluated again
        f.write("q1\tx0\t1\n")
    rebuilt = retrieval.set_hash((corpus, queries, qrels))
    assert rebuilt != first_hash
    assert retrieval.evaluated_already({"cable": str(tuned)}, [8, 16], str(run), "set", [], rebuilt)[0] is None
    again = {**settings, "max_steps": 2}  # another --max_steps (or any setting): fine-tuned again
    assert retrieval.finetuned_already(str(base), str(tuned), again) is None


def test_a_sweep_run_again_skips_each_finished_stage_and_writes_each_row_once(tiny_corpus_dir, tmp_path, monkeypatch,
                                                                               capsys):
    """`sweep --stage fit+retrieval` run again after it finished redid every run's export, fine-tuning and evaluation
    and appended its retrieval rows again; each command now sees its output there for the same input and settings
    and says so in one line (the sweep stays a list of commands, here run in this process)."""
    from cable_lightning import sweep
    from cable_lightning.__main__ import main as run_verb

    config = tmp_path / "enc.yaml"
    config.write_text(json.dumps({
        "model": {"class_path": "cable_lightning.lit.MaskedLM", "init_args": {
            "backbone": {"preset": "bert-base", "n_layer": 1, "n_head": 2, "n_embd": 32}, "warmup_steps": 1}},
        "data": {"path": tiny_corpus_dir, "block_size": 16, "micro_batch_size": 2, "eval_lengths": [16],
                 "eval_tokens": 64},
        "trainer": {"accelerator": "cpu", "devices": 1, "max_steps": 1, "num_sanity_val_steps": 0,
                    "enable_progress_bar": False, "enable_model_summary": False}}))
    retrieval_set = tmp_path / "set"
    write_beir(retrieval_set, {qid: doc_id for qid, (_, doc_id, _) in ANSWERS.items()})
    (retrieval_set / "train_pairs.jsonl").write_text(
        "".join(json.dumps({"query": q, "positive": p}) + "\n" for q, p, _ in EXTRA_TRIPLES))
    monkeypatch.setattr(sweep, "run_passing_signals", lambda cmd: (run_verb(cmd[3:]) or 0, None))
    monkeypatch.setattr(sweep, "report", lambda paths, out: {})  # the report's tables are tested elsewhere
    argv = ["--config", str(config), "--pes", "cable", "--experiment", "enc", "--runs_dir", str(tmp_path / "runs"),
            "--stage", "fit+retrieval", "--retrieval_set", str(retrieval_set), "--retrieval_lengths", "16", "32",
            "--finetune_steps", "1", "--finetune_batch", "3"]
    sweep.main(argv)
    records = tmp_path / "runs" / "enc" / "cable" / RetrievalRecord.FILE
    rows = records.read_text()
    assert [r.length for r in read_records(str(records), RetrievalRecord)] == [16, 32]
    capsys.readouterr()
    sweep.main(argv)
    said = [line for line in capsys.readouterr().out.splitlines() if not line.startswith("+ ")]
    assert said[0].startswith("the run is finished: ") and len(said) == 4, said
    assert all(line.endswith(": already done; nothing to do") for line in said[1:]), said  # export, tuning, evaluation
    assert records.read_text() == rows
