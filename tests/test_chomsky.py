"""The Chomsky-hierarchy tasks (docs/chomsky.md): every generator against a slow, obvious reference computed from the
example's own input tokens; one input length per training batch; per-token scoring that stops at a terminator; the
report's score table (mean, interval and maximum over seeds, per learning rate); randomized positions in training
and evaluation for every encoding that reads positions; one-line errors."""

import dataclasses
import itertools
import json
import os
from dataclasses import replace

import numpy as np
import pytest
import torch

from cable_lightning.cli import main, run
from cable_lightning.data.datamodule import TokenDataModule
from cable_lightning.errors import ConfigError
from cable_lightning.eval.comparable import latest_rows, rows_by_step
from cable_lightning.eval.report import report
from cable_lightning.eval.task_tables import algorithmic_scores, algorithmic_table, algorithmic_training_table
from cable_lightning.lit import MaskedLM
from cable_lightning.models import BackboneConfig
from cable_lightning.positional import available, encoding_class
from cable_lightning.records.io import append_records, find_records
from cable_lightning.records.schema import LengthRecord, RunKey, TaskRecord
from cable_lightning.sweep import main as sweep_main
from cable_lightning.tasks.chomsky import OUTPUT_OFFSET, AlgorithmicTask
from cable_lightning.tasks.generation import EVAL, TRAIN, Task, TaskMix, TaskVocabulary
from cable_lightning.tasks.scoring import task_grid

ROOT = os.path.join(os.path.dirname(__file__), "..")
VOCAB = TaskVocabulary.own()
TASKS = sorted(name for name, cls in Task.registry.items() if issubclass(cls, AlgorithmicTask))


