"""The bench verb: MFU, its peers, compiled and bf16 rows, and the loop's overhead against the bare step."""

import argparse
import importlib.util

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from cable_lightning import bench, cli, timing
from cable_lightning.bench import bf16, command, peer_models, steps, variants
from cable_lightning.bench import loop_overhead as overhead
from cable_lightning.models import BackboneConfig, build_backbone


class Ticking:
    """timing's ``time``: each read of ``perf_counter`` comes ``tick`` seconds after the last, so every call the
    bench times takes ``tick`` seconds."""

    def __init__(self, tick: float):
        self.now, self.tick = 0.0, tick

    def perf_counter(self) -> float:
        self.now += self.tick
        return self.now


def shape(**kwargs) -> argparse.Namespace:
    return argparse.Namespace(**{"preset": "gpt2-tiny", "n_layer": 2, "n_head": 2, "n_embd": 64, "vocab_size": 512,
                                 **kwargs})


def test_mfu_is_the_counted_flops_per_second_over_the_peak(monkeypatch, capsys):
    """MFU of a training step: the FLOPs torch's FlopCounterMode counts in that step (on the materialized path, an
    independent count of ``training_flops_per_token``'s estimate: within its 2%) over the step's seconds (a clock
    stubbed at 0.25 s a call) over the CPU's peak (stubbed: 1 GFLOP/s in fp32)."""
    monkeypatch.setattr(timing, "time", Ticking(0.25))
    monkeypatch.setattr(command, "cpu_matmul_peaks", lambda: {"fp32": 1e9, "bf16": 2e9})
    result = bench.main(["--n_layer", "2", "--n_head", "2", "--n_embd", "64", "--vocab_size", "512", "--pes",
                         "nope:materialized", "--train_lengths", "64", "--eval_lengths", "64", "--tokens_per_step",
                         "256", "--repeats", "1", "--skip_memory", "--device", "cpu"])
    row = next(row for row in result["rows"] if row["pe"] == "nope:materialized")
    model = build_backbone(variants.make_config(shape(), "nope:materialized", 64))
    with FlopCounterMode(display=False) as counter:
        steps.train_step(model, torch.randint(0, 512, (4, 65)), torch.device("cpu"), torch.float32)()
    assert result["meta"]["peak_flops"] == 1e9 and row["train_tok_s"][64] == 4 * 64 / 0.25
    assert row["train_mfu"][64] == pytest.approx(counter.get_total_flops() / 0.25 / 1e9, rel=0.02)
    out = capsys.readouterr().out
    assert "MFU @64" in out and f"| {row['train_mfu'][64]:.1%} |" in out


def test_the_flops_mfu_divides_are_the_matmul_flops_torch_counts_in_a_training_step():
    """``training_flops_per_token`` (6 per parameter plus 12 x layers x width x length) against the matmul FLOPs that
    torch's FlopCounterMode counts in one forward and backward on the materialized path, at two lengths: within 2%
    (the estimate also counts the norms', biases' and embedding's parameters, which no matmul reads), and the
    attention term grows with the length exactly as counted."""
    counted, estimated = {}, {}
    for t in (64, 256):
        model = build_backbone(variants.make_config(shape(), "nope:materialized", t))
        x = torch.randint(0, 512, (2, t + 1))
        with FlopCounterMode(display=False) as counter:
            steps.train_step(model, x, torch.device("cpu"), torch.float32)()
        counted[t], estimated[t] = counter.get_total_flops() / (2 * t), model.training_flops_per_token(t)
        assert counted[t] == pytest.approx(estimated[t], rel=0.02)
    assert counted[256] - counted[64] == estimated[256] - estimated[64]


