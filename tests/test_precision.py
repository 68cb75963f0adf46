"""bf16 and compile on CPU, before any GPU run: a training step of every registered encoding under Lightning's
bf16-mixed autocast, and ``compile: true`` for one encoding per attention backend, against fp32 and eager."""

import json
import math

import pytest
import torch
from compile_probe import RecordingBackend
from lightning.pytorch.plugins.precision import MixedPrecision

from cable_lightning.lit import CausalLM
from cable_lightning.models import BackboneConfig, attention, build_backbone
from cable_lightning.models import flex as flex_mod
from cable_lightning.positional import available, from_label

# bf16-mixed against fp32 on the same weights and batch. Measured on every encoding: the loss 5e-5 to 1.3e-3 nats
# off (about 0.03% of it at most), the gradients 2.4e-3 to 5.7e-3 relative (their norm's error).
LOSS_TOL, GRAD_TOL = 5e-3, 2e-2
# Each encoding's own parameters, on their own (measured: 2e-4 to 3.0e-2 relative, KERPLE-CABLE's the largest; T5's
# table 5.5e-3; 1.1 times T5's bias under autocast alone gives 9.9e-2); a parameter whose true gradient is about zero
# (FIRE's output bias: a constant added to every score of a head, which softmax removes) is measured against
# OWN_FLOOR of the model's gradient norm, not against its own.
OWN_GRAD_TOL, OWN_FLOOR = 5e-2, 1e-3
LENGTH = 64
SHAPE = dict(n_layer=2, n_head=2, n_embd=32, vocab_size=512)


def batch(length: int, rows: int = 2) -> torch.Tensor:
    return torch.randint(0, SHAPE["vocab_size"], (rows, length + 1), generator=torch.Generator().manual_seed(0))


def trained(name: str, length: int, steps: int = 5) -> torch.nn.Module:
    """A model a few fp32 steps into training on ``batch``: at initialisation attention is near uniform and every
    encoding's loss is log(vocab) whatever the precision, so the comparison would show nothing."""
    torch.manual_seed(1)
    model = build_backbone(BackboneConfig(pos_encoding=from_label(name), block_size=length, **SHAPE))
    ids = batch(length)
    optimizer = torch.optim.Adam(model.parameters(), lr=2e-2)
    for _ in range(steps):
        optimizer.zero_grad()
        model.loss(ids[:, :-1], ids[:, 1:]).backward()
        optimizer.step()
    return model


def loss_and_grads(model, ids, context) -> tuple[float, torch.Tensor]:
    model.zero_grad()
    with context:
        loss = model.loss(ids[:, :-1], ids[:, 1:])
    loss.backward()  # outside autocast, as Lightning's step does
    return loss.item(), torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])


