"""The increment diagnostics (docs/diagnostics.md#increments): a CABLE whose mask-token increment is forced
to zero reads as such, the figures against a slow reference, the answer pair's hidden difference, what `validate` on
an encoder checkpoint prints and records, and the report's tables and figure."""

import os
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from cable_lightning.callbacks.diagnostics import AttentionDiagnostics
from cable_lightning.cli import main
from cable_lightning.data.datamodule import TokenDataModule
from cable_lightning.eval.diagnostics import (
    has_increments,
    increment_diagnostics,
    relative_difference,
    selected_figures,
)
from cable_lightning.eval.diagnostics_report import diagnostics_report
from cable_lightning.lit import MaskedLM
from cable_lightning.models import BackboneConfig, build_backbone
from cable_lightning.positional import from_label
from cable_lightning.records.io import append_records, read_records
from cable_lightning.records.schema import HiddenPairRecord, IncrementRecord
from cable_lightning.tasks.generation import OWN_MASK_ID, OWN_VOCABULARY

ROOT = os.path.join(os.path.dirname(__file__), "..")
HEADS = 2


def encoder(pe: str, n_layer: int = 1, seed: int = 0):
    """A bidirectional backbone whose [MASK] embedding is zero: its normalised input is then 0 in the first layer
    (LayerNorm of a constant vector is its bias, 0), so every per-token logit there is 0 and a ReLU increment exactly
    0 (a softplus weight ln 2)."""
    torch.manual_seed(seed)
    backbone = build_backbone(BackboneConfig(pos_encoding=from_label(pe), n_layer=n_layer, n_head=HEADS, n_embd=16,
                                             vocab_size=OWN_VOCABULARY, block_size=16, causal=False)).eval()
    with torch.no_grad():
        backbone.wte.weight[OWN_MASK_ID] = 0.0
    return backbone


