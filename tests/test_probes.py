"""The long-context probes: loss by token position, passkey prompts and scoring, the passkey callback, the
fine-tuning recipe's data and weights."""

import base64
import json
import os
import random

import lightning as L
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
from cable_lightning.eval.passkey import (
    QUESTION,
    PasskeyPrompts,
    greedy_completion,
    is_correct,
    passkey_grid,
    score_prompts,
    training_sequence,
)
from cable_lightning.eval.positions import bucket_index
from cable_lightning.lit import CausalLM
from cable_lightning.models import BackboneConfig, build_backbone

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


# --- passkey prompts ---------------------------------------------------------------------------------------------


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


def test_passkey_prompts_have_the_exact_length_and_the_key_at_the_depth(tokenizer):
    builder = PasskeyPrompts(tokenizer)
    unit = builder.max_unit_tokens()
    for length in (builder.fixed_tokens("12345") + 3, 300, 1111):
        for depth in (0.0, 0.25, 0.5, 0.75, 1.0):
            for trial in range(3):
                p = builder.sample(length, depth, trial, seed=5)
                assert len(p.ids) == length
                assert p.ids[p.needle_start : p.needle_start + p.needle_length] == builder.needle_ids(p.key)
                assert p.key in tokenizer.decode(p.ids[p.needle_start : p.needle_start + p.needle_length]).replace(
                    " ", ""
                )
                assert (
                    p.ids[-len(builder.question) :] == builder.question and p.ids[: len(builder.intro)] == builder.intro
                )
                budget = length - builder.fixed_tokens(p.key)
                assert abs(p.needle_start - len(builder.intro) - depth * budget) <= unit
                if depth == 0.0:
                    assert p.needle_start == len(builder.intro)
                if depth == 1.0:
                    assert p.needle_start + p.needle_length == length - len(builder.question)
    with pytest.raises(ConfigError, match=r"passkey prompt length 10 is too short.*at least \d+"):
        builder.build(10, 0.5, "12345")


def test_passkey_trials_are_fixed_by_the_seed_and_share_keys_across_cells(tiny_corpus_dir):
    builder = PasskeyPrompts(get_tokenizer(os.path.join(tiny_corpus_dir, "tokenizer.json")))
    keys = [builder.sample(200, 0.5, t, seed=3).key for t in range(5)]
    assert keys == [builder.sample(400, 0.0, t, seed=3).key for t in range(5)]  # same trial, same key everywhere
    assert len(set(keys)) == 5 and all(len(k) == 5 and k.isdigit() for k in keys)
    assert keys != [builder.sample(200, 0.5, t, seed=4).key for t in range(5)]


# --- passkey scoring ---------------------------------------------------------------------------------------------


def test_exact_match_takes_the_first_number_whole():
    assert is_correct(" 12345.", "12345") and is_correct("12345 is", "12345")
    assert not is_correct(" 123456", "12345") and not is_correct(" 1234", "12345") and not is_correct(" the", "12345")
    assert not is_correct(" 54321 12345", "12345")


def test_an_oracle_scores_one_and_a_constant_scores_zero(tiny_corpus_dir):
    tokenizer = get_tokenizer(os.path.join(tiny_corpus_dir, "tokenizer.json"))
    builder = PasskeyPrompts(tokenizer)
    answers = {}

    def oracle(prompts, new_tokens):  # knows every prompt's key (recorded below as the grid builds them)
        out = [answers[tuple(row.tolist())] for row in prompts]
        return torch.tensor([(a + a)[:new_tokens] for a in out])  # the key, then more text after it

    original = builder.sample

    def recording_sample(*args, **kwargs):
        prompt = original(*args, **kwargs)
        answers[tuple(prompt.ids)] = builder.answer_ids(prompt.key) + tokenizer.encode_batch([". The"])[0]
        return prompt

    builder.sample = recording_sample
    rows = passkey_grid(oracle, builder, lengths=[80, 160], depths=[0.0, 0.5, 1.0], trials=3)
    assert [(r["length"], r["depth"], r["accuracy"]) for r in rows] == [
        (n, d, 1.0) for n in (80, 160) for d in (0.0, 0.5, 1.0)
    ]
    constant = tokenizer.encode_batch([" 11111"])[0]
    rows = passkey_grid(
        lambda prompts, n: torch.tensor([(constant * n)[:n]] * len(prompts)), builder, [80], [0.5], trials=4
    )
    assert rows == [{"length": 80, "depth": 0.5, "trials": 4, "correct": 0, "accuracy": 0.0}]


