"""FlexAttention against the materialised reference for every encoding with a pointwise score bias: its values, and on
CUDA (where this torch runs its backward) its gradients with respect to q, k, v, the layer's input and the encoding's
parameters. gpu-check's last part runs it in a child process of its own (Dynamo's compiles there do not count
against the fits'), as ``python -m cable_lightning.gpu_check.flex``; tests/test_attention.py asserts the same check,
so the package carries what it runs and needs no source tree."""

from __future__ import annotations

import sys

import torch

from ..errors import ArgumentParser
from ..models import BackboneConfig
from ..models.attention import attention
from ..models.flex import FLEX_MIN_HEAD_DIM
from ..positional import build_positional, score_bias_encodings

# assert_close's tolerances on each device: CUDA's kernels sum in another order than the reference
TOLERANCES = {"cpu": {"atol": 2e-5, "rtol": 1e-4}, "cuda": {"atol": 1e-4, "rtol": 1e-3}}
LENGTH = 129  # past one 128-wide block of FlexAttention's kernels


def inputs(name: str, causal: bool, length: int, seed: int = 0, head_dim: int = 8, device="cpu",
           requires_grad: bool = True):
    """(pe, h, q, k, v) for a 4-head layer of encoding ``name``: its learned parameters moved off their initial
    values (T5's table starts at zero), and inputs that require gradients unless told not to (FlexAttention on a
    CPU refuses inputs that do, even where no gradient is taken)."""
    torch.manual_seed(seed)
    config = BackboneConfig(pos_encoding=name, n_layer=2, n_head=4, n_embd=32, causal=causal, block_size=16)
    pe = build_positional(config)
    with torch.no_grad():
        for p in pe.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    h = torch.randn(2, length, 32)
    q, k, v = (torch.randn(2, 4, length, head_dim) for _ in range(3))
    return (pe.to(device), *(x.to(device).requires_grad_(requires_grad) for x in (h, q, k, v)))


def attend(backend: str, pe, h, q, k, v, causal: bool):
    """Layer 1's attention of (q, k, v) with the encoding's score bias, on ``backend``."""
    return attention(q, k, v, pe.score_bias(h, 1, 0, None), causal, backend=backend)


def gradients(out, tensors) -> tuple:
    """The gradients of a fixed random projection of ``out`` with respect to ``tensors`` (None where unused)."""
    torch.manual_seed(1)
    weight = torch.randn_like(out)
    return torch.autograd.grad((out * weight).sum(), tensors, allow_unused=True)


def mismatch(name: str, device: str, causal: bool = True, length: int = LENGTH, backward: bool = True) -> str | None:
    """None where FlexAttention's output (and with ``backward``, every gradient) for encoding ``name`` matches the
    materialised reference on ``device``; else one line saying what differs."""
    head_dim = FLEX_MIN_HEAD_DIM if device == "cuda" else 8  # the least its CUDA kernels take
    pe, h, q, k, v = inputs(name, causal, length, head_dim=head_dim, device=device, requires_grad=backward)
    tolerance = TOLERANCES[torch.device(device).type]
    with torch.set_grad_enabled(backward):
        ref, out = attend("materialized", pe, h, q, k, v, causal), attend("flex", pe, h, q, k, v, causal)
    checks = [("output", out, ref)]
    if backward:
        named = {"q": q, "k": k, "v": v, "h": h, **dict(pe.named_parameters())}
        tensors = list(named.values())
        checks += [(f"gradient of {what}", got, want)
                   for what, got, want in zip(named, gradients(out, tensors), gradients(ref, tensors))]
    for what, got, want in checks:
        if want is None:  # the reference does not use it either
            continue
        if got is None:
            return f"{name}: FlexAttention gives no {what}, which the reference has"
        try:
            torch.testing.assert_close(got, want, **tolerance)
        except AssertionError as exc:
            detail = next((line.strip() for line in str(exc).splitlines() if line.strip().startswith("Greatest")),
                          str(exc).strip().splitlines()[0])
            return f"{name}: FlexAttention's {what} differs from the reference ({detail})"
    return None


def main(argv: list[str] | None = None) -> int:
    """Checks every score-bias encoding on CUDA, one line each and a summary last; exit 1 if any differs. ``--list``
    names what it would check and runs nothing (gpu-check's CPU rehearsal)."""
    parser = ArgumentParser(prog="python -m cable_lightning.gpu_check.flex", description=__doc__)
    parser.add_argument("--list", action="store_true", help="name the encodings it checks and run nothing")
    args = parser.parse_args(argv)
    names = score_bias_encodings()
    if args.list:
        print(f"checks {len(names)} encodings on CUDA: {', '.join(names)}")
        return 0
    if not torch.cuda.is_available():
        print("error: the FlexAttention check needs CUDA (its backward runs there); --list names what it checks",
              file=sys.stderr)
        return 2
    failed = [problem for name in names if (problem := mismatch(name, "cuda")) is not None]
    for problem in failed:
        print(problem, flush=True)
    print(f"FlexAttention matches the reference for {len(names) - len(failed)} of {len(names)} encodings (values "
          "and gradients, CUDA)", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
