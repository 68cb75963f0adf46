"""Synthetic long-context tasks: generators (deterministic, exact lengths, answers where they belong), training rows
(split across ranks, resumable), answer-only loss, exact-match scoring, the effective length, the report's tables,
and one-line errors for impossible settings."""

import glob
import json
import os

import numpy as np
import pytest
import recorders
import torch
import yaml
from conftest import one_error_line

from cable_lightning.cli import main, run
from cable_lightning.data.datamodule import TokenDataModule
from cable_lightning.errors import ConfigError
from cable_lightning.eval import report
from cable_lightning.lit import CausalLM, MaskedLM
from cable_lightning.lit.modules import weighted_loss
from cable_lightning.models import BackboneConfig, build_backbone
from cable_lightning.records.io import append_records, read_records
from cable_lightning.records.schema import LengthRecord, TaskRecord
from cable_lightning.tasks.generation import EVAL, OWN_MASK_ID, OWN_VOCABULARY, TRAIN, Task, TaskMix, TaskVocabulary
from cable_lightning.tasks.scoring import (
    argmax_predictions,
    effective_length,
    masked_predictions,
    score_examples,
    task_grid,
)

ROOT = os.path.join(os.path.dirname(__file__), "..")

ALL = {"associative_recall": {}, "needle": {"keys": 3}, "variable_tracking": {}, "copy": {}}
VOCAB = TaskVocabulary.own()
M = VOCAB.markers


def mix(tasks=None):
    return TaskMix(tasks or ALL, VOCAB)


def after(ids: list, first: int, count: int, start: int = 0) -> list:
    """The ``count`` tokens after the first occurrence of ``first`` at or after ``start``."""
    at = ids.index(first, start)
    return ids[at + 1:at + 1 + count]


def expected_answer(name: str, ids: list) -> list:
    """What a task's answer must be, read back from the example's context by hand."""
    if name == "associative_recall":  # each query's key, looked up among the 8 pairs at positions 1..16
        pairs = dict(zip(ids[1:17:2], ids[2:17:2]))
        return [pairs[ids[i + 1]] for i, t in enumerate(ids) if t == M["QUERY"]]
    if name == "needle":  # the needle whose key is asked
        key = ids[ids.index(M["QUERY"]) + 1]
        at = [i for i, t in enumerate(ids) if t == M["NEEDLE"] and ids[i + 1] == key]
        assert len(at) == 1
        return ids[at[0] + 2:at[0] + 4]
    if name == "variable_tracking":  # follow the chain from the queried value
        value, chain = ids[ids.index(M["QUERY"]) + 1], []
        assigned = {ids[i + 2]: ids[i + 1] for i, t in enumerate(ids) if t == M["ASSIGN"]}
        while value in assigned:
            value = assigned[value]
            chain.append(value)
        return chain
    return after(ids, M["COPY"], 8)  # the span after the first COPY


@pytest.mark.parametrize("length", [0, 65, 300])
def test_every_task_has_the_exact_length_and_its_answer_where_it_belongs(length):
    tasks = mix()
    for task in tasks.tasks:
        n = length or task.fixed_tokens(VOCAB) + 1  # 0: the shortest possible example; one token fewer is refused
        if not length:
            with pytest.raises(ConfigError, match=f"needs a length of at least {n - 1} tokens, got {n - 2}"):
                tasks.example(n - 1, 3, TRAIN, 0, task=task)
        for index in range(20):
            e = tasks.example(n, 3, TRAIN, index, task=task)
            ids = e.ids.tolist()
            assert len(ids) == len(e.answer) == n and e.ids.dtype == np.int64
            answer = e.ids[e.answer].tolist()
            assert answer == expected_answer(task.name, ids), (task.name, ids)
            asked = len(ids) - 1 - ids[::-1].index(M["COPY"]) if task.name == "copy" else ids.index(M["QUERY"])
            assert e.answer[-1] and not e.answer[:asked + 1].any()  # every answer after the question starts
            assert set(ids[1:]) - set(VOCAB.filler.tolist()) <= set(M.values()) | set(VOCAB.symbols.tolist())
            assert max(ids) < OWN_VOCABULARY