def test_a_forced_model_decoding_with_the_kv_cache_scores_as_forced(tiny_corpus_dir):
    """A real backbone whose next-token choice after the prompt is forced to one key's answer: greedy decoding
    through the KV cache must produce that key, so exactly the prompts hiding that key are answered right."""
    tokenizer = get_tokenizer(os.path.join(tiny_corpus_dir, "tokenizer.json"))
    builder = PasskeyPrompts(tokenizer)
    prompts = [
        builder.build(90, depth, key) for depth, key in [(0.0, "40404"), (0.5, "12121"), (1.0, "40404"), (0.3, "77777")]
    ]
    forced = builder.answer_ids("40404") + [tokenizer.eot_id] * 4
    torch.manual_seed(0)
    backbone = build_backbone(
        BackboneConfig(pos_encoding="cable", n_layer=1, n_head=2, n_embd=32, vocab_size=tokenizer.vocab_size)
    )
    plain_hidden_states, plain_logits = backbone.hidden_states, backbone.logits
    fed_lengths, read = [], []

    def hidden_states(ids, cache=None):
        fed_lengths.append(ids.shape[1])
        hidden = plain_hidden_states(ids, cache)
        read.append(cache.length)  # tokens read so far, the prompt's 90 first
        return hidden

    def forced_logits(hidden):
        logits = plain_logits(hidden)
        logits[..., forced[read[-1] - 90]] = 1e4
        return logits

    backbone.hidden_states, backbone.logits = hidden_states, forced_logits
    assert score_prompts(greedy_completion(backbone), prompts, tokenizer) == [True, False, True, False]
    assert fed_lengths[0] == 90 and set(fed_lengths[1:]) == {1}  # the prompt once, then one token at a time


# --- the recipe's data, the callback, initial weights ------------------------------------------------------------


def test_recipe_batches_mix_passkey_sequences_into_training_only(tiny_corpus_dir):
    dm = TokenDataModule(
        tiny_corpus_dir, block_size=96, micro_batch_size=4, eval_lengths=[96], eval_tokens=200, passkey_fraction=0.5
    )
    builder = PasskeyPrompts(dm.load_tokenizer())
    seen = []

    class Capture(L.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            seen.append(batch.clone())

        def on_validation_batch_start(self, trainer, pl_module, batch, batch_idx, dataloader_idx=0):
            seen.append(batch["tokens"].clone())

    torch.manual_seed(0)
    model = CausalLM(BackboneConfig(pos_encoding="nope", n_layer=1, n_head=2, n_embd=32), data=dm.describe())
    trainer = L.Trainer(
        accelerator="cpu",
        max_steps=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=1,
        val_check_interval=2,
        callbacks=[Capture()],
    )
    trainer.fit(model, datamodule=dm)
    train_batches, val_batch = seen[:2], seen[2]
    question = builder.question
    for batch in train_batches:
        assert batch.shape == (4, 97)
        for row, is_passkey in zip(batch.tolist(), (True, True, False, False)):
            text = dm.load_tokenizer().decode(row)
            if not is_passkey:
                assert QUESTION not in text
                continue
            key = text.split("The pass key is ")[1][:5]
            answer = builder.answer_ids(key)
            assert row[-len(answer) :] == answer and row[-len(answer) - len(question) : -len(answer)] == question
    assert not torch.equal(train_batches[0][:2], train_batches[1][:2])  # fresh keys every batch
    assert QUESTION not in dm.load_tokenizer().decode(val_batch[0].tolist())  # evaluation text stays the corpus
    rng = random.Random(1)
    assert len(training_sequence(builder, 97, rng)) == 97
    with pytest.raises(ConfigError, match="passkey_fraction needs a longer block_size than 16"):
        TokenDataModule(tiny_corpus_dir, block_size=16, passkey_fraction=0.5).setup("fit")


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
        "--passkey.depths",
        "[0.0, 1.0]",
        "--passkey.trials",
        "2",
    ]


