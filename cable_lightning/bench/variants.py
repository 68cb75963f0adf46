"""What the bench builds: a backbone config per variant (an encoding's label, optionally with an attention backend),
the name its rows carry, the default variants and a model's parameter count."""

from __future__ import annotations

from ..models import BackboneConfig
from ..models.config import split_switches, with_switches
from ..models.flex import FLEX_MIN_HEAD_DIM
from ..positional import available, from_label


def make_config(args, variant: str, block_size: int, causal: bool | None = None) -> BackboneConfig:
    """``variant`` is an encoding's label (``dape_v2+kerple_log``), with attention switches as a sweep names them
    (``rope+attn_sink``), optionally with an attention backend: ``cable:materialized`` is the naive CABLE of the
    paper's release (full (B, H, T, T) bias added to q.k^T, softmax, times v). ``causal`` None: the bench's
    ``--bidirectional`` decides (an encoder, as export and retrieval run it)."""
    label, _, backend = variant.partition(":")
    name, switches = split_switches(label)
    if causal is None and getattr(args, "bidirectional", False):
        causal = False
    overrides = {k: getattr(args, k) for k in ("n_layer", "n_head", "n_embd", "vocab_size")
                 if getattr(args, k) is not None}
    if causal is not None:
        overrides["causal"] = causal
    return BackboneConfig(preset=args.preset, pos_encoding=name, block_size=block_size,
                          attention_backend=backend or "auto", **overrides, **{switch: True for switch in switches})


def row_name(variant: str) -> str:
    """The variant as its rows are named: the encoding's label (``dape_v2`` -> ``dape_v2+cable``) and its switches,
    then the backend."""
    label, colon, backend = variant.partition(":")
    name, switches = split_switches(label)
    return with_switches(from_label(name).label(), switches) + colon + backend


def default_variants(device, head_dim: int) -> list[str]:
    """Every registered encoding, then CABLE and ALiBi on the bias paths ``auto`` no longer picks for them (it folds
    them), the naive CABLE, and DAPEv2 over KERPLE (with DAPEv2 over CABLE, its default base: the CABLE paper's cost
    comparison)."""
    bias_path = "flex" if device.type == "cuda" and head_dim >= FLEX_MIN_HEAD_DIM else "chunked"
    return available() + [f"cable:{bias_path}", f"alibi:{bias_path}", "cable:materialized", "dape_v2+kerple_log"]


def parameter_count(model) -> int:
    return sum(p.numel() for p in model.parameters())
