"""The backbone's attention switches (QK-norm, a learned sink, the output gate): each against a slow obvious reference
in values and gradients, and the sink on every backend that carries it (test_backbone runs all three beside every
encoding through its causality, cached-decoding and padding tests)."""

import argparse
import glob
import json
import math
import os

import pytest
import torch
import torch.nn.functional as F

from cable_lightning import sweep
from cable_lightning.errors import ConfigError
from cable_lightning.gpu_check import flex
from cable_lightning.models import BackboneConfig, build_backbone
from cable_lightning.models import attention as attn_mod
from cable_lightning.models.attention import attention, attention_map
from cable_lightning.models.config import SWITCHES, split_switches
from cable_lightning.positional import encoding_class
from cable_lightning.positional.layout import Layout


def with_sink_reference(q, k, v, bias, causal, sink, q_offset=0, key_padding=None, window=None, documents=None):
    """The obvious formula: the masked scores the reference path builds without a sink (-inf where hidden), one more
    column holding the head's sink logit, a softmax over both, the sink's column dropped, times v."""
    scores = attention_map(q, k, bias, causal, q_offset, 0, key_padding, window, documents).scores
    column = sink.to(scores.dtype).view(1, -1, 1, 1).expand(*scores.shape[:-1], 1)
    weights = torch.cat([scores, column], dim=-1).softmax(dim=-1)[..., :-1]
    return weights @ v.to(weights.dtype)


def sink_inputs(pe_name, causal, t, dtype=torch.float64):
    pe, h, q, k, v = flex.inputs(pe_name, causal, t)
    pe = pe.to(dtype)
    h, q, k, v = (x.detach().to(dtype).requires_grad_() for x in (h, q, k, v))
    sink = torch.tensor([-1.0, 0.0, 0.5, 2.0], dtype=dtype, requires_grad=True)  # one logit per head
    return pe, h, q, k, v, sink


# No bias (SDPA), foldable biases, a bias that does not factorise, and scores made from the logits.
SINK_PES = ["nope", "alibi", "cable", "fox", "kerple_log", "t5", "cope"]


def sink_backends(pe_name, causal):
    kind = encoding_class(pe_name).scores
    return [b for b in attn_mod.backends_for(kind, causal) if b not in ("auto", "flex")]


SINK_CASES = [(pe, causal, backend) for pe in SINK_PES for causal in (True, False)
              for backend in sink_backends(pe, causal)]


@pytest.mark.parametrize("t", [1, 7, 129])
@pytest.mark.parametrize("pe_name, causal, backend", SINK_CASES)
def test_a_sink_is_one_more_logit_in_every_softmax_on_every_backend(pe_name, causal, backend, t, monkeypatch):
    monkeypatch.setattr(attn_mod, "CHUNK_ELEMENTS", 2 * 4 * 129 * 10)  # several row blocks at 129 tokens
    pe, h, q, k, v, sink = sink_inputs(pe_name, causal, t)
    scores = pe.score_bias(h, 1, 0, None)
    tensors = [q, k, v, sink, h, *pe.parameters()]
    out = attention(q, k, v, scores, causal, backend=backend, sink=sink)
    ref = with_sink_reference(q, k, v, pe.score_bias(h, 1, 0, None), causal, sink)
    close(out, ref, backend)
    got, want = (flex.gradients(x, tensors) for x in (out, ref))
    assert got[3].abs().max() > 0  # the sink learns
    for a, b in zip(got, want):
        assert (a is None) == (b is None)
        if a is not None:
            close(a, b, backend)


def close(got, want, backend):
    """fp64 everywhere but in the fold, whose factors are fp32: there the bound of the fold's own test (relative to
    the largest element; FoX's gate offset gradient is the hardest)."""
    if backend != "fold":
        torch.testing.assert_close(got, want, rtol=1e-7, atol=1e-9)
        return
    error = ((got - want).abs().max() / want.abs().max().clamp(min=1e-3)).item()
    assert error < 1e-3, error


