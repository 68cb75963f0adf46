"""The FlexAttention training path (CUDA's path for every score bias that does not fold), proven on CPU where it can be.

FlexAttention's backward adds the gradient of each tensor a score_mod reads with one atomic add per score; a per-head
parameter read at every score (KERPLE's r1 and r2) puts B x T^2 adds on a few addresses, which made the flex path
train at 0.03x NoPE on an H200. A positional bias is therefore read from a table over (head, query position, key
position) in training (``models.flex.flex_score_mod``). On CPU, FlexAttention has no backward kernel, but its eager
implementation differentiates: compiled with a recording ``aot_eager`` backend (no inductor), a training step shows
what Dynamo lifts into the kernel and how often it compiles."""

import pytest
import torch
import torch.nn.attention.flex_attention as flex_module
from compile_probe import RecordingBackend

from cable_lightning.models import BackboneConfig
from cable_lightning.models import flex as flex_mod
from cable_lightning.models.backbone import Backbone
from cable_lightning.positional import build_positional, score_bias_encodings
from cable_lightning.positional.base import PositionalBias
from cable_lightning.positional.layout import Layout

BIAS_PES = score_bias_encodings()
HEADS, WIDTH = 4, 64  # head size 16: FlexAttention's smallest on CUDA


def tiny_pe(name, causal, seed=0):
    torch.manual_seed(seed)
    config = BackboneConfig(pos_encoding=name, n_layer=2, n_head=HEADS, n_embd=WIDTH, causal=causal, block_size=16)
    pe = build_positional(config)
    with torch.no_grad():  # every learned encoding away from its initialisation
        for p in pe.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    return pe


def on_grid(score_mod, batch, t):
    """What a score_mod adds to zero scores over the whole (batch, head, query, key) grid."""
    b = torch.arange(batch).view(-1, 1, 1, 1)
    h = torch.arange(HEADS).view(1, -1, 1, 1)
    q_idx = torch.arange(t).view(1, 1, -1, 1)
    kv_idx = torch.arange(t).view(1, 1, 1, -1)
    return score_mod(torch.zeros(batch, HEADS, t, t), b, h, q_idx, kv_idx)