def encoding_grads(model) -> dict[str, torch.Tensor]:
    """The gradients of the encoding's own parameters (T5's table, FIRE's MLP, KERPLE's slopes...), read after
    :func:`loss_and_grads`: the whole model's error is dominated by the embeddings and would hide a small table's."""
    return {name: p.grad.clone() for name, p in model.pe.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("name", available())
def test_bf16_mixed_training_step_is_finite_and_near_fp32(name, monkeypatch):
    """Through each encoding's own path: the fold, SDPA, the chunked bias or logit scores in row blocks (made
    32 rows here, so that a step crosses blocks as a long evaluation does)."""
    model, ids = trained(name, LENGTH), batch(LENGTH)
    monkeypatch.setattr(attention, "CHUNK_ELEMENTS", 2 * SHAPE["n_head"] * LENGTH * 32)
    loss32, grads32 = loss_and_grads(model, ids, torch.enable_grad())
    own32 = encoding_grads(model)
    loss16, grads16 = loss_and_grads(model, ids, MixedPrecision("bf16-mixed", "cpu").forward_context())
    own16 = encoding_grads(model)
    assert torch.isfinite(torch.tensor(loss16)) and torch.isfinite(grads16).all()
    assert loss16 != loss32, "the step ran in bf16"
    assert abs(loss16 - loss32) <= LOSS_TOL
    error = ((grads16 - grads32).norm() / grads32.norm()).item()
    print(f"{name}: loss {loss32:.4f}, bf16 off by {abs(loss16 - loss32):.1e}, gradients {error:.1e} relative")
    assert error <= GRAD_TOL
    for param, grad in own32.items():  # each of the encoding's parameters on its own, against the model's scale
        scale = max(grad.norm().item(), OWN_FLOOR * grads32.norm().item())
        own_error = (own16[param] - grad).norm().item() / scale
        print(f"  {param}: {own_error:.1e} relative")
        assert own_error <= OWN_GRAD_TOL, f"{name}'s {param}: bf16 gradient {own_error:.1e} off fp32's"


# The backends whose code is this project's own, in a training step: the fold (CABLE) and the chunked path with
# logit scores (CoPE). Inductor takes 17-25 s a test with a cold cache, 5-9 s from its on-disk cache (2 cores, not
# alone); SDPA and FlexAttention are compiled on a GPU by python -m cable_lightning gpu-check.
COMPILED = {"cable": "fold", "cope": "chunked"}


@pytest.mark.parametrize("name", COMPILED)
def test_compile_equals_eager(name):
    """``model.compile: true`` (configure_model compiles each block with inductor): the loss and gradients of a
    training step equal eager's to fp32 rounding."""
    config = BackboneConfig(pos_encoding=from_label(name), attention_backend=COMPILED[name], block_size=64,
                            **{**SHAPE, "n_layer": 1})
    eager, compiled = CausalLM(config), CausalLM(config, compile=True)
    compiled.load_state_dict(eager.state_dict())
    compiled.configure_model()
    ids = batch(64)
    loss, grads = loss_and_grads(eager.backbone, ids, torch.enable_grad())
    loss_c, grads_c = loss_and_grads(compiled.backbone, ids, torch.enable_grad())
    assert compiled.backbone.compiled_blocks is not None
    assert loss_c == pytest.approx(loss, rel=1e-5)
    torch.testing.assert_close(grads_c, grads, rtol=1e-4, atol=1e-6)


def test_compile_covers_every_layer_of_a_deep_model():
    """Every layer is compiled (one graph serves them all: tests/test_compiled_blocks.py), and Dynamo's recompile limit
    leaves room for two graphs a layer: when each layer was a graph of its own, the default limit, 8, left the blocks
    of gpt2-small (12) and gpt2-medium (24) past the 8th in eager mode, with only a warning (measured: a 10-layer CABLE
    model gave 8 graphs, 10 with the limit raised)."""
    model = CausalLM(BackboneConfig(pos_encoding=from_label("cable"), block_size=64, **{**SHAPE, "n_layer": 12}),
                     compile=True)
    model.configure_model()
    assert torch._dynamo.config.recompile_limit >= 24
    assert len(model.backbone.compiled_blocks) == 12


def test_bias_pictures_of_a_compiled_model():
    """The pictures read the last block's input through a forward hook, which a compiled block does not run; they run
    the model eagerly (this failed the first validation of every compile: true fit)."""
    from cable_lightning.callbacks.bias_pictures import last_layer_maps

    model = CausalLM(BackboneConfig(pos_encoding=from_label("cable"), block_size=64, **{**SHAPE, "n_layer": 1}),
                     compile=True)
    model.configure_model()
    text = batch(16)[:1, :16]
    with torch.no_grad():
        model.backbone.hidden_states(text)  # compiled as validation compiles it, before the hook exists
    maps, what = last_layer_maps(model.backbone, text)
    assert what == "additive bias" and maps.shape == (2, 16, 16)


def test_a_compiled_fit_holds_through_validations_at_several_lengths(tiny_corpus_dir, tmp_path, monkeypatch):
    """``compile: true`` through a whole fit: training steps, two validations at three lengths (with the diagnostics
    and the pictures, which run eager), on a model of 3 layers. No compile may hit Dynamo's recompile limit (it
    raises here instead of falling back to eager, as a GPU run once did at its first validation), and the blocks
    compile one graph for every layer, for training only (evaluation runs them eagerly; it once compiled a graph per
    layer and length). A recording ``aot_eager`` backend stands in for inductor (the count is Dynamo's; inductor's
    time is not the point)."""
    from conftest import args

    from cable_lightning.cli import main

    backend = RecordingBackend()
    original = torch.compile
    monkeypatch.setattr(torch, "compile", lambda model, **kwargs: original(model, backend=backend, **kwargs))
    torch._dynamo.reset()
    layers = 3
    main(["fit", *args(tiny_corpus_dir, str(tmp_path), steps=4, every=2,
                       extra=["--model.init_args.compile", "true", "--model.init_args.backbone.n_layer", str(layers),
                              "--data.eval_lengths", "[32, 64, 128]", "--trainer.val_check_interval", "2"])])
    torch._dynamo.reset()
    assert len(backend.graphs) == 1, len(backend.graphs)


@pytest.mark.parametrize("name", available())
def test_a_training_step_never_reads_back_to_the_host(name):
    """Forward and backward of every encoding queue their work without waiting for it: no ``.item()``, ``bool(t)``,
    ``.tolist()`` or ``.cpu()`` inside (each is a host sync on a GPU; the fold's ``F.one_hot`` was one per layer).
    The optimizer step's divergence check reads nothing that waits either (``tests/test_step_syncs.py``)."""
    from cable_lightning.eval.work import DeviceWork

    model = build_backbone(BackboneConfig(pos_encoding=from_label(name), block_size=LENGTH, **SHAPE))
    ids = batch(LENGTH)
    work = DeviceWork(model)
    with work:
        model.loss(ids[:, :-1], ids[:, 1:]).backward()
    assert work.forwards == 1 and work.transfers == 0, work.counts()


def test_the_evaluations_after_validation_run_at_the_trainers_precision(tiny_corpus_dir, tmp_path, monkeypatch):
    """The attention diagnostics and the task grid run in Lightning's validation-end hooks, outside the autocast its
    validation_step runs in: a bf16-mixed run measured them in fp32, other numbers than its evaluation's (and on a GPU
    compiled FlexAttention's evaluation kernel a second time). Both now run in the trainer's precision context, and
    their records stay finite under bf16."""
    from conftest import args

    import cable_lightning.callbacks.diagnostics as diagnostics
    import cable_lightning.callbacks.task_eval as task_eval
    from cable_lightning.cli import main

    seen = {}

    def recording(name, function):
        def run(*a, **kw):
            seen.setdefault(name, set()).add(torch.is_autocast_enabled("cpu") and
                                             torch.get_autocast_dtype("cpu") == torch.bfloat16)
            return function(*a, **kw)
        return run

    monkeypatch.setattr(diagnostics, "diagnose", recording("diagnostics", diagnostics.diagnose))
    monkeypatch.setattr(task_eval, "task_grid", recording("tasks", task_eval.task_grid))
    main(["fit", *args(tiny_corpus_dir, str(tmp_path), pe="kerple_log", steps=2, every=2,
                       extra=["--trainer.precision", "bf16-mixed", "--data.tasks", '{"passkey": {}}',
                              "--data.task_fraction", "0", "--task_eval.lengths", "[96]", "--task_eval.trials", "2"])])
    assert seen == {"diagnostics": {True}, "tasks": {True}}
    run = tmp_path / "test" / "kerple_log" / "version_0"
    attention = [json.loads(line) for line in open(run / "attention.jsonl")]
    assert attention and all(math.isfinite(r["entropy"]) for r in attention)
    tasks = [json.loads(line) for line in open(run / "task_accuracy.jsonl")]
    assert tasks and all(r["accuracy"] is not None for r in tasks)


def test_the_diagnostics_and_the_picture_reuse_the_length_evaluations_flex_kernels(tiny_corpus_dir, tmp_path,
                                                                                     monkeypatch):
    """A bf16 validation on the flex path, as on CUDA (compiled FlexAttention; a recording ``aot_eager`` backend
    stands in for inductor). The length evaluation compiles its kernels (a batch of one apart: Dynamo specialises size
    1); the attention diagnostics and the bias picture, run after it, compile nothing more. On the first GPU they
    compiled FlexAttention twice more (40-54 s of a first validation): they ran outside the autocast, and the
    picture read a batch of one."""
    from conftest import args

    from cable_lightning.cli import main

    backend = RecordingBackend()
    # width 48: at 32 the keys' offset in the packed projections equals the first length, which Dynamo's duck
    # sizing ties together (a compile per length); gpt2-small's 768 is no length it evaluates
    run = args(tiny_corpus_dir, str(tmp_path), pe="kerple_log", steps=2, every=2,
               extra=["--model.init_args.backbone.n_embd", "48"])
    main(["fit", *run])
    monkeypatch.setattr(flex_mod, "FLEX_DEVICES", ("cuda", "cpu"))
    monkeypatch.setattr(flex_mod, "FLEX_BACKEND", backend)
    monkeypatch.chdir(tmp_path)  # without a logger a validation writes its records to the working folder
    compiled = {}
    for name, extra in (("evaluation", ["--diagnostics.enabled", "false", "--trainer.logger", "false"]),
                        ("with diagnostics and picture", [])):
        monkeypatch.setattr(flex_mod, "_compiled_flex", {})
        torch._dynamo.reset()
        backend.graphs.clear()
        main(["validate", *run, "--ckpt_path", str(tmp_path / "test" / "kerple_log" / "checkpoints" / "last.ckpt"),
              "--model.init_args.backbone.attention_backend", "flex", "--trainer.precision", "bf16-mixed", *extra])
        compiled[name] = len(backend.graphs)
    torch._dynamo.reset()
    validated = tmp_path / "test" / "kerple_log" / "version_1"
    assert (validated / "attention.jsonl").exists() and any(p.name.startswith("events") for p in validated.iterdir())
    assert compiled["evaluation"] >= 1 and compiled["with diagnostics and picture"] == compiled["evaluation"], compiled
