"""The bench verb's MFU and tools/gpu_acceptance.py's refusal without CUDA."""

import os
import subprocess
import sys

import pytest

from cable_lightning import bench

TOOLS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tools")


def test_bench_reports_mfu_against_a_matmul_peak_measured_in_the_process(capsys):
    result = bench.main(["--n-layer", "1", "--n-head", "2", "--n-embd", "32", "--vocab-size", "512", "--pes", "nope",
                         "cable", "--train-lengths", "64", "--eval-lengths", "128", "--tokens-per-step", "256",
                         "--repeats", "1", "--skip-memory", "--device", "cpu"])
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


def test_gpu_acceptance_refuses_without_cuda_in_one_line():
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    done = subprocess.run([sys.executable, os.path.join(TOOLS, "gpu_acceptance.py"), "--out", os.devnull],
                          env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.count("\n") == 1 and done.stderr.startswith("error: tools/gpu_acceptance.py needs a CUDA GPU")
