"""The bench verb's MFU."""

import pytest

from cable_lightning import bench


def test_bench_reports_mfu_against_a_matmul_peak_measured_in_the_process(capsys):
    result = bench.main(["--n_layer", "1", "--n_head", "2", "--n_embd", "32", "--vocab_size", "512", "--pes", "nope",
                         "cable", "--train_lengths", "64", "--eval_lengths", "128", "--tokens_per_step", "256",
                         "--repeats", "1", "--skip_memory", "--device", "cpu"])
    meta, rows = result["meta"], result["rows"]
    assert "matmul measured in this process" in meta["peak_source"] and meta["peak_flops"] > 1e8
    for row in rows:
        model = bench.build_backbone(bench.make_config(bench.argparse.Namespace(
            preset="gpt2-tiny", n_layer=1, n_head=2, n_embd=32, vocab_size=512), row["pe"], 64))
        flops = model.training_flops_per_token(64)  # 6 x parameters + 12 x layers x width x length
        assert flops == 6 * sum(p.numel() for p in model.parameters()) + 12 * 1 * 32 * 64
        assert row["train_mfu"][64] == pytest.approx(row["train_tok_s"][64] * flops / meta["peak_flops"])
        assert 0 < row["train_mfu"][64] < 1, "a tiny model's step is below the machine's matmul peak"
    out = capsys.readouterr().out
    assert "MFU @64" in out and "GFLOP/s" in out



def test_loop_overhead_times_a_fit_through_the_cli_against_the_bare_step(tiny_corpus_dir):
    """The loop-overhead benchmark (docs/speed.md) runs a real fit with its clock and a bare step of the same model:
    every step between the warm-up and the end is timed, and the ratio is of the two medians.
    No timing is asserted: the ratio is the benchmark's output, read on a quiet machine."""
    result = bench.loop_overhead(tiny_corpus_dir, steps=6, warmup=2, repeats=2, block_size=32, batch=4)
    assert result["fit_steps_timed"] == 3 and result["fit_step_s"] > 0 and result["bare_step_s"] > 0
    # the measurement names what it ran: the arguments given, on the device the fit's model ended on
    assert {key: result[key] for key in ("pe", "shape", "block_size", "batch", "compile", "device")} == {
        "pe": "cable", "shape": (2, 4, 128), "block_size": 32, "batch": 4, "compile": False, "device": "cpu"}