def test_without_the_sink_the_outputs_differ():
    """The reference above is not satisfied by attention that ignores the sink."""
    pe, h, q, k, v, sink = sink_inputs("alibi", True, 9)
    plain = attention(q, k, v, pe.score_bias(h, 1, 0, None), True, backend="fold")
    ref = with_sink_reference(q, k, v, pe.score_bias(h, 1, 0, None), True, sink)
    assert (plain - ref).abs().max() > 1e-2


@pytest.mark.parametrize("backend", ["sdpa", "chunked", "materialized"])
def test_a_sink_with_padding_a_window_documents_and_a_cache_prefix(backend):
    pe, h, q, k, v, sink = sink_inputs("nope", False, 12)
    padding = torch.ones(2, 12, dtype=torch.bool)
    padding[1, 8:] = False
    documents = Layout.build(2, 12, "cpu", documents=torch.tensor([0] * 5 + [1] * 7))
    cases = [dict(causal=False, key_padding=padding), dict(causal=True, window=4),
             dict(causal=True, documents=documents), dict(causal=False, window=3)]
    for case in cases:
        layout = case.get("documents")
        kwargs = {key: value for key, value in case.items() if key != "documents"}
        out = attention(q, k, v, None, backend=backend, sink=sink, layout=layout, **kwargs)
        ref = with_sink_reference(q, k, v, None, sink=sink, documents=layout, **kwargs)
        torch.testing.assert_close(out, ref, rtol=1e-7, atol=1e-9)
    # the last 4 queries onto a cache of 8 keys before them
    out = attention(q[:, :, 8:], k, v, None, True, q_offset=8, backend=backend, sink=sink)
    torch.testing.assert_close(out, with_sink_reference(q[:, :, 8:], k, v, None, True, sink, q_offset=8),
                               rtol=1e-7, atol=1e-9)


@pytest.mark.parametrize("pe_name", ["alibi", "cable", "fox"])
def test_the_folded_sink_in_bf16_is_as_near_the_fp64_reference_as_the_fold_without_one(pe_name):
    """The fold shifts each row's logits by a constant that grows with position (ALiBi's slope times the distance
    from the row block's centre): the sink moves with it, in pieces, so it costs no precision at 1000 tokens."""
    pe, h, q, k, v, sink = sink_inputs(pe_name, True, 1000)
    with torch.no_grad():
        for p in pe.parameters():
            p.mul_(0.3)
        ref = with_sink_reference(q, k, v, pe.score_bias(h, 1, 0, None), True, sink)
        plain_ref = attention(q, k, v, pe.score_bias(h, 1, 0, None), True, backend="materialized")
        low = [x.bfloat16() for x in (q, k, v)]
        bias = pe.float().score_bias(h.float(), 1, 0, None)
        folded = attention(*low, bias, True, backend="fold", sink=sink.float())
        plain = attention(*low, pe.score_bias(h.float(), 1, 0, None), True, backend="fold")

    def error(out, want):
        return ((out.double() - want).abs().max() / want.abs().max()).item()

    assert error(folded, ref) < 2 * error(plain, plain_ref) + 1e-3, (error(folded, ref), error(plain, plain_ref))


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidirectional"])
@pytest.mark.parametrize("pe_name", ["nope", "alibi", "kerple_log"])
def test_flexattention_carries_the_sink_through_its_log_sum_exp(pe_name, causal):
    """On the CPU FlexAttention runs forward only: values here, gradients where gpu-check runs."""
    pe, h, q, k, v = flex.inputs(pe_name, causal, 37, head_dim=16, requires_grad=False)
    sink = torch.tensor([-1.0, 0.0, 0.5, 2.0])
    with torch.no_grad():
        scores = pe.score_bias(h, 1, 0, None)
        out = attention(q, k, v, scores, causal, backend="flex", sink=sink)
        ref = with_sink_reference(q, k, v, pe.score_bias(h, 1, 0, None), causal, sink)
    torch.testing.assert_close(out, ref.float(), rtol=1e-4, atol=1e-5)