def test_passkey_grid_runs_at_fit_checkpoints_and_on_validate(tiny_corpus_dir, tmp_path):
    runs = str(tmp_path)
    main(["fit", *cli_args(tiny_corpus_dir, runs, pe="learnable"), "--passkey.enabled", "true"])
    run = tmp_path / "probe" / "learnable" / "version_0"
    rows = [json.loads(line) for line in open(run / "passkey.jsonl")]
    assert [(r["step"], r["length"], r["depth"], r["trials"]) for r in rows] == [
        (2, n, d, 2) for n in (96, 192) for d in (0.0, 1.0)
    ]
    # a 96-position table cannot decode past its prompt of 96 tokens, let alone read 192: recorded, not a crash
    assert all(r["accuracy"] is None and r["pe"] == "learnable" for r in rows)
    events = EventAccumulator(str(run), size_guidance={"images": 0})
    events.Reload()
    assert {"passkey/accuracy", "val_loss_vs_position", "val_ppl_vs_length"} <= set(events.Tags()["images"])
    # validate on a checkpoint: one command, other lengths, rows carry the checkpoint's step and path
    main(["fit", *cli_args(tiny_corpus_dir, runs, pe="nope")])
    ckpt = str(tmp_path / "probe" / "nope" / "checkpoints" / "last.ckpt")
    assert not (tmp_path / "probe" / "nope" / "version_0" / "passkey.jsonl").exists()  # off unless enabled
    main(
        [
            "validate",
            *cli_args(tiny_corpus_dir, runs, pe="nope"),
            "--ckpt_path",
            ckpt,
            "--passkey.enabled",
            "true",
            "--passkey.lengths",
            "[100, 200]",
        ]
    )
    rows = [json.loads(line) for line in open(tmp_path / "probe" / "nope" / "version_1" / "passkey.jsonl")]
    assert {(r["length"], r["depth"]) for r in rows} == {(n, d) for n in (100, 200) for d in (0.0, 1.0)}
    assert all(r["step"] == 2 and r["checkpoint"] == os.path.abspath(ckpt) and r["correct"] in (0, 1, 2) for r in rows)
    with pytest.raises(ConfigError, match=r"passkey.depths must be fractions in \[0, 1\].*\[0.5, 2.0\]"):
        main(
            [
                "validate",
                *cli_args(tiny_corpus_dir, runs, pe="nope"),
                "--ckpt_path",
                ckpt,
                "--passkey.depths",
                "[0.5, 2.0]",
            ]
        )