@pytest.mark.parametrize("depth", [0.0, 0.25, 0.5, 1.0])
def test_the_asked_needle_sits_at_its_depth_of_the_filler_and_the_distance_grows_with_length(depth):
    tasks = mix({"needle": {"keys": 1, "value_tokens": 2}})
    for length in (65, 257, 1025):
        e = tasks.example(length, 0, EVAL, 5, depth=depth)
        filler = length - 1 - tasks.tasks[0].fixed_tokens(VOCAB)
        needle = e.ids.tolist().index(M["NEEDLE"])
        assert needle - 1 == round(depth * filler)  # after the leading token, round(depth x filler) filler tokens
        assert e.depth == depth


def test_examples_are_fixed_by_seed_split_and_index():
    a, b = mix(), mix()
    for index in range(8):
        assert np.array_equal(a.example(129, 5, TRAIN, index).ids, b.example(129, 5, TRAIN, index).ids)
    assert not np.array_equal(a.example(129, 5, TRAIN, 0).ids, a.example(129, 6, TRAIN, 0).ids)  # another seed
    assert not np.array_equal(a.example(129, 5, TRAIN, 0).ids, a.example(129, 5, EVAL, 0).ids)  # another split
    assert [a.example(129, 5, TRAIN, i).ids[-1] for i in range(4)] != [a.example(129, 5, TRAIN, 0).ids[-1]] * 4


def test_training_rows_are_distinct_examples_across_ranks_and_batches():
    tasks, seen = mix(), {}
    for batch in range(3):
        for rank in range(2):
            ids, answer = tasks.training_rows(65, 1, batch, rank, 2, 4)
            for row in range(4):
                index = (batch * 2 + rank) * 4 + row
                assert np.array_equal(ids[row], tasks.example(65, 1, TRAIN, index).ids)
                seen[ids[row].tobytes()] = index
    assert sorted(seen.values()) == list(range(24))  # 24 rows, 24 different examples, none shared


def test_the_task_vocabulary_from_a_tokenizer_leaves_its_special_ids_out():
    vocab = TaskVocabulary.from_ids(512, special_ids=(0, 3, 200))
    used = list(vocab.markers.values()) + vocab.symbols.tolist() + vocab.filler.tolist()
    assert sorted(used) == [i for i in range(512) if i not in (0, 3, 200)]
    with pytest.raises(ConfigError, match="tasks need at least 132 non-special token ids; the vocabulary has 99"):
        TaskVocabulary.from_ids(100, special_ids=(0,))


# --- scoring --------------------------------------------------------------------------------------------------------


def oracle(ids, answer):
    """Predicts every example's own tokens."""
    return ids[:, 1:]


def constant(token: int):
    return lambda ids, answer: torch.full_like(ids[:, 1:], token)


def test_an_oracle_scores_one_a_constant_zero_and_a_forced_answer_is_right_exactly_where_it_is():
    tasks = mix({"needle": {"keys": 2, "value_tokens": 1}, "associative_recall": {}})
    examples = [tasks.example(97, 0, EVAL, i, task=tasks.tasks[0]) for i in range(200)]
    assert all(score_examples(oracle, examples, batch_size=7))
    assert not any(score_examples(constant(M["QUERY"]), examples))
    forced = int(examples[0].ids[-1])  # the first example's answer, which some others share by chance
    right = score_examples(constant(forced), examples)
    assert right == [e.ids[-1] == forced for e in examples] and 1 < sum(right) < 20
    grid = task_grid(constant(M["QUERY"]), tasks, [64, 96], depths=[0.0, 1.0], trials=3)
    assert [(r["task"], r["length"], r["depth"], r["accuracy"]) for r in grid] == [
        ("needle", 64, 0.0, 0.0), ("needle", 64, 1.0, 0.0), ("needle", 96, 0.0, 0.0), ("needle", 96, 1.0, 0.0),
        ("associative_recall", 64, None, 0.0), ("associative_recall", 96, None, 0.0)]


