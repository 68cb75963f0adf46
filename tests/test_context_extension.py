"""Context extension as a stage: weights trained at L continue at L' with RoPE's scaling; YaRN's original length stays
L, the records say "trained at L, extended to L'", the report keeps the extended run apart, and an extension that does
not say so, or of an encoding that cannot serve L', is one line."""

import glob
import json
import os

import pytest
import torch
from conftest import args

from cable_lightning.cli import main
from cable_lightning.errors import ConfigError
from cable_lightning.eval import report
from cable_lightning.models import BackboneConfig, build_backbone
from cable_lightning.positional.rope import Rope


@pytest.fixture(scope="module")
def short_run(tiny_corpus_dir, tmp_path_factory):
    """A 2-step RoPE run at 32 tokens; returns its last checkpoint."""
    runs = str(tmp_path_factory.mktemp("short"))
    main(["fit", *args(tiny_corpus_dir, runs, pe="rope", steps=2, every=2)])
    return os.path.join(runs, "test", "rope", "checkpoints", "last.ckpt")


def extension(data, runs, checkpoint, extra=()):
    """The stage: the short run's weights at 64 tokens with YaRN x2, 2 steps, a low learning rate."""
    return [*args(data, runs, pe="rope", steps=2, every=2), "--data.block_size", "64", "--data.eval_lengths",
            "[32, 64, 128]", "--model.init_args.init_weights", checkpoint, "--model.init_args.lr", "1e-4",
            "--model.init_args.backbone.pos_encoding.scaling", "yarn",
            "--model.init_args.backbone.pos_encoding.scaling_factor", "2", *extra]


def test_an_extension_stage_records_its_lineage_and_keeps_yarns_original_length(tiny_corpus_dir, short_run,
                                                                                   tmp_path):
    runs = str(tmp_path / "extended")
    cli = main(["fit", *extension(tiny_corpus_dir, runs, short_run,
                                  ["--model.init_args.backbone.trained_length", "32"])])
    assert cli.trainer.global_step == 2 and cli.model.config.block_size == 64
    # YaRN interpolates relative to the length the weights were trained at, not the new block size
    trained_at_32 = build_backbone(BackboneConfig(pos_encoding=Rope(scaling="yarn", scaling_factor=2.0), n_layer=2,
                                                  n_head=2, n_embd=32, vocab_size=97, block_size=32))
    torch.testing.assert_close(cli.model.backbone.pe.inv_freq, trained_at_32.pe.inv_freq)
    rows = [json.loads(line) for f in glob.glob(os.path.join(runs, "test", "rope", "version_*", "length_eval.jsonl"))
            for line in open(f)]
    assert {(r["pe"], r["train_length"], r["extended_to"]) for r in rows} == {("rope+yarn2", 32, 64)}
    # the attention diagnostics of the same validations name the same run (and so reach the same report column)
    context = ("pe", "train_length", "extended_to", "layout", "step", "stage", "run_seed")
    attention = [json.loads(line) for f in glob.glob(os.path.join(runs, "test", "rope", "version_*", "attention.jsonl"))
                 for line in open(f)]
    assert {tuple(r[k] for k in context) for r in attention} == {tuple(r[k] for k in context) for r in rows}
    report.report([runs], str(tmp_path / "report"))
    assert "rope+yarn2 >64" in open(str(tmp_path / "report_nonoverlap.md")).read()
    assert "| rows | length | rope+yarn2 >64 |" in open(str(tmp_path / "report_attention.md")).read()


def test_an_extension_that_does_not_say_so_is_one_line(tiny_corpus_dir, short_run, tmp_path):
    with pytest.raises(ConfigError, match=r"was trained at 32 tokens and this run trains at 64: a context extension; "
                                          r"say so with --model.init_args.backbone.trained_length 32"):
        main(["fit", *extension(tiny_corpus_dir, str(tmp_path), short_run)])
    with pytest.raises(ConfigError, match=r"was trained at 32 tokens, not backbone.trained_length 48"):
        main(["fit", *extension(tiny_corpus_dir, str(tmp_path / "b"), short_run,
                                ["--model.init_args.backbone.trained_length", "48"])])


def test_a_table_cannot_be_extended():
    from cable_lightning.data.manifest import DataInfo
    from cable_lightning.lit import CausalLM

    data = DataInfo(vocab_size=97, eot_id=0, mask_id=None, special_ids=(0,), tokenizer={"kind": "t", "name": "t",
                    "hash": "h"}, block_size=64, eval_specs=((64, 64),))
    backbone = BackboneConfig(pos_encoding="learnable", n_layer=1, n_head=2, n_embd=16, trained_length=32)
    with pytest.raises(ConfigError, match=r"learnable serves 32 positions \(it was trained at 32\); it cannot be "
                                          r"extended to block_size 64"):
        CausalLM(backbone=backbone, data=data)