def test_the_loop_overhead_bare_step_clips_steps_and_times_as_its_fit(tiny_corpus_dir, monkeypatch):
    """The loop-overhead benchmark (docs/speed.md) runs a real fit with a :class:`timing.StepClock` and a bare step of
    the same module. The fit is given a clip of 0.5 and its own optimizer settings: the bare step clips at the fit's
    0.5 (in each of its warm-up and timed steps, as the fit in each of its 6), and its optimizer is the fit's recipe
    over the fit's parameters. The medians are of the steps after the warm-up; no timing is asserted: the ratio is the
    benchmark's output, read on a quiet machine."""
    clipped, fits, bare = [], [], []
    clip = torch.nn.utils.clip_grads_with_norm_

    def recording_clip(params, max_norm, total_norm, *args, **kwargs):
        clipped.append(max_norm)
        return clip(params, max_norm, total_norm, *args, **kwargs)

    monkeypatch.setattr(torch.nn.utils, "clip_grads_with_norm_", recording_clip)
    fit, settings = cli.main, ["--trainer.gradient_clip_val", "0.5", "--model.init_args.lr", "0.002",
                               "--model.init_args.betas", "[0.8, 0.9]", "--model.init_args.eps", "1e-6",
                               "--model.init_args.weight_decay", "0.05"]
    monkeypatch.setattr(cli, "main", lambda args, **kw: fits.append(fit(args + settings, **kw)) or fits[-1])
    bare_step = overhead.BareStep
    monkeypatch.setattr(overhead, "BareStep", lambda *args: bare.append(bare_step(*args)) or bare[-1])
    result = overhead.loop_overhead(tiny_corpus_dir, steps=6, warmup=2, repeats=2, block_size=32, batch=4)
    assert result["fit_steps_timed"] == 3
    assert result["gradient_clip"] == 0.5 and clipped == [0.5] * (6 + 2 + 2)
    [fitted], [step] = fits, bare
    keys = ("initial_lr", "betas", "eps", "weight_decay", "fused")
    groups, fit_groups = step.optimizer.param_groups, fitted.trainer.optimizers[0].param_groups
    assert [{k: g[k] for k in keys} for g in groups] == [{k: g[k] for k in keys} for g in fit_groups] == [
        {"initial_lr": 0.002, "betas": (0.8, 0.9), "eps": 1e-6, "weight_decay": decay, "fused": True}
        for decay in (0.05, 0.0)]
    assert all(a is b for g, f in zip(groups, fit_groups) for a, b in zip(g["params"], f["params"], strict=True))
    # the measurement names what it ran: the arguments given, on the device the fit trained on
    assert {key: result[key] for key in ("pe", "shape", "block_size", "batch", "compile", "device")} == {
        "pe": "cable", "shape": (2, 4, 128), "block_size": 32, "batch": 4, "compile": False, "device": "cpu"}


TINY = ["--n_layer", "1", "--n_head", "2", "--n_embd", "32", "--vocab_size", "500", "--pes", "nope", "--train_lengths",
        "32", "--eval_lengths", "32", "--tokens_per_step", "64", "--repeats", "1", "--skip_memory", "--device", "cpu"]


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_cpu_mfu_divides_by_the_matmul_peak_of_the_runs_dtype_and_both_peaks_are_printed(dtype, monkeypatch, capsys):
    """The CPU's fp32 and bf16 matmul peaks (here 100 and 300 GFLOP/s, monkeypatched) are both measured, before and
    after the encodings (the better of each is kept), both printed, and MFU divides by the run's own."""
    measured = iter([{"fp32": 100e9, "bf16": 250e9}, {"fp32": 90e9, "bf16": 300e9}])
    monkeypatch.setattr(command, "cpu_matmul_peaks", lambda: next(measured))
    result = bench.main(TINY + ["--dtype", dtype])
    meta, (row,) = result["meta"], result["rows"]
    peak = {"fp32": 100e9, "bf16": 300e9}[dtype]
    assert meta["peak_flops"] == peak and meta["cpu_matmul_peaks"] == {"fp32": 100e9, "bf16": 300e9}
    assert row["train_mfu"][32] == pytest.approx(row["train_tok_s"][32] * row["train_flops_per_token"][32] / peak)
    out = capsys.readouterr().out
    assert "fp32 100.0 GFLOP/s, bf16 300.0 GFLOP/s (3.00x fp32)" in out
    torch_dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype]
    assert f"MFU against {torch_dtype} 1024x1024 matmul measured in this process: {peak / 1e9:.1f} GFLOP/s" in out


def test_peers_match_the_backbones_parameter_count_and_get_their_rows(capsys):
    """``--peers`` with no names: transformers' GPT-2 against ``learnable`` and GPT-NeoX against ``rope``, built from a
    config (no download), with the backbone's parameter count (vocabulary 500 is padded to 512 on both sides), each
    timed with the backbone in one process; the table prints each one's row."""
    result = bench.main(TINY + ["--peers"])
    rows = {row["peer"]: row for row in result["peers"]}
    assert list(rows) == ["gpt2", "neox"]
    assert rows["gpt2"]["against"] == "learnable" and rows["neox"]["against"] == "rope"
    for row in rows.values():
        assert row["peer_params"] == row["params"]
        assert row["ratio"][32] == pytest.approx(row["tok_s"][32] / row["peer_tok_s"][32])
    out = capsys.readouterr().out
    params = 512 * 32 + 32 * 32 + (2 * 64 + 32 * 96 + 96 + 32 * 32 + 32 + 2 * 32 * 128 + 128 + 32) + 64
    assert rows["gpt2"]["params"] == params, "tied embeddings, a 32-row position table, one block, the final norm"
    assert f"| gpt2 (GPT2LMHeadModel) | learnable | {params:,} / {params:,} |" in out
    assert "| neox (GPTNeoXForCausalLM) | rope |" in out


