"""bf16 and compile on CPU, before any GPU run: a training step of every registered encoding under Lightning's
bf16-mixed autocast, and ``compile: true`` for one encoding per attention backend, against fp32 and eager."""

import pytest
import torch
from lightning.pytorch.plugins.precision import MixedPrecision

from cable_lightning.lit import CausalLM
from cable_lightning.models import BackboneConfig, build_backbone
from cable_lightning.positional import available, from_label

# bf16-mixed against fp32 on the same weights and batch (measured: loss within 2.5e-4 nats, gradients 3-7e-3 relative
# for every encoding at 128 tokens after 10 steps); the bounds leave 8x and 3x room.
LOSS_TOL, GRAD_TOL = 2e-3, 2e-2
SHAPE = dict(n_layer=2, n_head=2, n_embd=32, vocab_size=512)


def batch(length: int, rows: int = 2) -> torch.Tensor:
    return torch.randint(0, SHAPE["vocab_size"], (rows, length + 1), generator=torch.Generator().manual_seed(0))


def trained(name: str, length: int, steps: int = 10) -> torch.nn.Module:
    """A model a few fp32 steps into training on ``batch``: at initialisation attention is near uniform and every
    encoding's loss is log(vocab) whatever the precision, so the comparison would show nothing."""
    torch.manual_seed(1)
    model = build_backbone(BackboneConfig(pos_encoding=from_label(name), block_size=length, **SHAPE))
    ids = batch(length)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
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


@pytest.mark.parametrize("name", available())
def test_bf16_mixed_training_step_is_finite_and_near_fp32(name):
    model, ids = trained(name, 128), batch(128)
    loss32, grads32 = loss_and_grads(model, ids, torch.enable_grad())
    loss16, grads16 = loss_and_grads(model, ids, MixedPrecision("bf16-mixed", "cpu").forward_context())
    assert torch.isfinite(torch.tensor(loss16)) and torch.isfinite(grads16).all()
    assert loss16 != loss32, "the step ran in bf16"
    assert abs(loss16 - loss32) <= LOSS_TOL
    assert ((grads16 - grads32).norm() / grads32.norm()).item() <= GRAD_TOL


# One encoding per attention backend that trains on CPU: sdpa, fold, chunked (a bias), chunked (logit scores).
# FlexAttention trains on CUDA only (tests/test_attention.py; tools/gpu_acceptance.py compiles it there).
COMPILED = {"nope": "sdpa", "cable": "fold", "kerple_log": "chunked", "cope": "chunked"}


@pytest.mark.parametrize("name", COMPILED)
def test_compile_equals_eager(name):
    """``model.compile: true`` (configure_model compiles each block with inductor): loss and gradients equal eager's
    to fp32 rounding (measured below 1e-6 relative)."""
    config = BackboneConfig(pos_encoding=from_label(name), attention_backend=COMPILED[name], block_size=64, **SHAPE)
    eager, compiled = CausalLM(config), CausalLM(config, compile=True)
    compiled.load_state_dict(eager.state_dict())
    compiled.configure_model()
    ids = batch(64)
    loss, grads = loss_and_grads(eager.backbone, ids, torch.enable_grad())
    loss_c, grads_c = loss_and_grads(compiled.backbone, ids, torch.enable_grad())
    assert loss_c == pytest.approx(loss, rel=1e-5)
    torch.testing.assert_close(grads_c, grads, rtol=1e-4, atol=1e-6)
