"""The long-context probes: loss by token position; the passkey task (prompts in three tokenizers, scoring, its grid
at every checkpoint and on validate, the fine-tuning recipe's data and weights)."""

import base64
import json
import os
import re

import lightning as L
import numpy as np
import pytest
import torch
import torch.nn.functional as F
import yaml
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from cable_lightning.callbacks import LengthEvalRecorder
from cable_lightning.cli import main
from cable_lightning.data.datamodule import TokenDataModule
from cable_lightning.data.tokenizers import get_tokenizer
from cable_lightning.errors import ConfigError
from cable_lightning.eval import position_buckets
from cable_lightning.eval.positions import bucket_index
from cable_lightning.lit import CausalLM
from cable_lightning.models import BackboneConfig
from cable_lightning.tasks.generation import EVAL, PASSKEY_QUESTION, TaskMix, TaskVocabulary, passkey_text
from cable_lightning.tasks.scoring import score_examples

ROOT = os.path.join(os.path.dirname(__file__), "..")


# --- loss by position ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("length", [1, 2, 3, 7, 8, 9, 100, 128, 1000])
def test_position_buckets_are_log_spaced_and_cover_every_position_once(length):
    buckets = position_buckets(length)
    assert buckets[0][0] == 1 and buckets[-1][1] == length
    assert all(a[1] + 1 == b[0] for a, b in zip(buckets, buckets[1:]))  # contiguous, no overlap
    assert all(first & (first - 1) == 0 for first, _ in buckets)  # each starts at a power of two
    index = bucket_index(length).tolist()
    assert [buckets[b][0] <= i + 1 <= buckets[b][1] for i, b in enumerate(index)] == [True] * length


def test_loss_by_position_is_token_weighted_to_the_window_mean_and_matches_by_hand(tiny_corpus_dir, tmp_path):
    dm = TokenDataModule(
        tiny_corpus_dir, block_size=32, micro_batch_size=3, eval_lengths=[32, 96], eval_tokens=500, eval_stride=48
    )
    torch.manual_seed(0)
    model = CausalLM(BackboneConfig(pos_encoding="cable", n_layer=2, n_head=2, n_embd=32), data=dm.describe())
    trainer = L.Trainer(
        accelerator="cpu",
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=str(tmp_path),
        callbacks=[LengthEvalRecorder(print_table=False, figure=False)],
    )
    trainer.validate(model, datamodule=dm, verbose=False)
    rows = [json.loads(line) for line in open(tmp_path / "position_loss.jsonl")]
    assert {r["mode"] for r in rows} == {"nonoverlap"}  # sliding windows score only their last tokens: no curve
    for length in (32, 96):
        mine = [r for r in rows if r["length"] == length]
        assert [(r["first_position"], r["last_position"]) for r in mine] == position_buckets(length)
        tokens = sum(r["tokens"] for r in mine)
        assert tokens == 500  # the last window reaches back: its context-only targets are not counted
        weighted = sum(r["loss"] * r["tokens"] for r in mine) / tokens
        assert weighted == pytest.approx(trainer.callback_metrics[f"val_loss/len_{length}"].item(), rel=1e-5)
    # By hand, the first bucket at 96: the first target of the five windows at 0, 96, ..., 384 (the sixth, at 404,
    # reaches back and scores only its last 20 targets).
    stream, backbone = dm.eval_stream("val"), model.backbone.eval()
    with torch.no_grad():
        firsts = [
            F.cross_entropy(backbone(stream[s : s + 96][None])[0, 0], stream[s + 1]).item() for s in range(0, 400, 96)
        ]
    first_bucket = next(r for r in rows if r["length"] == 96 and r["first_position"] == 1)
    assert first_bucket["tokens"] == 5 and first_bucket["loss"] == pytest.approx(sum(firsts) / 5, rel=1e-5)


# --- the passkey task --------------------------------------------------------------------------------------------


def tiny_tiktoken_file(folder) -> str:
    """A GPT-2-format rank file (the 256 bytes plus a few merges), loaded through the gpt2:FILE path."""
    merges = [b" t", b"he", b" the", b"in", b" a", b"er", b"ss", b" pa", b" pass", b" k", b"ey", b" key", b" is"]
    ranks = [bytes([i]) for i in range(256)] + merges
    path = os.path.join(folder, "tiny.tiktoken")
    with open(path, "w") as f:
        f.writelines(f"{base64.b64encode(token).decode()} {rank}\n" for rank, token in enumerate(ranks))
    return path