def reference(name: str, x: list[int], length: int) -> list[int]:
    """The output, worked out the slow, obvious way from the input symbols alone."""
    if name == "even_pairs":
        return [int(sum(a != b for a, b in zip(x, x[1:])) % 2 == 0)]
    if name == "parity_check":
        return [x.count(1) % 2]
    if name == "cycle_navigation":
        state = 0
        for a in x:
            state = {0: (state - 1) % 5, 1: state, 2: (state + 1) % 5}[a]
        return [state]
    if name == "modular_arithmetic":  # Python evaluates * before + and -, as the task does
        text = "".join(str(s) if s < 5 else "+-*"[s - 5] for s in x)
        return [eval(text) % 5]
    if name == "modular_arithmetic_brackets":  # Python reads the brackets, unary minus and * as the grammar does
        return [eval("".join("01234+-*()"[s] for s in x)) % 5]
    if name == "solve_equation":  # try every digit for x: exactly one balances the equation
        if length < 3:
            return [0]
        left, right = "".join("01234+-()x="[s] for s in x).split("=")
        solutions = [d for d in range(5) if eval(left.replace("x", str(d))) % 5 == int(right)]
        assert len(solutions) == 1, (left, right, solutions)
        return solutions
    if name == "reverse_string":
        return [x[i] for i in range(len(x) - 1, -1, -1)]
    if name == "duplicate_string":
        return x * 2
    if name == "odds_first":
        return [x[i] for i in range(len(x)) if i % 2 == 1] + [x[i] for i in range(len(x)) if i % 2 == 0]
    if name == "bucket_sort":
        return [s for s in range(5) for _ in range(x.count(s))]
    if name == "missing_duplicate":
        if length == 1:
            return [1]
        half = length // 2
        at = x.index(2)
        return [x[(at + half) % (2 * half)]]
    if name == "stack_manipulation":
        if length == 1:
            return x + [2]
        bottom = [s for s in itertools.takewhile(lambda s: s < 2, x)]
        stack = "".join(map(str, bottom))
        for action in x[len(bottom):]:
            stack = stack[:-1] if action == 2 else stack + str(action - 3)
        out = [int(c) for c in reversed(stack)] + [2]
        return out + [0] * (length + 1 - len(out))
    if name == "binary_addition":
        if length <= 2:
            total = int("".join(map(str, reversed(x))), 2)
        else:
            plus = x.index(2)
            total = sum(int("".join(map(str, reversed(part))), 2) for part in (x[:plus], x[plus + 1:]))
        out = [int(c) for c in reversed(bin(total)[2:])] + [2]
        return out + [0] * (length + 1 - len(out))
    if name == "binary_multiplication":
        if length <= 2:
            out = [0] * (length - 1)
        else:
            times = x.index(2)
            product = 1
            for part in (x[:times], x[times + 1:]):
                product *= sum(bit << i for i, bit in enumerate(part))
            out = [int(c) for c in reversed(bin(product)[2:])]
        return out + [2] + [0] * (length - 1 - len(out))
    if name == "compute_sqrt":
        value = int("".join(map(str, x)), 2)
        root = max(r for r in range(value + 1) if r * r <= value)  # slow: every candidate
        return [int(c) for c in bin(root)[2:].zfill((length + 1) // 2)]
    raise AssertionError(f"no reference for {name}")


def split(example, task):
    """(input symbols, output classes) read back from an example's ids."""
    ids = example.ids.tolist()
    symbols = VOCAB.symbols.tolist()
    first = np.flatnonzero(example.answer)[0]
    return [symbols.index(i) for i in ids[1:first]], [symbols.index(i) - OUTPUT_OFFSET for i in ids[first:]]


def test_the_registry_holds_the_papers_tasks_at_their_levels():
    levels = {name: Task.registry[name].level for name in TASKS}
    assert levels == {"even_pairs": "R", "modular_arithmetic": "R", "parity_check": "R", "cycle_navigation": "R",
                      "stack_manipulation": "DCF", "reverse_string": "DCF", "modular_arithmetic_brackets": "DCF",
                      "solve_equation": "DCF", "duplicate_string": "CS",
                      "missing_duplicate": "CS", "odds_first": "CS", "binary_addition": "CS", "bucket_sort": "CS",
                      "binary_multiplication": "CS", "compute_sqrt": "CS"}


@pytest.mark.parametrize("name", TASKS)
def test_every_answer_matches_the_reference_at_small_lengths(name):
    mix = TaskMix({name: {}}, VOCAB)
    task = mix.tasks[0]
    for length in range(1, 13):
        for index in range(25):
            example = mix.example(length, 7, TRAIN, index)
            x, y = split(example, task)
            expected_inputs = length - (name == "modular_arithmetic" and length % 2 == 0)  # cut to an odd length
            assert len(x) == expected_inputs and max(x) < task.inputs
            assert y == reference(name, x, length), (name, length, x)
            assert len(y) == task.output_length(length) == example.answer.sum()
            scored = example.scored[example.answer].tolist()
            if task.terminated:  # up to and with the terminator, nothing after it
                end = y.index(task.outputs - 1)
                assert scored == [True] * (end + 1) + [False] * (len(y) - end - 1)
            else:
                assert all(scored)
            assert not example.scored[~example.answer].any()


@pytest.mark.parametrize("name", TASKS)
def test_examples_are_fixed_by_seed_split_index_and_length_and_vary_otherwise(name):
    mix = TaskMix({name: {}}, VOCAB)
    first = mix.example(9, 3, EVAL, 4)
    assert np.array_equal(first.ids, mix.example(9, 3, EVAL, 4).ids)
    inputs = {tuple(split(mix.example(9, 3, EVAL, i), None)[0]) for i in range(40)}
    assert len(inputs) > 20  # 40 draws of an input of 9 symbols: almost all distinct
    assert not np.array_equal(first.ids, mix.example(9, 3, TRAIN, 4).ids)


def test_short_inputs_take_every_value():
    """At length 3, uniform bits reach all 8 inputs, and the stack's split and the addition's split vary."""
    for name in ("parity_check", "reverse_string", "odds_first"):
        mix = TaskMix({name: {}}, VOCAB)
        assert len({tuple(split(mix.example(3, 0, TRAIN, i), None)[0]) for i in range(200)}) == 8
    stack = TaskMix({"stack_manipulation": {}}, VOCAB)
    bottoms = {sum(s < 2 for s in split(stack.example(6, 0, TRAIN, i), None)[0][:5]) for i in range(200)}
    assert {1, 5} <= bottoms  # initial stacks of 1 to length - 1 symbols


def test_a_training_batch_has_one_input_length_drawn_uniformly_from_1_to_the_block_size():
    dm = TokenDataModule(path=None, tasks={"reverse_string": {}}, block_size=40, micro_batch_size=4)
    blank = torch.zeros(4, 41, dtype=torch.long)
    lengths = []
    for batch_number in range(400):
        batch = dm.task_batch(blank, batch_number, rank=0, world_size=1)
        n = int(batch["answer"][0].sum())  # reverse string: as many outputs as inputs
        assert batch["tokens"].shape == (4, 1 + 2 * n) and (batch["answer"].sum(1) == n).all()
        assert torch.equal(batch["loss_weight"], batch["answer"].float())
        lengths.append(n)
    assert set(lengths) == set(range(1, 41))
    again = dm.task_batch(blank, 17, rank=0, world_size=1)  # a resumed run makes the same batch
    other_rank = dm.task_batch(blank, 17, rank=1, world_size=2)
    assert torch.equal(again["tokens"], dm.task_batch(blank, 17, rank=0, world_size=1)["tokens"])
    assert other_rank["tokens"].shape == again["tokens"].shape and not torch.equal(other_rank["tokens"],
                                                                                    again["tokens"])


def test_per_token_accuracy_counts_the_output_up_to_its_terminator():
    mix = TaskMix({"binary_addition": {}}, VOCAB)
    examples = {t: mix.example(12, 0, EVAL, t) for t in range(4)}

    def right_then_wrong_after_terminator(ids, answer):
        predicted = ids[:, 1:].clone()
        scored = torch.from_numpy(np.stack([examples[t].scored for t in range(4)]))[:, 1:]
        predicted[answer & ~scored] = 0  # wrong, where nothing is scored
        return predicted

    [row] = task_grid(right_then_wrong_after_terminator, mix, [12], trials=4)
    assert (row["accuracy"], row["correct"], row["scoring"]) == (1.0, 4, "per_token")

    def first_output_wrong(ids, answer):
        predicted = ids[:, 1:].clone()
        first = answer.int().argmax(1)
        predicted[torch.arange(len(ids)), first] = 0
        return predicted

    [row] = task_grid(first_output_wrong, mix, [12], trials=4)
    scored = [examples[t].scored.sum() for t in range(4)]
    assert row["correct"] == 0 and row["accuracy"] == pytest.approx(np.mean([1 - 1 / n for n in scored]))


@pytest.mark.parametrize("settings, message", [
    (dict(tasks={"reverse_string": {}, "parity_check": {}}),
     "an algorithmic task trains alone; data.tasks names reverse_string, parity_check: give one"),
    (dict(tasks={"reverse_string": {}}, path="data/pydocs-bpe4096"),
     "task reverse_string is algorithmic: it trains alone, in the tasks' own vocabulary; set data.path null "
     "(got 'data/pydocs-bpe4096')"),
    (dict(tasks={"reverse_string": {"length": 3}}), "task reverse_string has no setting 'length' (its settings: none)"),
])
def test_impossible_settings_are_refused_in_one_line(settings, message):
    with pytest.raises(ConfigError) as error:
        TokenDataModule(**{"path": None, "block_size": 40, **settings})
    assert str(error.value) == message


def record(pe, seed, lr, length, accuracy, task="parity_check"):
    return TaskRecord(pe=pe, train_length=40, step=10, run_seed=seed, lr=lr, task=task, length=length, depth=None,
                      accuracy=accuracy, trials=8, correct=0, scoring="per_token")


def test_the_report_scores_the_lengths_above_training_with_mean_interval_and_max_over_seeds():
    rows = [record(pe, seed, lr, length, accuracy)
            for pe, base in (("rope", 0.6), ("nope", 0.5)) for lr in (1e-4, 5e-4) for seed in (0, 1, 2)
            for length, accuracy in ((40, 1.0), (41, base + 0.1 * seed), (80, base + 0.1 * seed - 0.1 * (lr > 2e-4)))]
    scores = algorithmic_scores(rows)
    key = RunKey("rope", 40, 2, 1e-4, None, corpus=None, recipe=None, task="parity_check")
    assert scores[key] == pytest.approx(0.8)  # 40: not a test length
    table = algorithmic_table(rows).splitlines()
    assert table[0] == ("| task | nope lr=0.0001 | nope lr=0.0005 | rope lr=0.0001 | rope lr=0.0005 | "
                        "nope max over seeds and lrs | rope max over seeds and lrs |")
    cells = [c.strip() for c in table[2].split("|")[2:-1]]
    assert cells[2] == "**70.0 [45.2, 94.8], max 80.0 (n=3)**"  # rope at 1e-4: 60, 70, 80 over three seeds: best
    assert cells[3].startswith("65.0 [") and cells[4:] == ["70.0", "80.0"]  # 5 points below in every seed: separated
    table = algorithmic_table(rows + [record("alibi", 0, 1e-4, 41, None)]).splitlines()  # a length it cannot serve
    header, cells = ([c.strip() for c in line.split("|")[2:-1]] for line in (table[0], table[2]))
    assert cells[header.index("alibi lr=0.0001")] == cells[header.index("alibi max over seeds and lrs")] == "-"


def test_the_table_bolds_the_best_and_every_encoding_the_seeds_cannot_separate_from_it():
    """Paired over shared seeds: alibi is 1 point below rope in seed 0 and 1 above in seed 2 (not separated), nope
    20 below in every seed (separated); cable ran one seed, which no test can separate."""
    rows = [record(pe, seed, 5e-4, 41, accuracy)
            for pe, by_seed in (("rope", (0.60, 0.70, 0.65)), ("alibi", (0.59, 0.72, 0.66)),
                                ("nope", (0.40, 0.50, 0.45)), ("cable", (0.2,)))
            for seed, accuracy in enumerate(by_seed)]
    table = algorithmic_table(rows).splitlines()
    header, cells = ([c.strip() for c in line.split("|")[2:-1]] for line in (table[0], table[2]))
    bold = {pe for pe, cell in zip(header, cells) if cell.startswith("**") and cell.endswith("**")}
    assert header == ["alibi", "cable", "nope", "rope"] and bold == {"alibi", "rope", "cable"}
    rows = [replace(r, accuracy=0.45 + 0.05 * r.run_seed) if r.pe == "alibi" else r for r in rows]  # 15 below always
    cells = [c.strip() for c in algorithmic_table(rows).splitlines()[2].split("|")[2:-1]]
    assert not cells[0].startswith("**") and cells[3].startswith("**")


def test_a_report_over_several_tasks_keeps_every_tasks_runs(tmp_path):
    """Each algorithmic task trains its own model: the same encoding and seed on two tasks are two runs, and a later
    evaluation of one does not hide the other (it did: the report kept one run per encoding and seed)."""
    for task, steps, seeds in (("bucket_sort", 600, (0, 1, 2)), ("cycle_navigation", 4000, (0,))):
        for seed in seeds:
            rows = [replace(record("rope", seed, 5e-4, length, 0.5 + 0.1 * seed, task), step=steps)
                    for length in (40, 41)]
            append_records(str(tmp_path / task / f"seed{seed}"), rows)
    rows = latest_rows(find_records([str(tmp_path)], TaskRecord.FILE), TaskRecord, lambda r: (r.task, r.length))
    table = algorithmic_table(rows).splitlines()
    assert table[2].startswith("| bucket_sort | **60.0 [") and "max 70.0 (n=3)**" in table[2]
    assert table[3] == "| cycle_navigation | **50.0, max 50.0 (n=1)** |"


def test_a_torn_last_row_leaves_out_its_evaluation_and_the_report_says_so(tmp_path, capsys):
    """A run killed as it wrote its step-2000 task rows (length 40 whole, length 41 torn): the algorithmic table is the
    step-1000 evaluation's, and one line names the file and what was left out. Before, the torn row was skipped and
    step 2000's one row was taken as the run's latest: a table with no score, without a word."""
    folder = tmp_path / "seed0"
    append_records(str(folder), [replace(record("rope", 0, 5e-4, length, accuracy), step=1000)
                                 for length, accuracy in ((40, 0.9), (41, 0.6), (80, 0.4))])
    append_records(str(folder), [replace(record("rope", 0, 5e-4, 40, 1.0), step=2000)])
    append_records(str(folder), [LengthRecord(pe="rope", train_length=40, step=step, run_seed=0, lr=5e-4, length=40,
                                              mode="nonoverlap", ppl=2.0) for step in (1000, 2000)])
    path = folder / TaskRecord.FILE
    with open(path, "a") as f:
        f.write(json.dumps(dataclasses.asdict(replace(record("rope", 0, 5e-4, 41, 0.7), step=2000)))[:120])
    tables = report([str(tmp_path)], str(tmp_path / "r"))
    assert tables["algorithmic"].splitlines()[2] == "| parity_check | **50.0, max 50.0 (n=1)** |"  # (60 + 40) / 2
    assert capsys.readouterr().err.strip().splitlines() == [
        f"{path}:5: a torn last line (a writer stopped mid-row): the evaluation it ends, rope at step 2000, is "
        "incomplete (1 whole row) and left out; this file's latest complete evaluation of that run is step 1000"]


def test_the_report_shows_the_accuracies_at_every_evaluated_step(tmp_path):
    """Whether a step count is enough: the accuracy at the training length and the score at each step, the mean over
    the seeds evaluated there; a re-evaluation of a step replaces it, and a step only some seeds reached says so."""
    for seed, steps in ((0, (500, 1000)), (1, (500, 1000, 1500))):
        for step in steps:
            rows = [replace(record("rope", seed, 5e-4, length, accuracy), step=step)
                    for length, accuracy in ((40, step / 2000 + 0.1 * seed), (41, 0.2), (80, 0.1 * seed + step / 5000))]
            append_records(str(tmp_path / f"seed{seed}"), rows)
    append_records(str(tmp_path / "seed0"), [replace(record("rope", 0, 5e-4, 80, 0.0), step=1000),  # re-evaluated
                                             LengthRecord(pe="rope", train_length=40, step=1000, length=40,
                                                          mode="nonoverlap", ppl=2.0)])  # a fit writes both
    runs = rows_by_step(find_records([str(tmp_path)], TaskRecord.FILE), TaskRecord, lambda r: (r.task, r.length))
    lines = algorithmic_training_table(runs).splitlines()
    assert lines[:4] == ["### parity_check", "", "| step | rope |", "|---|---|"]
    # step 500: at 40 (0.25, 0.35), score ((0.2 + 0.1) / 2, (0.2 + 0.2) / 2); step 1000: seed 0's 80 is now 0
    assert lines[4:] == ["| 500 | 30 / 17.5 |", "| 1000 | 55 / 17.5 |", "| 1500 | 85 / 30.0 (n=1) |"]
    tables = report([str(tmp_path)], str(tmp_path / "r"))
    assert (tmp_path / "r_algorithmic_training.md").read_text().startswith("\n".join(lines))
    # seed 0 stopped at 1000 (or is still running): the table's mean mixes it with seed 1 at 1500, and says so
    assert tables["runs behind their other seeds"].splitlines()[-1] == (
        "- rope (training length 40, parity_check, seed 0) at step 1000, another seed at 1500")
    once = {key: {max(steps): steps[max(steps)]} for key, steps in runs.items()}
    assert algorithmic_training_table(once) == ""
    append_records(str(tmp_path / "seed0"), [replace(record("rope", 0, 5e-4, length, 0.5), step=1500)
                                             for length in (40, 41)])  # seed 0 reaches 1500 too
    assert "runs behind their other seeds" not in report([str(tmp_path)], str(tmp_path / "r"))
    assert not (tmp_path / "r_behind.md").exists()  # the earlier report's warning went with it


def test_sweep_runs_every_learning_rate_as_its_own_experiment(capsys):
    sweep_main(["--config", "configs/chomsky/base.yaml", "--config", "configs/chomsky/parity_check.yaml",
                "--pes", "nope", "rope", "--seeds", "0", "1", "--lrs", "1e-4", "5e-4", "--experiment", "ch",
                "--print_only"])
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 8
    assert sum("--experiment ch-lr0.0001 " in line and line.endswith("--model.init_args.lr 0.0001")
               for line in lines) == 4
    with pytest.raises(SystemExit):
        sweep_main(["--config", "a.yaml", "--pes", "nope", "--lrs", "fast", "--print_only"])
    assert "a learning rate is a positive number, got 'fast'" in capsys.readouterr().err


def chomsky_batch(dm, batch_number=3):
    return dm.task_batch(torch.zeros(2, 41, dtype=torch.long), batch_number=batch_number, rank=0, world_size=1)


@pytest.mark.parametrize("layout", [{"positions": "randomized", "position_range": 2048},
                                    {"positions": "pose", "position_range": 2048}, {"documents": "train"}])
def test_a_layout_trains_a_long_output_row_whole_not_cut_at_the_block_size(layout):
    """A reverse-string row (filler, n input symbols, n answer masks) is up to 2 x 40 + 1 tokens at block_size 40: a
    layout cut at block_size trained most of its answers in a segment without their input."""
    dm = TokenDataModule(path=None, tasks={"reverse_string": {}}, block_size=40, micro_batch_size=2, layout=layout)
    model = MaskedLM(BackboneConfig(preset="bert-base", pos_encoding="rope", n_layer=1, n_head=2, n_embd=32),
                     data=dm.describe())
    batch = next(b for b in map(lambda n: chomsky_batch(dm, n), range(200)) if b["tokens"].shape[1] > 70)
    seen, build = [], model.batch_layout
    model.batch_layout = lambda *a, **k: seen.append(build(*a, **k)) or seen[-1]
    model.batch_loss(batch)
    [built] = seen
    assert built.positions.shape[1] > 60
    assert built.documents is None or (built.documents == built.documents[:, :1]).all()  # one segment a row
    assert (built.positions.diff(dim=-1) > 0).all()  # positions run on through the answers, never restart


READERS = [name for name in available() if encoding_class(name).module.reads_positions is True]


@pytest.mark.parametrize("pe", READERS)
def test_randomized_positions_train_and_evaluate_with_every_encoding_that_reads_positions(pe):
    layout = {"positions": "randomized", "position_range": 256}
    dm = TokenDataModule(path=None, tasks={"odds_first": {}}, block_size=40, micro_batch_size=2, layout=layout)
    torch.manual_seed(0)
    settings = encoding_class(pe)(max_positions=256) if pe == "learnable" else pe  # a table must hold the range
    model = MaskedLM(BackboneConfig(preset="bert-base", pos_encoding=settings, n_layer=1, n_head=2, n_embd=32),
                     data=dm.describe())
    seen = []
    hidden = model.backbone.hidden_states
    model.backbone.hidden_states = lambda ids, *a, layout=None, **k: seen.append(layout) or hidden(ids, layout=layout)
    loss, _ = model.batch_loss(chomsky_batch(dm))
    assert torch.isfinite(loss)
    trained = seen[-1].positions
    assert (trained.diff(dim=-1) > 0).all() and trained.max() < 256 and trained.max() >= trained.shape[1]
    model.eval()
    with torch.no_grad():
        first = task_grid(model.task_predictions(), dm.tasks, [60], trials=2)
        asked = seen[-1].positions
        again = task_grid(model.task_predictions(), dm.tasks, [60], trials=2)
    # evaluation draws positions from the training range too (Ruoss et al.), the same at every evaluation
    assert asked.shape[1] == 120 and (asked.diff(dim=-1) > 0).all() and asked.max() < 256
    assert not torch.equal(asked[0], torch.arange(120)) and torch.equal(seen[-1].positions, asked)
    assert first == again


def test_encodings_that_read_no_positions_refuse_randomized_ones_in_one_line():
    dm = TokenDataModule(path=None, tasks={"odds_first": {}}, block_size=40,
                         layout={"positions": "randomized", "position_range": 256})
    with pytest.raises(ConfigError) as error:
        MaskedLM(BackboneConfig(preset="bert-base", pos_encoding="nope", n_layer=1, n_head=2, n_embd=32),
                 data=dm.describe())
    assert str(error.value).startswith("data.layout.positions=randomized changes nothing for nope: it reads no "
                                       "position indices") and "\n" not in str(error.value)


def test_a_fit_reports_accuracy_by_length_and_the_score(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(ROOT)
    main(["fit", "--config", "configs/chomsky/base.yaml", "--config", "configs/chomsky/stack_manipulation.yaml",
          "--runs_dir", str(tmp_path), "--trainer.max_steps", "2", "--checkpoint.every_n_train_steps", "2",
          "--data.micro_batch_size", "4", "--data.eval_tokens", "64", "--task_eval.lengths", "[20, 40, 41, 60]",
          "--task_eval.trials", "2", "--model.init_args.backbone.n_layer", "1",
          "--model.init_args.backbone.pos_encoding", "rope", "--trainer.enable_progress_bar", "false",
          "--trainer.enable_model_summary", "false"])
    out = capsys.readouterr().out
    assert "stack_manipulation score (rope, per-token accuracy over the 2 evaluated lengths 41-60): " in out
    [path] = [os.path.join(d, f) for d, _, files in os.walk(tmp_path) for f in files if f == TaskRecord.FILE]
    rows = [json.loads(line) for line in open(path)]
    assert [(r["length"], r["scoring"], r["lr"], r["train_length"], r["model"]) for r in rows] == [
        (n, "per_token", 5e-4, 40, "encoder L1-D64-H8") for n in (20, 40, 41, 60)]


def test_a_learnable_table_shorter_than_the_rows_is_refused_and_lengths_beyond_it_are_recorded_unsupported(
        tmp_path, monkeypatch, capsys):
    """Reverse string at block_size 40 trains on rows of up to 80 tokens: the learnable table of the block size is
    refused before anything is built, in one line naming the rows, the table and the setting; a table of 80 trains,
    and the final validation keeps what it can score (lengths 20 and 40; 41 and 60 recorded as unsupported, and the
    increment diagnostics of rows beyond the table skipped with a word). Before, a traceback ended the run (in a
    training batch, or in the increment diagnostics) and no task score was written."""
    monkeypatch.chdir(ROOT)
    fit = ["fit", "--config", "configs/chomsky/base.yaml", "--config", "configs/chomsky/reverse_string.yaml",
           "--runs_dir", str(tmp_path), "--trainer.max_steps", "2", "--checkpoint.every_n_train_steps", "2",
           "--data.micro_batch_size", "4", "--data.eval_tokens", "64", "--task_eval.lengths", "[20, 40, 41, 60]",
           "--task_eval.trials", "2", "--model.init_args.backbone.n_layer", "1",
           "--model.init_args.backbone.pos_encoding", "learnable", "--trainer.enable_progress_bar", "false",
           "--trainer.enable_model_summary", "false"]
    with pytest.raises(SystemExit) as refused:
        run(fit)
    assert refused.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.strip().splitlines() == [
        "error: task reverse_string trains on rows of up to 80 tokens (inputs of up to data.block_size 40 symbols and "
        "their answers), more than the learnable encoding's table of 40 positions; set learnable's max_positions to "
        "at least 80 (--model.init_args.backbone.pos_encoding.max_positions 80); evaluation lengths whose rows it "
        "does not hold (the longest, 60 symbols, reads 120 tokens) are recorded as unsupported"]
    assert not os.listdir(tmp_path)  # refused before anything was built

    main([*fit, "--model.init_args.backbone.pos_encoding.max_positions", "80"])
    out = capsys.readouterr().out
    assert "increment diagnostics at length 40 (task:reverse_string) skipped: sequence length 82 exceeds" in out
    assert ("reverse_string score (learnable, per-token accuracy over the 2 evaluated lengths 41-60): - (the "
            "encoding cannot read lengths 41, 60; recorded as unsupported)") in out
    [path] = [os.path.join(d, f) for d, _, files in os.walk(tmp_path) for f in files if f == TaskRecord.FILE]
    scored = {r["length"]: r["accuracy"] for r in map(json.loads, open(path))}
    assert scored.keys() == {20, 40, 41, 60} and scored[41] is None and scored[60] is None
    assert all(0 <= scored[n] <= 1 for n in (20, 40))


def test_an_evaluation_longer_than_the_randomized_range_is_refused_before_training():
    from types import SimpleNamespace

    from cable_lightning.callbacks.task_eval import TaskAccuracy
    from cable_lightning.data.layouts import TrainingLayout

    dm = TokenDataModule(path=None, tasks={"duplicate_string": {}}, block_size=40)
    module = SimpleNamespace(layout=TrainingLayout(positions="randomized", position_range=1024))
    trainer = SimpleNamespace(datamodule=dm)
    TaskAccuracy(lengths=[40, 341]).setup(trainer, module, "fit")  # 3 x 341 = 1023 tokens fit
    with pytest.raises(ConfigError) as error:
        TaskAccuracy(lengths=[40, 342]).setup(trainer, module, "fit")
    assert str(error.value) == ("task duplicate_string at evaluation length 342 reads 1026 tokens, more than "
                                "data.layout.position_range 1024 randomized positions; raise it to >= 1026 or "
                                "evaluate shorter lengths")


def test_records_written_before_runs_carried_their_learning_rate_join_the_runs_that_name_one():
    rows = [record("rope", seed, lr, length, 0.5 + 0.1 * seed)
            for seed, lr in ((0, None), (1, 1e-3), (2, 1e-3)) for length in (40, 41)]
    table = algorithmic_table(rows).splitlines()
    assert table[0] == "| task | rope |" and table[2].startswith("| parity_check | **60.0 [") and "(n=3)" in table[2]
    table = algorithmic_table(rows + [record("rope", 0, 1e-4, 41, 0.3)]).splitlines()  # rates differ: named
    assert table[0].startswith("| task | rope | rope lr=0.0001 | rope lr=0.001 |")