def tiny(pe, switches, causal=True):
    torch.manual_seed(0)
    config = BackboneConfig(pos_encoding=pe, n_layer=2, n_head=4, n_embd=32, vocab_size=97, causal=causal,
                            block_size=64, **dict.fromkeys(switches, True))
    model = build_backbone(config).eval()
    with torch.no_grad():  # every switch's weights off their initial values, so that each one matters
        for name, p in model.named_parameters():
            if "pe." in name or "norm" in name or "sink" in name or "gate" in name:
                p.add_(torch.randn_like(p) * 0.3)
    return model


def test_qk_norm_is_rmsnorm_over_each_heads_q_and_k_before_the_encoding():
    model = tiny("nope", switches=("qk_norm",))
    attn = model.blocks[0].attn
    h = torch.randn(2, 5, 32, requires_grad=True)
    q, k, v = attn.queries_keys_values(h, model.pe, 0)
    raw = attn.qkv(h).view(2, 5, 3, 4, 8).permute(2, 0, 3, 1, 4)

    def rms(x, weight):
        return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * weight

    want_q, want_k = rms(raw[0], attn.q_norm.weight), rms(raw[1], attn.k_norm.weight)
    torch.testing.assert_close(q, want_q)
    torch.testing.assert_close(k, want_k)
    torch.testing.assert_close(v, raw[2])
    probe = torch.randn_like(q)
    got = torch.autograd.grad((q * probe).sum() + (k * probe).sum(), (h, attn.q_norm.weight, attn.k_norm.weight))
    want = torch.autograd.grad((want_q * probe).sum() + (want_k * probe).sum(),
                               (h, attn.q_norm.weight, attn.k_norm.weight))
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)


def test_the_gate_multiplies_each_heads_output_by_a_sigmoid_of_the_layers_input():
    model = tiny("nope", switches=("attn_gate",))
    attn = model.blocks[0].attn
    h = torch.randn(2, 6, 32, requires_grad=True)
    out = attn(h, model.pe, 0, None)
    q, k, v = attn.queries_keys_values(h, model.pe, 0)
    heads = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(2, 6, 32)
    gate = 1 / (1 + torch.exp(-(h @ attn.gate.weight.T + attn.gate.bias)))
    want = (heads * gate) @ attn.out.weight.T + attn.out.bias
    torch.testing.assert_close(out, want)
    probe = torch.randn_like(out)
    for a, b in zip(torch.autograd.grad((out * probe).sum(), (h, attn.gate.weight)),
                    torch.autograd.grad((want * probe).sum(), (h, attn.gate.weight))):
        torch.testing.assert_close(a, b)


def test_the_sink_of_a_backbone_layer_is_one_logit_per_head_that_takes_weight_from_the_keys():
    model = tiny("nope", switches=("attn_sink",))
    attn = model.blocks[0].attn
    assert attn.sink.shape == (4,)
    h = torch.randn(1, 6, 32)
    q, k, v = attn.queries_keys_values(h, model.pe, 0)
    logits = (q @ k.transpose(-1, -2)) / math.sqrt(8)
    logits = logits.masked_fill(~torch.ones(6, 6, dtype=torch.bool).tril(), float("-inf"))
    column = attn.sink.view(1, 4, 1, 1).expand(1, 4, 6, 1)
    weights = torch.cat([logits, column], dim=-1).softmax(-1)[..., :-1]
    heads = (weights @ v).transpose(1, 2).reshape(1, 6, 32)
    torch.testing.assert_close(attn(h, model.pe, 0, None), attn.out(heads))


def test_a_sink_beside_weights_that_are_no_softmax_is_refused_in_one_line():
    with pytest.raises(ConfigError, match=r"^attn_sink needs softmax attention; stick_breaking's weights are no "
                                          r"softmax .*leave attn_sink false$"):
        BackboneConfig(pos_encoding="stick_breaking", attn_sink=True)
    with pytest.raises(ConfigError, match=r"^attn_sink needs softmax attention; layers-rope-stick_breaking"):
        BackboneConfig(pos_encoding="layers-rope-stick_breaking", attn_sink=True)