def tiny_wordpiece_file(folder) -> str:
    """A lower-casing WordPiece vocabulary: specials, the prompt's words, digits as pieces; other words are [UNK]."""
    words = "the pass key is remember it what there in this text a river runs past old mill . ? :".split()
    vocab = (
        ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
        + words
        + [str(d) for d in range(10)]
        + [f"##{d}" for d in range(10)]
    )
    path = os.path.join(folder, "vocab.txt")
    with open(path, "w") as f:
        f.write("\n".join(vocab) + "\n")
    return path


@pytest.fixture(params=["bpe", "tiktoken", "wordpiece"])
def tokenizer(request, tiny_corpus_dir, tmp_path):
    if request.param == "bpe":  # the corpus-trained byte-level BPE the tiny data was prepared with
        return get_tokenizer(os.path.join(tiny_corpus_dir, "tokenizer.json"))
    if request.param == "tiktoken":
        return get_tokenizer(f"gpt2:{tiny_tiktoken_file(str(tmp_path))}")
    return get_tokenizer(f"bert:{tiny_wordpiece_file(str(tmp_path))}")


def text_only(tokenizer) -> TaskVocabulary:
    """A vocabulary that is only the tokenizer's text (the tiny WordPiece has too few ids to carve symbols from)."""
    none = np.array([], dtype=np.int64)
    return TaskVocabulary({}, none, none, tokenizer)


def sublist_at(ids: list, piece: list) -> int:
    return next(i for i in range(len(ids)) if ids[i:i + len(piece)] == piece)


def test_passkey_examples_have_the_exact_length_the_key_at_its_depth_and_the_answer_last(tokenizer):
    vocab = text_only(tokenizer)
    tasks, text = TaskMix({"passkey": {}}, vocab), passkey_text(tokenizer)
    shortest = tasks.tasks[0].fixed_tokens(vocab) + 1
    with pytest.raises(ConfigError, match=f"needs a length of at least {shortest - 1} tokens, got {shortest - 2}"):
        tasks.example(shortest - 1, 0, EVAL, 0)
    unit = max(map(len, text.sentences))
    for length in (shortest, 300, 1111):
        for depth in (0.0, 0.25, 0.5, 0.75, 1.0):
            for index in range(3):
                e = tasks.example(length, 5, EVAL, index, depth=depth)
                ids, answer = e.ids.tolist(), e.ids[e.answer].tolist()
                key = re.search(r"\d+", tokenizer.decode(answer)).group(0)
                needle, expected = text.key_pieces(key)
                assert len(ids) == length and len(key) == 5 and answer == expected and e.answer[-len(answer):].all()
                assert tokenizer.decode(answer).replace(" ", "").endswith(".")  # the full stop ends the answer
                assert ids[:len(text.intro)] == list(text.intro)
                assert ids[-len(answer) - len(text.question):-len(answer)] == list(text.question)
                budget = length - len(text.intro) - len(needle) - len(text.question) - len(answer)
                at = sublist_at(ids, needle)
                assert abs(at - len(text.intro) - depth * budget) <= unit
                if depth == 0.0:
                    assert at == len(text.intro)
                if depth == 1.0:
                    assert at + len(needle) == length - len(text.question) - len(answer)


def test_passkey_keys_are_fixed_by_the_seed_and_shared_across_cells(tiny_corpus_dir):
    tokenizer = get_tokenizer(os.path.join(tiny_corpus_dir, "tokenizer.json"))
    tasks = TaskMix({"passkey": {}}, text_only(tokenizer))

    def keys(length, depth, seed):
        return [tokenizer.decode(e.ids[e.answer].tolist()) for e in
                (tasks.example(length, seed, EVAL, t, depth=depth) for t in range(5))]

    assert keys(200, 0.5, 3) == keys(400, 0.0, 3)  # trial t has the same key at every length and depth
    assert len(set(keys(200, 0.5, 3))) == 5 and keys(200, 0.5, 3) != keys(200, 0.5, 4)


