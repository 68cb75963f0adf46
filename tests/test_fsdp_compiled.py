"""FSDP2 (the sharded recipe, configs/trainer/fsdp8_bf16.yaml) with compiled blocks (``compile: true``), as a real
two-process fit on CPU over gloo: Dynamo's ``aot_eager`` backend stands in for inductor (tests/compile_probe.py)."""

import json

import pytest
from conftest import two_process_data as data
from conftest import two_process_fit as fit

STEPS = 4


def fsdp2_fit(runs, out, *extra):
    return [row["loss"] for row in fit(runs, out, "fsdp2", *extra, steps=STEPS, every=100)]


def test_fsdp2_with_compiled_blocks_trains_as_without(small_corpus_dir, tmp_path):
    """Four bf16 steps of CABLE sharded over two processes, with and without compiled blocks: the same losses (to bf16
    rounding), and on each rank one block graph for both layers (each block compiled before it is sharded; FSDP2's
    hooks gather its weights around the compiled forward)."""
    plain = fsdp2_fit(tmp_path / "plain", tmp_path / "plain_losses", *data(small_corpus_dir))
    compiled = fsdp2_fit(tmp_path / "compiled", tmp_path / "compiled_losses", *data(small_corpus_dir),
                         "--model.init_args.compile", "true", "--trainer.callbacks+=compile_probe.CompileWith",
                         f"--trainer.callbacks.out_dir={tmp_path / 'graphs'}")
    assert len(plain) == len(compiled) == STEPS
    assert compiled == pytest.approx(plain, rel=1e-4)  # measured: the first step bitwise, then 3e-6 at most
    for rank in (0, 1):
        assert json.load(open(tmp_path / "graphs" / f"graphs_rank{rank}.json")) == {"graphs": 1}