def test_argmax_predictions_are_the_backbones_most_likely_tokens_and_one_wrong_answer_token_fails():
    torch.manual_seed(0)
    backbone = build_backbone(BackboneConfig(pos_encoding="cable", n_layer=1, n_head=2, n_embd=32,
                                             vocab_size=OWN_VOCABULARY, block_size=64)).eval()
    ids = torch.from_numpy(np.stack([mix().example(41, 0, EVAL, i).ids for i in range(3)]))
    with torch.no_grad():
        assert torch.equal(argmax_predictions(backbone, chunk=16)(ids, None), backbone(ids[:, :-1]).argmax(-1))
    examples = [mix({"copy": {}}).example(60, 0, EVAL, 0)]

    def one_off(ids, answer):
        predicted = oracle(ids, answer).clone()
        predicted[:, -3] += 1  # the third-to-last answer token is wrong, every other one right
        return predicted

    assert score_examples(oracle, examples) == [True] and score_examples(one_off, examples) == [False]


# --- training on tasks ----------------------------------------------------------------------------------------------


def test_answer_only_loss_ignores_every_other_position_and_weight_one_is_the_lm_loss():
    torch.manual_seed(0)
    dm = TokenDataModule(path=None, tasks={"needle": {}}, block_size=48, micro_batch_size=3)
    model = CausalLM(BackboneConfig(pos_encoding="alibi", n_layer=1, n_head=2, n_embd=32), data=dm.describe())
    batch = dm.task_batch(torch.zeros(3, 49, dtype=torch.long), batch_number=0, rank=0, world_size=1)
    tokens, weight = batch["tokens"], batch["loss_weight"]
    assert weight.sum() == 3 * 2 and set(weight.unique().tolist()) == {0.0, 1.0}  # two value tokens a row
    nll = model.backbone.token_nll(tokens[:, :-1], tokens[:, 1:])
    answer_nll = [nll[r, c].item() for r in range(3) for c in range(48) if weight[r, c]]
    assert model.batch_loss(batch)[0].item() == pytest.approx(sum(answer_nll) / len(answer_nll), rel=1e-6)
    # a change in every non-answer target's loss changes nothing; an answer target's does
    assert weighted_loss(nll + 5.0 * (weight == 0), weight).item() == pytest.approx(sum(answer_nll) / 6, rel=1e-6)
    assert weighted_loss(nll + 5.0 * (weight == 1), weight).item() != pytest.approx(sum(answer_nll) / 6, rel=1e-6)
    dm.lm_loss_weight = 1.0
    assert model.batch_loss(dm.task_batch(tokens, 0, 0, 1))[0].item() == pytest.approx(
        model.backbone.loss(tokens[:, :-1], tokens[:, 1:]).item(), rel=1e-6)


def test_a_corpus_mix_replaces_only_its_share_of_rows_and_weighs_corpus_rows_fully(tiny_corpus_dir):
    dm = TokenDataModule(tiny_corpus_dir, block_size=64, micro_batch_size=4, tasks={"copy": {}}, task_fraction=0.5,
                         lm_loss_weight=0.25)
    info = dm.describe()
    corpus = torch.randint(0, info.vocab_size, (4, 65))
    batch = dm.task_batch(corpus, 3, 0, 1)
    assert torch.equal(batch["tokens"][2:], corpus[2:]) and (batch["loss_weight"][2:] == 1).all()
    assert np.array_equal(batch["tokens"][0].numpy(), dm.tasks.example(65, dm.seed, TRAIN, 3 * 2).ids)
    assert sorted(batch["loss_weight"][:2].unique().tolist()) == [0.25, 1.0]
    assert set(dm.tasks.vocab.symbols.tolist()).isdisjoint(info.special_ids)