def test_llama_peer_differs_only_where_its_block_does():
    """Llama's block (RMSNorm, a SwiGLU MLP of 8/3 x width, no biases) cannot hold the backbone's parameters; its
    embeddings, attention width and depth are the backbone's."""
    config = variants.make_config(shape(n_embd=48, vocab_size=500), "rope", 32)
    llama = peer_models.build_peer("llama", config)
    assert not peer_models.PEERS["llama"].same_parameters and llama.training
    assert llama.get_input_embeddings().weight is llama.get_output_embeddings().weight
    assert llama.get_input_embeddings().weight.shape == (512, 48) and len(llama.model.layers) == 2
    assert llama.model.layers[0].mlp.up_proj.out_features == 128


@pytest.mark.parametrize("activation", ["relu", "softplus"])
def test_the_cable_paper_peer_computes_cable_nw_with_the_whole_bias_matrix(activation):
    """The released code's CABLE (a (B, H, T, T) bias, baddbmm, softmax) given the backbone's weights gives the
    backbone's logits on its own fold path, past the training length, in values and gradients: the bench times one
    function two ways. Its parameter count is the backbone's."""
    from cable_lightning.positional.cable import CableNw

    torch.manual_seed(0)
    config = BackboneConfig(preset="gpt2-tiny", n_layer=2, n_head=2, n_embd=32, vocab_size=500, block_size=32,
                            pos_encoding=CableNw(bias_activation=activation), attention_backend="fold")
    ours, peer = build_backbone(config), peer_models.build_peer("cable_paper", config)
    weights = {name.replace("pe.proj.", "blocks.").replace(".weight", ".attn.bias_logit.weight")
               if name.startswith("pe.proj.") else name: p for name, p in ours.state_dict().items()}
    peer.load_state_dict(weights)
    assert variants.parameter_count(peer) == variants.parameter_count(ours)
    for p in ours.pe.parameters():
        p.data.normal_(0, 0.5)  # biases far from zero: the sums matter
    peer.load_state_dict({**weights, **{f"blocks.{i}.attn.bias_logit.weight": w.weight for i, w in
                                        enumerate(ours.pe.proj)}})
    x = torch.randint(0, 500, (2, 96))
    a, b = ours(x), peer(input_ids=x).logits
    torch.testing.assert_close(b, a, atol=2e-5, rtol=1e-4)
    a.square().mean().backward()
    b.square().mean().backward()
    for i, proj in enumerate(ours.pe.proj):
        torch.testing.assert_close(peer.blocks[i].attn.bias_logit.weight.grad, proj.weight.grad, atol=1e-6, rtol=1e-3)


