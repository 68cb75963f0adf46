"""data.layout: what training sees of a block. Documents end at the end-of-text id; randomized positions are sorted
samples of a longer range per document; PoSE's skips grow chunk by chunk and stay in range; the window schedule
grows linearly or in steps and cuts rows into windows that run as if alone; a run resumed mid-schedule ends where an
uninterrupted one does; records name the layout; bad settings are one line."""

import glob
import json
import os

import pytest
import torch
from conftest import args

from cable_lightning.cli import main
from cable_lightning.data.layouts import TrainingLayout, document_ids, pose_positions, randomized_positions
from cable_lightning.errors import ConfigError
from cable_lightning.models import BackboneConfig, build_backbone
from cable_lightning.positional.layout import Layout

EOT = 0


def test_documents_end_at_and_include_the_end_of_text_id():
    ids = torch.tensor([[5, 6, EOT, 7, EOT, EOT, 8]])
    assert document_ids(ids, EOT).tolist() == [[0, 0, 0, 1, 1, 2, 3]]


def test_randomized_positions_are_sorted_distinct_samples_of_the_range_per_document():
    documents = torch.tensor([[0] * 5 + [1] * 7 + [2] * 4] * 3)
    layout = Layout.build(3, 16, "cpu", documents=documents)
    draws = [randomized_positions(layout, 40, torch.Generator().manual_seed(seed)) for seed in range(30)]
    for positions in draws:
        for start, stop in ((0, 5), (5, 12), (12, 16)):
            piece = positions[:, start:stop]
            assert (piece.diff(dim=-1) > 0).all() and piece.min() >= 0 and piece.max() < 40
    stacked = torch.stack(draws)
    # a document's first position is the least of 7 draws from 40, not 0: on average (40 - 7) / 8
    assert 2.5 < stacked[:, :, 5].float().mean() < 6
    assert stacked.max() > 30 and stacked[:, :, 0].min() == 0  # the whole range is reached, both ends
    same = randomized_positions(layout, 40, torch.Generator().manual_seed(3))
    assert torch.equal(same, draws[3])  # a generator's seed decides them: a resumed run draws the same


def test_pose_positions_skip_forward_chunk_by_chunk_and_stay_in_range():
    layout = Layout.build(4, 32, "cpu")
    for seed in range(20):
        positions = pose_positions(layout, 100, 3, torch.Generator().manual_seed(seed))
        steps = positions.diff(dim=-1)
        assert (steps >= 1).all() and positions.max() < 100 and (positions[:, 0] == 0).all()
        assert ((steps > 1).sum(dim=-1) <= 2).all()  # at most two skips: three chunks
    skipped = torch.stack([pose_positions(layout, 100, 3, torch.Generator().manual_seed(s)) for s in range(20)])
    assert skipped[..., -1].max() > 80  # skips reach far into the range


def test_the_window_schedule_grows_linearly_or_in_steps_to_the_block_size():
    linear = TrainingLayout(schedule="linear", schedule_start=32, schedule_steps=100)
    assert [linear.window(s, 128) for s in (0, 50, 99, 100, 5000)] == [32, 80, 127, 128, 128]
    stepwise = TrainingLayout(schedule="stepwise", schedule_start=32, schedule_steps=90, schedule_stages=2)
    assert [stepwise.window(s, 128) for s in (0, 44, 45, 89, 90)] == [32, 32, 64, 64, 128]
    assert TrainingLayout().window(0, 128) == 128


def test_a_scheduled_window_runs_each_window_of_a_row_as_if_alone():
    layout = TrainingLayout(schedule="linear", schedule_start=8, schedule_steps=10, documents="train")
    ids = torch.randint(1, 97, (2, 24))
    ids[0, 5] = EOT  # a document ends inside the first window
    built = layout.build(ids, EOT, step=0, train=True)
    assert built.documents[0].tolist() == [0] * 6 + [1] * 2 + [2] * 8 + [3] * 8
    assert built.positions[0].tolist() == list(range(6)) + [0, 1] + list(range(8)) * 2
    torch.manual_seed(0)
    model = build_backbone(BackboneConfig(pos_encoding="fire", n_layer=2, n_head=2, n_embd=16, vocab_size=97,
                                          block_size=24)).eval()
    with torch.no_grad():
        out = model(ids, layout=built)
        torch.testing.assert_close(out[:, 16:], model(ids[:, 16:]), atol=1e-5, rtol=1e-5)
    assert layout.build(ids, EOT, step=10, train=True).documents[1].unique().numel() == 1
    evaluation = TrainingLayout(documents="train").build(ids, EOT, step=0, train=False)
    assert evaluation is None  # evaluation keeps its windows unless documents: all
    assert TrainingLayout(documents="all").build(ids, EOT, 0, train=False).documents[0, 6] == 1