def test_a_resumed_run_sees_the_rows_and_reaches_the_weights_of_an_uninterrupted_one(tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)
    record = ["--trainer.callbacks+=recorders.RecordBatches", "--checkpoint.every_n_train_steps", "2",
              "--trainer.max_steps", "4", "--model.init_args.backbone.pos_encoding", "cable"]
    recorders.BATCHES.clear(), recorders.LOSSES.clear()
    straight = main(["fit", *task_args(str(tmp_path / "a"), *record)])
    straight_batches, straight_losses = list(recorders.BATCHES), list(recorders.LOSSES)
    recorders.BATCHES.clear(), recorders.LOSSES.clear()
    main(["fit", *task_args(str(tmp_path / "b"), *record, "--trainer.callbacks+=recorders.StopAt",
                            "--trainer.callbacks.step=2")])
    assert len(recorders.BATCHES) == 2
    resumed = main(["fit", *task_args(str(tmp_path / "b"), *record, "--ckpt_path", "last")])
    assert recorders.BATCHES == straight_batches and len(set(straight_batches)) == 4
    assert recorders.LOSSES[-1] == pytest.approx(straight_losses[-1], abs=1e-6)
    for (name, p), q in zip(straight.model.named_parameters(), resumed.model.parameters()):
        torch.testing.assert_close(p, q, atol=1e-6, rtol=0, msg=name)


# --- masked LMs on tasks ---------------------------------------------------------------------------------------------


def masked_lm(dm, pe="alibi", **kwargs):
    torch.manual_seed(0)
    return MaskedLM(BackboneConfig(preset="bert-base", pos_encoding=pe, n_layer=1, n_head=2, n_embd=32),
                    data=dm.describe(), **kwargs)


def test_the_own_vocabulary_keeps_its_ids_and_adds_a_mask_that_no_example_holds():
    assert (OWN_VOCABULARY, OWN_MASK_ID) == (134, 133)
    # the ids of markers, symbols and filler are the ones decoders were trained on before the mask was added
    assert list(M.values()) == [1, 2, 3, 4] and VOCAB.symbols.tolist() == list(range(5, 69))
    assert VOCAB.filler.tolist() == list(range(69, 133))
    info = TokenDataModule(path=None, tasks={"copy": {}}, block_size=48).describe()
    assert info.mask_id == OWN_MASK_ID and OWN_MASK_ID in info.special_ids
    rows, _ = mix().training_rows(97, 0, 0, 0, 1, 40)
    assert rows.max() < OWN_MASK_ID and rows.min() > 0


@pytest.mark.parametrize("lm_loss_weight", [0.0, 1.0])
def test_a_masked_lm_reads_every_answer_masked_and_nothing_of_the_answer_reaches_its_input(lm_loss_weight):
    dm = TokenDataModule(path=None, tasks=ALL, block_size=96, micro_batch_size=8, lm_loss_weight=lm_loss_weight)
    # every non-special token chosen: 80% masked, 10% swapped, 10% kept; an answer must still always be masked
    model = masked_lm(dm, mask_probability=1.0)
    seen = []
    token_nll = model.backbone.token_nll
    model.backbone.token_nll = lambda inputs, labels, **kw: seen.append((inputs, labels)) or token_nll(inputs, labels)
    batch = dm.task_batch(torch.zeros(8, 97, dtype=torch.long), batch_number=0, rank=0, world_size=1)
    ids, answer = batch["tokens"][:, 1:], batch["answer"]
    assert answer.sum(1).tolist() == [4, 2, 3, 8] * 2  # recall's four values, the needle's two, three hops, the span
    loss, inputs = model.batch_loss(batch)
    _, labels = seen[-1]
    assert (inputs[answer] == OWN_MASK_ID).all() and torch.equal(labels[answer], ids[answer])
    # the same batch with other answers: the model's input is the same, token for token
    other = batch["tokens"].clone()
    other[:, 1:][answer] = torch.from_numpy(VOCAB.symbols)[(ids[answer] - 4) % 64]
    assert not torch.equal(other, batch["tokens"])
    assert torch.equal(model.batch_loss({**batch, "tokens": other})[1], inputs)
    nll = token_nll(inputs, labels)
    if lm_loss_weight == 0:  # the context is left whole, and the loss is the answers' alone
        assert torch.equal(inputs[~answer], ids[~answer])
        assert loss.item() == pytest.approx(nll[answer].mean().item(), rel=1e-6)
    else:  # the other tokens are masked too, and every chosen one counts
        assert (inputs[~answer] == OWN_MASK_ID).float().mean() > 0.7 and (labels != -100).all()
        assert loss.item() == pytest.approx(nll.mean().item(), rel=1e-6)


