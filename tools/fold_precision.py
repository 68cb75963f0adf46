"""How far each encoding's default attention path is from an fp64 reference: a small backbone's loss gradients with
``auto`` in fp32 against ``materialized`` in fp64, same weights and tokens; per parameter tensor
max |g - g_ref| / max |g_ref|, the worst one and the encoding's own parameters.

    python tools/fold_precision.py --length 1000 --pes fox cable alibi
"""

from __future__ import annotations

import argparse

import torch

from cable_lightning.models import BackboneConfig, build_backbone


def gradients(pe: str, length: int, backend: str, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    config = BackboneConfig(pos_encoding=pe, n_layer=2, n_head=4, n_embd=128, vocab_size=512, block_size=length,
                            attention_backend=backend)
    model = build_backbone(config).to(dtype)
    ids = torch.randint(0, 512, (2, length + 1), generator=torch.Generator().manual_seed(1))
    model.loss(ids[:, :-1], ids[:, 1:]).backward()
    return {name: p.grad.double() for name, p in model.named_parameters() if p.grad is not None}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--length", type=int, default=1000)
    parser.add_argument("--pes", nargs="+", default=["fox", "cable", "alibi"])
    parser.add_argument("--backend", default="auto", help="the fp32 path under test")
    args = parser.parse_args(argv)
    for pe in args.pes:
        ref = gradients(pe, args.length, "materialized", torch.float64)
        got = gradients(pe, args.length, args.backend, torch.float32)
        errors = {name: ((got[name] - r).abs().max() / r.abs().max()).item() for name, r in ref.items()
                  if r.abs().max() > 0}
        worst = max(errors, key=errors.get)
        own = ", ".join(f"{name} {e:.1e}" for name, e in errors.items() if name.startswith("pe."))
        print(f"{pe} T={args.length} {args.backend}: worst {errors[worst]:.1e} ({worst}); its own: {own or '-'}")


if __name__ == "__main__":
    main()