@pytest.mark.parametrize("settings, message", [
    (dict(documents="yes"), "data.layout.documents='yes' is not valid; valid: none, train, all"),
    (dict(positions="randomized"), "data.layout.positions=randomized draws positions from [0, position_range): set"),
    (dict(schedule="linear"), "data.layout.schedule=linear grows the window over schedule_steps optimizer steps"),
    (dict(pose_chunks=0, positions="pose", position_range=64), "data.layout.pose_chunks must be an integer >= 1"),
])
def test_bad_layout_settings_are_one_line(settings, message):
    with pytest.raises(ConfigError) as error:
        TrainingLayout(**settings)
    assert str(error.value).startswith(message) and "\n" not in str(error.value)


def run_rows(runs, pe):
    files = sorted(glob.glob(os.path.join(runs, "test", pe, "version_*", "length_eval.jsonl")))
    return [json.loads(line) for f in files for line in open(f)]


SCHEDULED = ["--data.layout.documents", "train", "--data.layout.positions", "pose", "--data.layout.position_range",
             "128", "--data.layout.schedule", "linear", "--data.layout.schedule_start", "8",
             "--data.layout.schedule_steps", "4"]


def test_a_run_resumed_mid_schedule_ends_as_an_uninterrupted_one(tiny_corpus_dir, tmp_path):
    """Window, positions and documents are functions of the step (and seed): resuming at step 2 of a 4-step schedule
    from the uninterrupted run's checkpoint ends with its weights; every record names the layout."""
    straight = main(["fit", *args(tiny_corpus_dir, str(tmp_path / "straight"), pe="rope", steps=4, every=2,
                                  extra=SCHEDULED)])
    middle = os.path.join(str(tmp_path / "straight"), "test", "rope", "checkpoints", "step0000002.ckpt")
    resumed = main(["fit", *args(tiny_corpus_dir, str(tmp_path / "resumed"), pe="rope", steps=4, every=2,
                                 extra=SCHEDULED), "--ckpt_path", middle])
    assert resumed.trainer.global_step == 4
    for (name, p), q in zip(straight.model.named_parameters(), resumed.model.parameters()):
        torch.testing.assert_close(p, q, atol=1e-6, rtol=0, msg=name)
    labels = {row["layout"] for row in run_rows(str(tmp_path / "straight"), "rope")}
    assert labels == {"docs-train+pose128x2+linear8-32@4"}
    # a validate without the layout's flags is still recorded as the run its checkpoint is
    main(["validate", *args(tiny_corpus_dir, str(tmp_path / "straight"), pe="rope"), "--ckpt_path", middle])
    validated = [row for row in run_rows(str(tmp_path / "straight"), "rope") if row["stage"] == "validate"]
    assert validated and {row["layout"] for row in validated} == {"docs-train+pose128x2+linear8-32@4"}


def test_positions_an_encoding_cannot_read_are_one_line_before_training(tiny_corpus_dir, tmp_path):
    with pytest.raises(ConfigError, match=r"data.layout.positions=randomized changes nothing for cable: it reads no "
                                          r"position indices.*: alibi, fire"):
        main(["fit", *args(tiny_corpus_dir, str(tmp_path), pe="cable", extra=[
            "--data.layout.positions", "randomized", "--data.layout.position_range", "128"])])
    with pytest.raises(ConfigError, match=r"position_range 16 is shorter than the block size 32"):
        main(["fit", *args(tiny_corpus_dir, str(tmp_path), pe="rope", extra=[
            "--data.layout.positions", "randomized", "--data.layout.position_range", "16"])])
    with pytest.raises(ConfigError, match=r"position_range 128 is more than the learnable encoding's 32 positions"):
        main(["fit", *args(tiny_corpus_dir, str(tmp_path), pe="learnable", extra=[
            "--data.layout.positions", "randomized", "--data.layout.position_range", "128"])])