def test_a_masked_lm_is_asked_with_every_answer_token_masked():
    dm = TokenDataModule(path=None, tasks={"copy": {}}, block_size=48)
    model = masked_lm(dm, pe="cable").eval()
    examples = [mix({"copy": {}, "needle": {}}).example(49, 0, EVAL, i) for i in range(4)]
    ids = torch.from_numpy(np.stack([e.ids for e in examples]))
    answer = torch.from_numpy(np.stack([e.answer for e in examples]))[:, 1:]
    predict = model.task_predictions()
    with torch.no_grad():
        assert torch.equal(predict(ids, answer), model.backbone(ids[:, 1:].masked_fill(answer, OWN_MASK_ID)).argmax(-1))

    class Copier:  # a model that returns its input: right only if the answer were in it
        def argmax_tokens(self, inputs, chunk, layout=None):
            return inputs

    assert not any(score_examples(masked_predictions(Copier(), OWN_MASK_ID), examples))


def test_an_encoder_fit_on_tasks_writes_accuracy_at_every_length(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(ROOT)
    args = task_args(str(tmp_path), "--model.init_args.backbone.pos_encoding", "alibi")
    args[2:2] = ["--config", "configs/tasks/encoder.yaml"]
    cli = main(["fit", *args])
    # answers alone were trained on: the perplexity of the other tokens is no sign of a broken run
    assert "worse than guessing" not in capsys.readouterr().err
    assert isinstance(cli.model, MaskedLM) and cli.model.mask_id == OWN_MASK_ID
    rows = [json.loads(line) for line in open(os.path.join(cli.trainer.log_dir, TaskRecord.FILE))]
    assert [(r["task"], r["length"], r["depth"]) for r in rows] == [
        ("associative_recall", n, None) for n in (48, 96)] + [("needle", n, d) for n in (48, 96) for d in (0.0, 1.0)]
    assert all(r["accuracy"] is not None for r in rows)


# --- the effective length and the report ----------------------------------------------------------------------------


def test_the_effective_length_is_the_last_length_before_accuracy_first_falls_short():
    assert effective_length({64: 1.0, 128: 0.9, 256: 0.85, 512: 0.5, 1024: 0.95}, 64) == 256  # 1024 comes too late
    assert effective_length({32: 0.1, 64: 0.9, 128: 0.2}, 64) == 64  # a shorter length does not count
    assert effective_length({64: 0.8, 128: 1.0}, 64) is None  # the training length falls short
    assert effective_length({64: 1.0, 128: None}, 64) == 64  # a length the encoding cannot serve ends it
    assert effective_length({128: 1.0}, 64) is None  # the training length was not evaluated
    assert effective_length({64: 0.9, 128: 0.9}, 64, threshold=0.95) is None


def write_task_run(folder, pe, seed, accuracy: dict, step=10):
    rows = [TaskRecord(pe=pe, train_length=64, step=step, run_seed=seed, task=task, length=length, depth=depth,
                       accuracy=value, trials=10, correct=None if value is None else round(10 * value))
            for (task, length, depth), value in accuracy.items()]
    append_records(str(folder), rows + [LengthRecord(pe=pe, train_length=64, step=step, run_seed=seed, length=64,
                                                     mode="nonoverlap", ppl=100.0)])


def test_report_tables_task_accuracy_with_seed_intervals_and_effective_lengths(tmp_path):
    for seed in (0, 1):
        shift = 0.2 * seed
        write_task_run(tmp_path / "cable" / f"seed{seed}", "cable", seed, {
            ("needle", 64, 0.0): 1.0, ("needle", 64, 1.0): 0.8 + shift, ("needle", 128, 0.0): 1.0,
            ("needle", 128, 1.0): 0.6 + 1.5 * shift, ("associative_recall", 64, None): 1.0,
            ("associative_recall", 128, None): 0.5})
        write_task_run(tmp_path / "rope" / f"seed{seed}", "rope", seed, {
            ("needle", 64, 0.0): 0.5, ("needle", 64, 1.0): 0.5, ("needle", 128, 0.0): None, ("needle", 128, 1.0): 0.0,
            ("associative_recall", 64, None): 0.95 - shift / 4, ("associative_recall", 128, None): 0.95 - 2 * shift})
    # an earlier evaluation of the same run is not reported
    write_task_run(tmp_path / "rope" / "seed0", "rope", 0, {("associative_recall", 64, None): 0.0}, step=5)
    tables = report.report([str(tmp_path)], str(tmp_path / "out"), threshold=0.85)
    needle = tables["task needle"]
    # cable's needle at 64: depths averaged per run (0.9, 1.0), then a t-interval over the two seeds; rope cannot
    # serve one cell at 128
    assert "| 64 | **0.95 [" in needle and needle.splitlines()[3].endswith("| - |"), needle
    lines = {line.split(" | ")[0]: line for line in tables["effective length"].splitlines()}
    # from the mean over seeds, then each seed's in brackets: cable's needle (mean 0.95 then 0.875; seeds 0.9, 0.8 and
    # 1.0, 0.95), recall 1.0 then 0.5; rope's needle falls short at 64, its recall (mean 0.925, then 0.75; seeds 0.95,
    # 0.95 and 0.9, 0.55)
    assert lines["| associative_recall"] == "| associative_recall | 64 (64, 64) | 64 (128, 64) |"
    assert lines["| needle"] == "| needle | 128 (64, 128) | - (-, -) |"
    stricter = report.report([str(tmp_path)], str(tmp_path / "strict"), threshold=0.95)["effective length"]
    assert "| needle | 64 (-, 128) | - (-, -) |" in stricter, stricter
    rows = read_records(str(tmp_path / "cable" / "seed0" / TaskRecord.FILE), TaskRecord)
    assert {(r.task, r.depth) for r in rows} == {("needle", 0.0), ("needle", 1.0), ("associative_recall", None)}


# --- through the CLI ------------------------------------------------------------------------------------------------


def task_args(runs, *extra):
    return ["--config", "configs/tasks/base.yaml", "--config", "configs/tasks/recall_needle.yaml",
            "--runs_dir", runs, "--trainer.max_steps", "2", "--checkpoint.every_n_train_steps", "2",
            "--data.block_size", "48", "--data.micro_batch_size", "4", "--data.eval_lengths", "[48, 96]",
            "--data.eval_tokens", "96", "--task_eval.trials", "3", "--task_eval.depths", "[0.0, 1.0]",
            "--model.init_args.backbone.n_layer", "1", "--trainer.enable_progress_bar", "false",
            "--trainer.enable_model_summary", "false", *extra]


def test_fit_and_validate_write_task_accuracy_at_every_checkpoint(tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)
    runs = str(tmp_path)
    main(["fit", *task_args(runs, "--model.init_args.backbone.pos_encoding", "rope")])
    run_dir = tmp_path / "tasks-recall_needle" / "rope" / "version_0"
    rows = [json.loads(line) for line in open(run_dir / TaskRecord.FILE)]
    assert [(r["step"], r["task"], r["length"], r["depth"], r["trials"]) for r in rows] == [
        (2, "associative_recall", n, None, 3) for n in (48, 96)] + [
        (2, "needle", n, d, 3) for n in (48, 96) for d in (0.0, 1.0)]
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run_dir), size_guidance={"images": 0}).Reload()
    assert "tasks/accuracy" in events.Tags()["images"] and "tasks/needle/len_96" in events.Tags()["scalars"]
    ckpt = glob.glob(str(tmp_path / "tasks-recall_needle" / "rope" / "checkpoints" / "step*.ckpt"))[0]
    main(["validate", *task_args(runs, "--model.init_args.backbone.pos_encoding", "rope", "--ckpt_path", ckpt,
                                 "--data.eval_lengths", "[192]")])
    rows = [json.loads(line) for line in open(tmp_path / "tasks-recall_needle" / "rope" / "version_1" /
                                              TaskRecord.FILE)]
    assert {(r["stage"], r["length"], r["step"]) for r in rows} == {("validate", 192, 2)}