def test_an_unknown_peer_is_a_one_line_error(capsys):
    with pytest.raises(SystemExit) as exit_:
        bench.main(TINY + ["--peers", "gpt3"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and err.startswith("error: ") and "'gpt3'" in err
    assert all(name in err.split("'gpt3'")[1] for name in ("gpt2", "neox", "llama")), "the valid names follow"


def test_compile_times_the_compiled_step_against_eager_with_the_compile_apart(monkeypatch, capsys):
    """``--compile``: each encoding's blocks compiled (Dynamo's eager backend stands in for inductor here), a
    fresh compile per length, its time apart from the steady steps, and the steps a fit needs to pay it back."""
    compile_, compiled = torch.compile, []
    monkeypatch.setattr(torch, "compile", lambda model, **kwargs: compiled.append(model) or compile_(
        model, **{**kwargs, "backend": "eager"}))
    result = bench.main(TINY + ["--train_lengths", "16", "32", "--compile"])
    rows = result["compiled"]
    assert [(r["pe"], r["length"]) for r in rows] == [("nope", 16), ("nope", 32)]
    assert len(compiled) == 2, "the one block compiled again for each length"
    for r in rows:
        assert r["compile_s"] >= 0 and r["speedup"] == pytest.approx(r["eager_step_s"] / r["compiled_step_s"])
        assert r["inductor_cache"] == {"hits": 0, "misses": 0}, "Dynamo's eager backend runs no inductor"
        gain = r["eager_step_s"] - r["compiled_step_s"]
        assert r["payback_steps"] == (pytest.approx(r["compile_s"] / gain) if gain > 0 else None)
    out = capsys.readouterr().out
    assert "| nope | 32 |" in out and "| 0 / 0 |" in out


def test_peers_without_transformers_is_a_one_line_error_before_any_work(monkeypatch, capsys):
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *args: None if name == "transformers" else find_spec(name, *args))
    with pytest.raises(SystemExit) as exit_:
        bench.main(TINY + ["--peers", "neox"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: --peers needs transformers") and "pip install 'cable_lightning[hf]'" in err


def test_bf16_speedup_times_each_step_in_both_dtypes_in_turns(monkeypatch, capsys):
    """``--bf16_speedup``: per encoding and length, one interleaved timing of the fp32 step and the bf16-autocast
    step of the same model on the same batch, and a table row for each."""
    dtypes, timed_together = [], []
    train_step, interleaved = bf16.train_step, bf16.interleaved

    def recording_step(model, x, device, dtype):
        dtypes.append(dtype)
        return train_step(model, x, device, dtype)

    def recording_interleaved(fns, device, repeats):
        timed_together.append(len(fns))
        return interleaved(fns, device, repeats)

    monkeypatch.setattr(bf16, "train_step", recording_step)
    monkeypatch.setattr(bf16, "interleaved", recording_interleaved)
    result = bench.main(TINY + ["--pes", "nope", "cable", "--train_lengths", "16", "32", "--bf16_speedup"])
    rows = result["bf16"]
    assert [(r["pe"], r["length"]) for r in rows] == [(pe, t) for pe in ("nope", "cable") for t in (16, 32)]
    assert dtypes[-8:] == [torch.float32, torch.bfloat16] * 4 and timed_together[-4:] == [2] * 4
    table = capsys.readouterr().out.split("bf16 autocast against fp32")[1]
    assert len([line for line in table.splitlines() if line.startswith("| nope") or line.startswith("| cable")]) == 4


def test_the_cable_paper_peer_is_timed_in_training_and_evaluation(capsys):
    """A peer that reads any length is timed at the evaluation lengths too, in turns with the project's path; the
    table prints both."""
    result = bench.main(TINY + ["--peers", "cable_paper", "--eval_lengths", "64", "128"])
    [row] = result["peers"]
    assert row["against"] == "cable_nw" and row["peer_params"] == row["params"]
    assert list(row["eval_ratio"]) == [64, 128]
    assert row["eval_ratio"][128] == pytest.approx(row["peer_eval_s"][128] / row["eval_s"][128])
    assert "| eval length | cable_nw s | cable_paper s | cable_paper / cable_nw |" in capsys.readouterr().out


def test_bidirectional_rows_are_the_encoder_and_its_cable_sees_both_sides():
    """``--bidirectional`` builds every row's model as the encoder export runs (causal false): a key after the query
    changes the query's output, which the causal model of the same weights never lets it do."""
    config = variants.make_config(shape(bidirectional=True), "cable", 16)
    assert config.causal is False and variants.make_config(shape(), "cable", 16).causal is True
    torch.manual_seed(0)
    encoder = build_backbone(config).eval()
    x = torch.randint(0, 512, (1, 16))
    later = x.clone()
    later[0, -1] = (later[0, -1] + 1) % 512
    with torch.no_grad():
        assert not torch.allclose(encoder.hidden_states(x)[0, 0], encoder.hidden_states(later)[0, 0])


def test_in_turns_times_each_encoding_with_nope_in_one_interleaved_call_per_length(monkeypatch, capsys):
    """``--in_turns``: in place of the main table, per encoding (a switch named with it) and length, its step and
    NoPE's timed together, and the cost is the first over the second."""
    from cable_lightning.bench import in_turns

    models, seconds = [], iter([0.2, 0.3, 0.1, 0.4, 0.5, 0.5])

    def paired(fns, device, repeats):
        assert len(fns) == 2
        for fn in fns:
            fn()
        return [next(seconds), next(seconds)]

    build = in_turns.build_backbone
    monkeypatch.setattr(in_turns, "build_backbone", lambda config: models.append(config) or build(config))
    monkeypatch.setattr(in_turns, "interleaved", paired)
    result = bench.main(TINY + ["--pes", "nope", "rope+attn_sink", "--train_lengths", "16", "32", "--eval_lengths",
                                "64", "--in_turns"])
    assert result["rows"] == [] and [m.label() for m in models] == ["nope", "rope+attn_sink"]
    assert [(r["pe"], r["work"], r["length"], r["cost"]) for r in result["in_turns"]] == [
        ("rope+attn_sink", "training step", 16, pytest.approx(1.5)), ("rope+attn_sink", "training step", 32, 4.0),
        ("rope+attn_sink", "evaluation", 64, 1.0)]
    out = capsys.readouterr().out
    assert "| rope+attn_sink | training step | 32 | 0.100 | 0.400 | 4.00 |" in out and "| nope |" not in out