def test_recipe_config_starts_from_the_checkpoint_weights_and_refuses_another_model(tiny_corpus_dir, tmp_path):
    recipe = yaml.safe_load(open(os.path.join(ROOT, "configs", "passkey_finetune.yaml")))
    assert recipe["data"]["passkey_fraction"] > 0 and recipe["passkey"]["enabled"] is True
    runs = str(tmp_path)
    base = main(["fit", *cli_args(tiny_corpus_dir, runs, pe="alibi", experiment="base")])
    ckpt = str(tmp_path / "base" / "alibi" / "checkpoints" / "last.ckpt")
    tuned = main(
        [
            "fit",
            "--config",
            os.path.join(ROOT, "configs", "passkey_finetune.yaml"),
            *cli_args(tiny_corpus_dir, runs, pe="alibi", experiment="tuned", steps=1),
            "--model.init_args.lr",
            "0",
            "--model.init_args.min_lr",
            "0",
            "--model.init_args.init_weights",
            ckpt,
            "--passkey.enabled",
            "false",
        ]
    )
    assert tuned.datamodule.passkey_fraction == recipe["data"]["passkey_fraction"]
    for (name, p), q in zip(base.model.backbone.named_parameters(), tuned.model.backbone.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=0, msg=name)  # lr 0: still exactly the checkpoint's weights
    with pytest.raises(
        ConfigError,
        match=r"init_weights .* is of another model: pos_encoding \(checkpoint 'alibi', configured 'rope'\)",
    ):
        main(
            [
                "fit",
                *cli_args(tiny_corpus_dir, runs, pe="rope", experiment="wrong"),
                "--model.init_args.init_weights",
                ckpt,
            ]
        )


def test_report_puts_passkey_accuracy_beside_the_perplexity_table(tmp_path):
    import sys

    sys.path.insert(0, os.path.join(ROOT, "tools"))
    import report

    def write(folder, name, rows):
        os.makedirs(tmp_path / folder, exist_ok=True)
        (tmp_path / folder / name).write_text("".join(json.dumps(r) + "\n" for r in rows))

    for pe in ("cable", "learnable"):
        write(
            pe,
            "length_eval.jsonl",
            [
                {
                    "pe": pe,
                    "train_length": 128,
                    "step": 9,
                    "length": 128,
                    "mode": "nonoverlap",
                    "ppl": 10.0 if pe == "cable" else 12.0,
                }
            ],
        )
    cell = {"train_length": 128, "trials": 4}
    write(
        "cable",
        "passkey.jsonl",
        [
            {**cell, "pe": "cable", "step": 5, "length": 128, "depth": d, "accuracy": 0.0} for d in (0.0, 1.0)
        ]  # superseded
        + [
            {**cell, "pe": "cable", "step": 9, "length": n, "depth": d, "accuracy": a}
            for n, d, a in [(128, 0.0, 1.0), (128, 1.0, 0.5), (256, 0.0, 0.25), (256, 1.0, 0.25)]
        ],
    )
    write(
        "learnable",
        "passkey.jsonl",
        [
            {**cell, "pe": "learnable", "step": 9, "length": n, "depth": d, "accuracy": a}
            for n, d, a in [(128, 0.0, 0.5), (128, 1.0, 0.5), (256, 0.0, None), (256, 1.0, None)]
        ],
    )
    tables = report.report([str(tmp_path)], str(tmp_path / "out"))
    assert "one run per cell, no interval" in tables["passkey"]
    assert tables["passkey"].splitlines()[:4] == [
        "| length | cable | learnable |",
        "|---|---|---|",
        "| 128 | **0.75** | 0.50 |",
        "| 256 | **0.25** | - |",
    ]
    lines = (tmp_path / "out_passkey.csv").read_text().splitlines()  # rows from before seeds: the seed is blank
    assert lines[1:3] == ["128,cable,,0.75,0.75,,,1,", "128,learnable,,0.5,0.5,,,1,"]
    assert "| 128 | **10.00** | 12.00 |" in tables["nonoverlap"]


def test_passkey_on_a_masked_lm_is_refused_before_it_runs(tiny_corpus_dir, tmp_path):
    args = cli_args(tiny_corpus_dir, str(tmp_path), pe="alibi")
    args[1] = "cable_lightning.lit.MaskedLM"
    with pytest.raises(ConfigError, match="passkey retrieval needs a causal LM"):
        main(["fit", *args, "--model.init_args.backbone.preset", "bert-base", "--passkey.enabled", "true",
              "--trainer.max_steps", "1"])
    assert not list(tmp_path.glob("probe/alibi/checkpoints/*.ckpt"))