def test_tensorboard_hparams_hold_the_run_settings_with_its_perplexities_and_task_scores(tmp_path, monkeypatch):
    """TensorBoard's HParams tab compares a sweep's runs: each run's settings, with its perplexity at each evaluated
    length and its task scores as the metrics (the tab shows each metric tag's last scalar: the last evaluation's),
    and no placeholder hp_metric."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.plugins.hparams import metadata

    monkeypatch.chdir(ROOT)
    main(["fit", *task_args(str(tmp_path), "--model.init_args.backbone.pos_encoding", "rope",
                            "--trainer.max_steps", "4")])
    run_dir = tmp_path / "tasks-recall_needle" / "rope" / "version_0"
    events = EventAccumulator(str(run_dir), size_guidance={"images": 0, "scalars": 0}).Reload()
    assert "hp_metric" not in events.Tags()["scalars"]
    content = events.PluginTagToContent(metadata.PLUGIN_NAME)
    session = metadata.parse_session_start_info_plugin_data(content[metadata.SESSION_START_INFO_TAG]).hparams
    assert (session["encoding"].string_value, session["lr"].number_value, session["tasks"].string_value,
            session["experiment"].string_value) == ("rope", 1e-3, "associative_recall+needle", "tasks-recall_needle")
    metrics = metadata.parse_experiment_plugin_data(content[metadata.EXPERIMENT_TAG]).metric_infos
    lengths = read_records(str(run_dir / LengthRecord.FILE), LengthRecord)
    tasks = read_records(str(run_dir / TaskRecord.FILE), TaskRecord)
    assert {r.step for r in lengths} == {r.step for r in tasks} == {2, 4}  # the metrics were named at step 2
    expected = {f"val_ppl/len_{r.length}": r.ppl for r in lengths if r.step == 4}
    for n in (48, 96):
        for task in ("associative_recall", "needle"):
            cells = [r.accuracy for r in tasks if r.step == 4 and r.task == task and r.length == n]
            expected[f"tasks/{task}/len_{n}"] = sum(cells) / len(cells)
    assert sorted(m.name.tag for m in metrics) == sorted(expected) and len(expected) == 6
    assert {tag: events.Scalars(tag)[-1].value for tag in expected} == pytest.approx(expected, rel=1e-5)
    assert (session["stage"].string_value, session["step"].number_value) == ("fit", 0)
    # a validation of the run adds a row of the same settings: it says its stage and its checkpoint's step
    ckpt = tmp_path / "tasks-recall_needle" / "rope" / "checkpoints" / "step0000002.ckpt"
    main(["validate", *task_args(str(tmp_path), "--model.init_args.backbone.pos_encoding", "rope", "--ckpt_path",
                                 str(ckpt))])
    events = EventAccumulator(str(run_dir.parent / "version_1")).Reload()
    content = events.PluginTagToContent(metadata.PLUGIN_NAME)
    session = metadata.parse_session_start_info_plugin_data(content[metadata.SESSION_START_INFO_TAG]).hparams
    assert (session["stage"].string_value, session["step"].number_value) == ("validate", 2)


@pytest.mark.parametrize("settings, message", [
    (dict(tasks={"associative_recall": {"pairs": 20, "queries": 4}}),
     "data.block_size 48 is too short for a task: task associative_recall (pairs=20, queries=4) needs a length of "
     "at least 52 tokens, got 48"),
    (dict(tasks={"needle": {}, "recall": {}}),
     "unknown task 'recall'; valid tasks: " + ", ".join(sorted(Task.registry))),
    (dict(tasks={"needle": {"depth": 0.5}}), "task needle has no setting 'depth' (its settings: keys, value_tokens)"),
    (dict(tasks={"associative_recall": {"pairs": 4, "queries": 5}}),
     "associative_recall needs 1 <= queries <= pairs <= 64, got pairs=4, queries=5"),
    (dict(tasks={"needle": {}}, task_fraction=0.5), "data.path is null, which only a run of tasks alone can be"),
    (dict(tasks={}), "data.tasks is empty; name at least one task: " + ", ".join(sorted(Task.registry))),
    (dict(tasks={"needle": {"keys": "two"}}), "task needle setting keys must be an integer, got 'two'"),
    (dict(tasks={"needle": 2}), "task needle: settings must be a mapping ({setting: value}), got 2; its settings: "
                                "keys, value_tokens"),
    (dict(tasks={"copy": {}}, lm_loss_weight=2.0), "lm_loss_weight must be in [0, 1], got 2.0"),
])
def test_impossible_task_settings_are_refused_in_one_line(settings, message):
    with pytest.raises(ConfigError) as error:
        TokenDataModule(path=None, block_size=48, **settings)
    assert message in str(error.value) and "\n" not in str(error.value)


@pytest.mark.parametrize("extra, message", [
    (["--data.tasks", '{"needle": {}, "recall": {}}'], "unknown task 'recall'; valid tasks: associative_recall, "),
    (["--data.tasks", '{"needle": {"keys": "two"}}'], "error: task needle setting keys must be an integer, got 'two'"),
    (["--data.eval_lengths", "[16, 48]"], "evaluation length 16 is too short for a task: task associative_recall "
     "(pairs=4, queries=4) needs a length of at least 20 tokens, got 16"),
])
def test_the_command_line_refuses_them_before_training(tmp_path, capsys, monkeypatch, extra, message):
    monkeypatch.chdir(ROOT)
    line = one_error_line(capsys, lambda: run(["fit", *task_args(str(tmp_path), *extra)]))
    assert message in line, line
    assert not glob.glob(str(tmp_path / "**" / "*.ckpt"), recursive=True)


@pytest.mark.parametrize("task", ["associative_recall", "needle", "variable_tracking", "copy", "recall_needle"])
def test_each_task_config_composes_with_the_base_and_builds_its_data(task, capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    with pytest.raises(SystemExit) as done:
        main(["fit", "--config", "configs/tasks/base.yaml", "--config", f"configs/tasks/{task}.yaml", "--print_config"])
    assert done.value.code in (None, 0)
    data = yaml.safe_load(capsys.readouterr().out)["data"]
    dm = TokenDataModule(**data)  # the tasks, their settings and the training length fit together
    assert [t.name for t in dm.tasks.tasks] == list(data["tasks"]) and dm.describe().vocab_size == OWN_VOCABULARY