def test_an_answer_that_runs_on_into_a_sixth_digit_is_wrong(tiny_corpus_dir):
    tokenizer = get_tokenizer(os.path.join(tiny_corpus_dir, "tokenizer.json"))
    examples = [TaskMix({"passkey": {}}, text_only(tokenizer)).example(120, 0, EVAL, t) for t in range(4)]
    digit = tokenizer.encode_batch(["7"])[0][0]

    def oracle(ids, answer):  # predicts every token right
        return ids[:, 1:]

    def run_on(ids, answer):  # right up to the key, then a digit where the full stop belongs
        predicted = oracle(ids, answer).clone()
        predicted[:, -1] = digit
        return predicted

    assert score_examples(oracle, examples) == [True] * 4
    assert score_examples(run_on, examples) == [False] * 4


def test_the_passkey_recipe_mixes_passkey_rows_into_training_only(tiny_corpus_dir):
    dm = TokenDataModule(tiny_corpus_dir, block_size=96, micro_batch_size=4, eval_lengths=[96], eval_tokens=200,
                         tasks={"passkey": {}}, task_fraction=0.5, lm_loss_weight=1.0)
    tokenizer, seen = dm.load_tokenizer(), []

    class Capture(L.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            seen.append((batch["tokens"].clone(), batch["loss_weight"].clone()))

        def on_validation_batch_start(self, trainer, pl_module, batch, batch_idx, dataloader_idx=0):
            seen.append((batch["tokens"].clone(), None))

    torch.manual_seed(0)
    model = CausalLM(BackboneConfig(pos_encoding="nope", n_layer=1, n_head=2, n_embd=32), data=dm.describe())
    trainer = L.Trainer(accelerator="cpu", max_steps=2, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                        limit_val_batches=1, val_check_interval=2, callbacks=[Capture()])
    trainer.fit(model, datamodule=dm)
    (first, weight), (second, _), (val, _) = seen[:3]
    question = PASSKEY_QUESTION.strip()
    for batch in (first, second):
        assert batch.shape == (4, 97)
        assert [question in tokenizer.decode(row.tolist()) for row in batch] == [True, True, False, False]
    assert torch.equal(weight, torch.ones(4, 96))  # lm_loss_weight 1: the whole passkey row is language-model loss
    assert not torch.equal(first[:2], second[:2])  # fresh keys every batch
    assert question not in tokenizer.decode(val[0].tolist())  # evaluation text stays the corpus
    with pytest.raises(ConfigError, match=r"data.block_size 16 is too short for a task: task passkey \(no settings\) "
                                          r"needs a length of at least \d+ tokens, got 16"):
        TokenDataModule(tiny_corpus_dir, block_size=16, tasks={"passkey": {}}).setup("fit")
    with pytest.raises(ConfigError, match="task passkey is written in text and needs a prepared corpus's tokenizer"):
        TokenDataModule(None, block_size=96, tasks={"passkey": {}})


def cli_args(data, runs, pe="cable", experiment="probe", steps=2):
    return [
        "--model",
        "cable_lightning.lit.CausalLM",
        "--model.init_args.backbone.pos_encoding",
        pe,
        "--model.init_args.backbone.n_layer",
        "1",
        "--model.init_args.backbone.n_head",
        "2",
        "--model.init_args.backbone.n_embd",
        "32",
        "--model.init_args.warmup_steps",
        "1",
        "--data.path",
        data,
        "--data.block_size",
        "96",
        "--data.micro_batch_size",
        "4",
        "--data.eval_lengths",
        "[96, 192]",
        "--data.eval_tokens",
        "192",
        "--trainer.accelerator",
        "cpu",
        "--trainer.max_steps",
        str(steps),
        "--trainer.enable_progress_bar",
        "false",
        "--trainer.num_sanity_val_steps",
        "0",
        "--trainer.enable_model_summary",
        "false",
        "--checkpoint.every_n_train_steps",
        str(steps),
        "--runs_dir",
        runs,
        "--experiment",
        experiment,
        "--task_eval.depths",
        "[0.0, 1.0]",
        "--task_eval.trials",
        "2",
    ]


def test_the_passkey_grid_runs_at_fit_checkpoints_and_on_validate(tiny_corpus_dir, tmp_path):
    runs, passkey = str(tmp_path), ["--data.tasks", '{"passkey": {}}', "--data.task_fraction", "0"]
    main(["fit", *cli_args(tiny_corpus_dir, runs, pe="learnable"), *passkey])
    run = tmp_path / "probe" / "learnable" / "version_0"
    rows = [json.loads(line) for line in open(run / "task_accuracy.jsonl")]
    assert [(r["step"], r["task"], r["length"], r["depth"], r["trials"]) for r in rows] == [
        (2, "passkey", n, d, 2) for n in (96, 192) for d in (0.0, 1.0)]
    # a 96-position table reads the 96 tokens of the training length, not 192: recorded, not a crash
    assert [r["accuracy"] is None for r in rows] == [False, False, True, True]
    events = EventAccumulator(str(run), size_guidance={"images": 0})
    events.Reload()
    assert {"tasks/accuracy", "val_loss_vs_position", "val_ppl_vs_length"} <= set(events.Tags()["images"])
    # validate any checkpoint on the passkey: one command, other lengths; rows carry the checkpoint's step and path
    main(["fit", *cli_args(tiny_corpus_dir, runs, pe="nope")])
    ckpt = str(tmp_path / "probe" / "nope" / "checkpoints" / "last.ckpt")
    assert not (tmp_path / "probe" / "nope" / "version_0" / "task_accuracy.jsonl").exists()  # no tasks, no grid
    main(["validate", *cli_args(tiny_corpus_dir, runs, pe="nope"), "--ckpt_path", ckpt, *passkey,
          "--task_eval.lengths", "[100, 200]"])
    rows = [json.loads(line) for line in open(tmp_path / "probe" / "nope" / "version_1" / "task_accuracy.jsonl")]
    assert {(r["length"], r["depth"]) for r in rows} == {(n, d) for n in (100, 200) for d in (0.0, 1.0)}
    assert all(r["step"] == 2 and r["checkpoint"] == os.path.abspath(ckpt) and r["correct"] in (0, 1, 2) for r in rows)
    with pytest.raises(ConfigError, match=r"task_eval.depths must be fractions in \[0, 1\].*\[0.5, 2.0\]"):
        main(["validate", *cli_args(tiny_corpus_dir, runs, pe="nope"), "--ckpt_path", ckpt, *passkey,
              "--task_eval.depths", "[0.5, 2.0]"])


def test_recipe_config_starts_from_the_checkpoint_weights_and_refuses_another_model(tiny_corpus_dir, tmp_path):
    recipe = yaml.safe_load(open(os.path.join(ROOT, "configs", "passkey_finetune.yaml")))
    assert list(recipe["data"]["tasks"]) == ["passkey"] and 0 < recipe["data"]["task_fraction"] < 1
    runs = str(tmp_path)
    base = main(["fit", *cli_args(tiny_corpus_dir, runs, pe="alibi", experiment="base")])
    ckpt = str(tmp_path / "base" / "alibi" / "checkpoints" / "last.ckpt")
    tuned = main(["fit", "--config", os.path.join(ROOT, "configs", "passkey_finetune.yaml"),
                  *cli_args(tiny_corpus_dir, runs, pe="alibi", experiment="tuned", steps=1),
                  "--model.init_args.lr", "0", "--model.init_args.min_lr", "0",
                  "--model.init_args.init_weights", ckpt, "--task_eval.enabled", "false"])
    assert tuned.datamodule.task_fraction == recipe["data"]["task_fraction"]
    for (name, p), q in zip(base.model.backbone.named_parameters(), tuned.model.backbone.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=0, msg=name)  # lr 0: still exactly the checkpoint's weights
    with pytest.raises(ConfigError, match=r"init_weights .* is of another model: pos_encoding \(checkpoint 'alibi', "
                                          r"configured 'rope'\)"):
        main(["fit", *cli_args(tiny_corpus_dir, runs, pe="rope", experiment="wrong"),
              "--model.init_args.init_weights", ckpt])


def test_the_passkey_on_a_masked_lm_is_scored_with_its_key_masked(tiny_corpus_dir, tmp_path):
    args = cli_args(tiny_corpus_dir, str(tmp_path), pe="alibi")
    args[1] = "cable_lightning.lit.MaskedLM"
    cli = main(["fit", *args, "--model.init_args.backbone.preset", "bert-base", "--data.tasks",
                '{"passkey": {}}', "--data.task_fraction", "0", "--trainer.max_steps", "1"])
    rows = [json.loads(line) for line in open(os.path.join(cli.trainer.log_dir, "task_accuracy.jsonl"))]
    assert rows and {r["task"] for r in rows} == {"passkey"} and all(r["trials"] for r in rows)