def test_switches_name_the_run_and_join_its_weight_settings_only_when_on():
    plain, switched = BackboneConfig(pos_encoding="rope"), BackboneConfig(pos_encoding="rope", qk_norm=True,
                                                                          attn_gate=True)
    assert plain.label() == "rope" and switched.label() == "rope+attn_gate+qk_norm"
    assert not set(SWITCHES) & set(plain.weight_settings())
    assert switched.weight_settings()["attn_gate"] is True and "attn_sink" not in switched.weight_settings()
    assert split_switches("dape_v2+cable+qk_norm+attn_gate") == ("dape_v2+cable", ["attn_gate", "qk_norm"])
    with pytest.raises(ConfigError, match=r"^'rope\+qk_norm\+qk_norm' names a switch twice"):
        split_switches("rope+qk_norm+qk_norm")


def test_a_switched_sweep_run_trains_in_a_folder_and_records_named_by_its_switches(tiny_corpus_dir, tmp_path):
    """The sweep's ``--pes rope+attn_sink`` turns the switch on, and the fit names its folder and records by it."""
    from conftest import args as fit_args

    from cable_lightning.cli import main

    runs = str(tmp_path / "runs")
    (_, cmd), = sweep.commands(argparse.Namespace(config=["configs/quickstart.yaml"], pes=["rope+attn_sink"],
                                                  seeds=None, train_lengths=None, lrs=None, experiment="test",
                                                  runs_dir=runs, extra=[], stage="fit"))
    switch = cmd.index("--model.init_args.backbone.attn_sink")
    assert cmd[switch + 1] == "true"
    main(["fit", *fit_args(tiny_corpus_dir, runs, pe="rope", steps=2, every=2), *cmd[switch : switch + 2]])
    rows = [json.loads(line) for path in glob.glob(os.path.join(runs, "test", "rope+attn_sink", "version_*",
                                                                "length_eval.jsonl")) for line in open(path)]
    assert rows and {row["pe"] for row in rows} == {"rope+attn_sink"}
    assert json.loads(rows[0]["settings"] if isinstance(rows[0]["settings"], str) else
                      json.dumps(rows[0]["settings"]))["attn_sink"] is True
    assert not os.path.exists(os.path.join(runs, "test", "rope"))


def test_the_attention_diagnostics_see_the_weight_a_row_gives_its_sink():
    """A row's weights on the keys sum to what its sink leaves: 1 / (1 + e^-s) of it with all logits 0."""
    from cable_lightning.eval.diagnostics import AttentionStats, recording

    model = tiny("nope", switches=("attn_sink",))
    with torch.no_grad():
        for block in model.blocks:
            block.attn.qkv.weight.zero_()  # every logit 0: each row's mass on its keys is n / (n + e^s)
            block.attn.qkv.bias.zero_()
            block.attn.sink.copy_(torch.tensor([0.0, 1.0, 2.0, 3.0]))
    stats = AttentionStats()
    with recording(model, stats):
        model(torch.randint(0, 97, (1, 8)))
    for row in stats.results():
        expected = sum(n / (n + math.exp(row["head"])) for n in range(1, 9)) / 8
        assert row["mass"] == pytest.approx(expected, rel=1e-5), row


def test_a_checkpoint_is_loaded_with_its_own_switches_or_refused_in_one_line():
    from cable_lightning.lit.resume import check_before_building

    saved = {"hyper_parameters": {"backbone": BackboneConfig(pos_encoding="rope", attn_sink=True).to_dict()}}
    check_before_building(saved, BackboneConfig(pos_encoding="rope", attn_sink=True), None, "validate", "last.ckpt")
    with pytest.raises(ConfigError, match=r"^the checkpoint's model differs from the configured one in settings that "
                                          r"define the weights: attn_sink \(checkpoint True, configured False\), "
                                          r"qk_norm \(checkpoint False, configured True\); remove them"):
        check_before_building(saved, BackboneConfig(pos_encoding="rope", qk_norm=True), None, "validate", "last.ckpt")