@pytest.mark.parametrize("laid_out", [False, True], ids=["contiguous", "layout"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidirectional"])
@pytest.mark.parametrize("pe_name", BIAS_PES)
def test_training_score_mod_equals_the_bias_in_values_and_gradients(pe_name, causal, laid_out):
    """The score_mod of a training step (a table for positional biases, the formula otherwise) adds the bias of the
    reference path (``ScoreBias.rows``) and passes the same gradients to the encoding's parameters and input."""
    pe = tiny_pe(pe_name, causal)
    batch, t = 2, 12
    h = torch.randn(batch, t, WIDTH, requires_grad=True)
    layout = None
    if laid_out:  # two documents a row, positions restarting at each, with a skip (PoSE-like) in the second row
        documents = torch.tensor([[0] * 5 + [1] * 7, [0] * 8 + [1] * 4])
        positions = torch.tensor([list(range(5)) + list(range(7)), list(range(8)) + [0, 3, 4, 9]])
        layout = Layout.build(batch, t, "cpu", documents=documents, positions=positions)
    bias = pe.score_bias(h, 1, 0, None, **({"layout": layout} if layout is not None else {}))
    extent = layout.extent if layout is not None else t
    score_mod = flex_mod.flex_score_mod(bias, HEADS, extent, h.device)
    out = on_grid(score_mod, batch, t)
    reference = bias.rows(0, t, t, batch, HEADS, h.device).expand(batch, HEADS, t, t)
    torch.testing.assert_close(out, reference, rtol=1e-5, atol=1e-6)
    assert out.requires_grad == reference.requires_grad
    if not out.requires_grad:  # a fixed bias (ALiBi)
        return
    weight = torch.randn(batch, HEADS, t, t)
    tensors = [h] + [p for p in pe.parameters() if p.requires_grad]
    got = torch.autograd.grad((out * weight).sum(), tensors, allow_unused=True, retain_graph=True)
    want = torch.autograd.grad((reference * weight).sum(), tensors, allow_unused=True)
    for g, w in zip(got, want):
        assert (g is None) == (w is None)
        if g is not None:
            torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-6)


@pytest.fixture
def recorded_flex(monkeypatch):
    """FlexAttention compiled as on CUDA (``models.flex.flex_kernel`` with its :data:`models.flex.FLEX_COMPILE`)
    through a :class:`RecordingBackend`, on CPU, with the eager backward allowed (the CPU build refuses it only for
    want of an inductor kernel)."""
    backend = RecordingBackend()
    monkeypatch.setattr(flex_module, "_validate_device", lambda *args, **kwargs: None)
    monkeypatch.setattr(flex_mod, "FLEX_BACKEND", backend)
    monkeypatch.setattr(flex_mod, "FLEX_DEVICES", ("cuda", "cpu"))
    monkeypatch.setattr(flex_mod, "_compiled_flex", {})
    yield backend


def positional_flex_encodings():
    """The encodings a training step runs through FlexAttention on CUDA (their causal bias does not fold) whose bias
    is a function of positions (the tabulated ones)."""
    return [name for name in BIAS_PES
            if isinstance(bias := tiny_pe(name, True).score_bias(torch.zeros(1, 2, WIDTH), 0, 0, None), PositionalBias)
            and not bias.foldable]


def test_the_flex_training_encodings_are_found():
    """The list below is not empty: KERPLE, T5 and FIRE are positional biases that do not fold."""
    assert {"kerple_log", "t5", "fire"} <= set(positional_flex_encodings())


def flex_and_chunked(pe_name, t, n_layer=2):
    """Two backbones with the same weights, one on the flex backend and one on chunked (the CPU's training path)."""
    models = {}
    for backend in ("flex", "chunked"):
        torch.manual_seed(0)
        models[backend] = Backbone(BackboneConfig(pos_encoding=pe_name, n_layer=n_layer, n_head=HEADS, n_embd=WIDTH,
                                                  vocab_size=96, attention_backend=backend, block_size=t))
    return models


@pytest.mark.parametrize("pe_name", positional_flex_encodings())
def test_flex_training_compiles_once_and_reads_no_per_head_parameter(pe_name, recorded_flex):
    """Two layers and two training steps compile FlexAttention once (no recompile per layer or step); no graph input
    that needs a gradient is smaller than the table (heads x T^2), so no per-head parameter collects B x T^2 atomic
    adds; and every gradient equals the chunked backend's (a table that is a view lost its gradient in AOT autograd:
    the table is a copy)."""
    t = 16
    models = flex_and_chunked(pe_name, t)
    for step in range(2):
        ids = torch.randint(0, 96, (2, t))
        for model in models.values():
            model.zero_grad()
            model.loss(ids, ids).backward()
    assert len(recorded_flex.graphs) == 1, recorded_flex.graphs
    q_k_v = 2 * HEADS * t * (WIDTH // HEADS)
    inputs = recorded_flex.graphs[0]
    assert inputs.count(q_k_v) == 3 and inputs.count(HEADS * t * t) >= 1, inputs
    assert all(n >= HEADS * t * t for n in inputs if n != q_k_v), inputs
    for (name, p), reference in zip(models["flex"].named_parameters(), models["chunked"].parameters()):
        torch.testing.assert_close(p.grad, reference.grad, rtol=1e-4, atol=1e-6, msg=lambda m: f"{name}: {m}")


def test_a_block_mask_first_built_in_inference_mode_trains(recorded_flex):
    """Lightning validates under ``torch.inference_mode``, and a block mask is cached per shape: one first built there
    (a sanity check or a ``validate`` before training, at the training length) was an inference tensor, and the next
    training step at that shape failed ("Inference tensors cannot be saved for backward")."""
    t = 16
    model = flex_and_chunked("kerple_log", t, n_layer=1)["flex"]
    flex_mod._causal_block_mask.cache_clear()
    ids = torch.randint(0, 96, (2, t))
    with torch.inference_mode():
        model.loss(ids, ids)
    model.loss(ids, ids).backward()
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)


def test_flex_evaluation_shares_its_kernels_across_lengths_and_batches(recorded_flex):
    """Without a gradient the bias is computed at each score (no table), and the evaluation shapes (more lengths and
    batch sizes than Dynamo's recompile limit of 8, as a long-context validation and its partial last batch run) share
    a few kernels with symbolic shapes: compiled once per shape, the ninth ran uncompiled without a word (here the
    suite fails at the limit). Dynamo specialises a size of 1, so a one-row batch and a length of one mask block (128
    tokens) compile apart: at most 5 evaluation kernels, whatever the lengths, then no new length or batch compiles.
    The training kernel is compiled once and kept."""
    t = 16
    model = flex_and_chunked("kerple_log", t)["flex"]
    ids = torch.randint(0, 96, (2, t))

    def evaluate(lengths, batches):
        with torch.no_grad():
            for rows in batches:
                for length in lengths:
                    ids_long = torch.randint(0, 96, (rows, length * t))
                    model.loss(ids_long, ids_long)

    model.loss(ids, ids).backward()
    evaluate(range(1, 13, 2), (1, 3))  # 16 to 176 tokens: one mask block and two
    model.loss(ids, ids).backward()
    compiled = len(recorded_flex.graphs)
    assert compiled <= 6, recorded_flex.graphs  # training; evaluation: the first shape, then {1, more} x {1, more}
    evaluate(range(2, 21, 3), (2, 5, 1))
    assert len(recorded_flex.graphs) == compiled


def test_a_run_past_the_limit_warns_once_and_gives_the_same_numbers(recorded_flex, monkeypatch):
    """Outside the suite (Dynamo not set to fail), a compiled FlexAttention past the recompile limit says so in one
    warning and runs uncompiled with the same result."""
    monkeypatch.setattr(flex_mod, "_warned_flex_fallback", False)
    monkeypatch.setitem(flex_mod.FLEX_COMPILE, False, dict(dynamic=False))  # every length a compile of its own
    model = flex_and_chunked("alibi", 16)["flex"]
    with torch.no_grad(), torch._dynamo.config.patch(recompile_limit=2, fail_on_recompile_limit_hit=False):
        with pytest.warns(UserWarning) as caught:
            for length in (8, 16, 24, 32):
                ids = torch.randint(0, 96, (1, length))
                out = model.hidden_states(ids)
        monkeypatch.setattr(flex_mod, "FLEX_DEVICES", ())
        torch.testing.assert_close(out, model.hidden_states(ids))
    mine = [w for w in caught if "FlexAttention hit Dynamo's recompile limit (2" in str(w.message)]
    assert len(mine) == 1 and "\n" not in str(mine[0].message), [str(w.message) for w in caught]


def test_flex_trains_on_cuda_with_tiles_that_fit_its_shared_memory_and_evaluates_with_inductors_own(monkeypatch):
    """Inductor's default tiles for a compiled training block that reads a position table asked an H100 for 245,760
    bytes of shared memory (it has 232,448), and the fit failed; ``FLEX_TRAIN_KERNEL_OPTIONS`` compiled and trained
    there. Where FlexAttention runs compiled (CUDA; here the CPU stands in, the kernel recorded), a step with a
    gradient asks for those tiles and an evaluation leaves the choice to inductor; uncompiled FlexAttention (the CPU)
    gets none."""
    q = torch.randn(1, HEADS, 32, WIDTH // HEADS)
    pe = tiny_pe("kerple_log", causal=True)
    calls = []

    def recording_kernel(device):
        def run(*args, **kwargs):
            calls.append(kwargs["kernel_options"])
            return flex_module.flex_attention(*args, **kwargs)
        return run

    def run_flex(grad):
        with torch.set_grad_enabled(grad):
            flex_mod.attend_flex(q, q, q, pe.score_bias(torch.zeros(1, 32, WIDTH), 0, 0, None), True, 0)

    monkeypatch.setattr(flex_mod, "flex_kernel", recording_kernel)
    run_flex(grad=True)
    assert calls == [None]  # the CPU: FlexAttention is not compiled there
    monkeypatch.setattr(flex_mod, "FLEX_DEVICES", ("cuda", "cpu"))
    run_flex(grad=True)
    run_flex(grad=False)
    assert calls[1:] == [flex_mod.FLEX_TRAIN_KERNEL_OPTIONS, None]
    assert calls[1] is not flex_mod.FLEX_TRAIN_KERNEL_OPTIONS  # a copy: a kernel cannot change the project's tiles