def masked_rows(rows: int = 4, length: int = 12, seed: int = 0):
    """Random ids (never the mask) with two masks side by side at a different place in each row."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, OWN_MASK_ID, (rows, length), generator=generator)
    first = torch.tensor([2, 5, 7, 9][:rows])
    ids[torch.arange(rows), first] = OWN_MASK_ID
    ids[torch.arange(rows), first + 1] = OWN_MASK_ID
    return ids, (first, first + 1)


def test_a_mask_increment_forced_to_zero_reads_zero_at_the_mask_and_nowhere_else():
    backbone = encoder("cable")
    ids, pair = masked_rows()
    mask = ids == OWN_MASK_ID
    found = increment_diagnostics(backbone, ids, {"all": torch.ones_like(mask), "mask": mask}, pair)
    at = {(r["quantity"], r["tokens"], r["head"]): r for r in found.increments}
    for head in range(HEADS):
        assert at["increment", "mask", head]["zero_share"] == 1.0
        assert at["increment", "mask", head]["count"] == 8
        assert at["increment", "mask", head]["p90"] == 0.0
        assert at["weight", "mask", head]["mean"] == pytest.approx(np.log(2), abs=1e-6)
    # every other token: the share of exact zeros the layer's own increments have (a slow reference)
    with torch.no_grad():
        b = backbone.pe.token_increments(backbone.blocks[0].ln_attn(backbone.wte(ids)), 0)["increment"]
    for head in range(HEADS):
        expected = (b[:, head] == 0).float().mean().item()
        assert at["increment", "all", head]["zero_share"] == pytest.approx(expected, abs=1e-6)
        assert expected < 1.0
    # one layer, the two masks identical and with no increment: CABLE's final states cannot differ; ALiBi's do
    assert found.pair["mean"] == pytest.approx(0.0, abs=1e-6) and found.pair["examples"] == 4
    alibi = increment_diagnostics(encoder("alibi"), ids, {"all": torch.ones_like(mask)}, pair)
    assert alibi.increments == [] and alibi.pair["min"] > 1e-3


def test_only_encodings_with_increments_say_they_have_them():
    assert has_increments(encoder("cable")) and has_increments(encoder("dape_v2+cable_dir"))
    assert has_increments(encoder("fox")) and not has_increments(encoder("alibi"))
    names = {r["quantity"] for r in increment_diagnostics(encoder("cable_dir"), masked_rows()[0],
                                                           {"all": torch.ones(4, 12, dtype=torch.bool)}).increments}
    assert names == {"increment", "weight", "weight_right"}


def test_a_run_trained_at_randomized_positions_is_diagnosed_at_the_positions_its_tasks_are_read_at():
    layout = {"positions": "randomized", "position_range": 256}
    dm = TokenDataModule(path=None, tasks={"reverse_string": {}}, block_size=40, micro_batch_size=2, layout=layout)
    torch.manual_seed(0)
    model = MaskedLM(BackboneConfig(preset="bert-base", pos_encoding="rope", n_layer=1, n_head=2, n_embd=32),
                     data=dm.describe()).eval()
    name, read, tokens, pair, positions = AttentionDiagnostics(examples=3).increment_inputs(
        SimpleNamespace(datamodule=dm), model, 60, windows=None)
    assert name == "task:reverse_string" and len(read) == 3 and read.shape[1] > 120  # 60 symbols, 60 masks
    drawn = positions.positions
    assert (drawn.diff(dim=-1) > 0).all() and drawn.max() < 256
    assert not torch.equal(drawn[0], torch.arange(read.shape[1]))
    assert torch.equal(drawn, model.task_layout()(read).positions)  # a fixed draw: what the task evaluation reads
    found = increment_diagnostics(model.backbone, read, tokens, pair, positions)
    with torch.no_grad():
        expected = relative_difference(model.backbone.hidden_states(read, layout=positions), *pair).mean().item()
        contiguous = relative_difference(model.backbone.hidden_states(read), *pair).mean().item()
    assert found.pair["mean"] == pytest.approx(expected, rel=1e-2)  # recorded to 3 significant figures
    assert abs(contiguous - expected) > 0.1 * expected  # the positions matter to RoPE: the old reading differed


def test_figures_against_a_slow_reference():
    torch.manual_seed(0)
    values = torch.relu(torch.randn(3, HEADS, 10))
    where = torch.rand(3, 10) < 0.6
    figures = selected_figures(values, where)
    for head in range(HEADS):
        chosen = np.sort(values[:, head][where].numpy())
        n = len(chosen)
        ranks = [int(round(q * (n - 1))) for q in (0.1, 0.5, 0.9)]
        expected = [n, np.mean(chosen == 0), chosen.mean(), *chosen[ranks]]
        np.testing.assert_allclose(figures[:, head].numpy(), expected, rtol=1e-6)


def test_validate_on_an_encoder_checkpoint_prints_and_records_the_increments(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(ROOT)
    args = ["--config", "configs/tasks/base.yaml", "--config", "configs/tasks/encoder.yaml", "--config",
            "configs/tasks/needle.yaml", "--runs_dir", str(tmp_path), "--trainer.max_steps", "2",
            "--checkpoint.every_n_train_steps", "2", "--data.micro_batch_size", "4", "--data.eval_lengths",
            "[32, 64]", "--data.eval_tokens", "64", "--task_eval.trials", "2", "--task_eval.depths", "[0.5]",
            "--model.init_args.backbone.n_layer", "2", "--trainer.enable_progress_bar", "false",
            "--trainer.enable_model_summary", "false", "--diagnostics.examples", "3"]
    main(["fit", *args])
    run = tmp_path / "tasks-needle" / "cable"
    capsys.readouterr()
    main(["validate", *args, "--ckpt_path", str(run / "checkpoints" / "last.ckpt")])
    printed = capsys.readouterr().out
    assert "increments (cable, length 32, task:needle): all: increment = 0 at" in printed
    assert "answer 1 vs 2 final hidden states: relative difference" in printed
    rows = read_records(str(run / "version_1" / IncrementRecord.FILE), IncrementRecord)
    assert {(r.stage, r.inputs, r.examples) for r in rows} == {("validate", "task:needle", 3)}
    assert {(r.length, r.layer, r.head, r.quantity) for r in rows} == {
        (n, layer, head, q) for n in (32, 64) for layer in (0, 1) for head in range(4) for q in ("increment", "weight")}
    assert {r.tokens for r in rows} == {"all", "answer", "mask", "marker", "symbol", "filler"}
    assert all(r.count == 6 for r in rows if r.tokens in ("answer", "mask"))  # 3 examples, 2 masked answer tokens
    pairs = read_records(str(run / "version_1" / HiddenPairRecord.FILE), HiddenPairRecord)
    assert [(p.length, p.examples, p.pair) for p in pairs] == [(n, 3, "answer 1, answer 2") for n in (32, 64)]


def increment_record(pe, seed, layer, head, tokens, zero_share):
    return IncrementRecord(pe=pe, train_length=32, step=10, run_seed=seed, length=32, inputs="task:needle",
                           examples=4, layer=layer, head=head, quantity="increment", tokens=tokens, count=8,
                           zero_share=zero_share, mean=0.1, p10=0.0, p50=0.1, p90=0.2)


def test_report_tables_and_one_figure(tmp_path):
    for seed in (0, 1):
        rows = [increment_record("cable", seed, layer, head, tokens, share)
                for layer in (0, 1) for head in (0, 1)
                for tokens, share in (("all", 0.5 + 0.1 * head), ("mask", 1.0))]
        rows.append(HiddenPairRecord(pe="cable", train_length=32, step=10, run_seed=seed, length=32,
                                     inputs="task:needle", pair="answer 1, answer 2", examples=4,
                                     difference_mean=0.0, difference_min=0.0, difference_max=0.0))
        append_records(str(tmp_path / "cable" / f"seed{seed}"), rows)
    tables = diagnostics_report([str(tmp_path)], str(tmp_path / "report"))
    text = tables["increments"]
    assert "| all: layer 0 | 32 | 0.550 [0.550, 0.550] |" in text  # the mean over heads, two seeds
    assert "| mask: layer 1 | 32 | 1.000 [1.000, 1.000] |" in text
    assert "relative difference of the final hidden states" in text
    assert (tmp_path / "report_increments.png").stat().st_size > 0
    assert (tmp_path / "report_increments.csv").read_text().count("increment exactly 0") == 8
