"""Pictures of each head's positional bias in the last layer, for one fixed validation text.

Score-bias PEs (the CABLE family, FoX, ALiBi, KERPLE, FIRE, T5) show their additive bias matrix, CoPE
and DAPEv2 what they add to the logits, stick-breaking its log attention weights; the others (RoPE,
absolute, NoPE) show the last layer's pre-softmax attention scores. One image grid per evaluation in
TensorBoard, like the CABLE paper's figures 4 and 8-15.
"""

from __future__ import annotations

import math

import lightning as L
import torch
from torch.distributed.fsdp import FSDPModule

from ..positional import ScoreBias


@torch.no_grad()
def last_layer_maps(backbone, tokens: torch.Tensor) -> tuple[torch.Tensor, str]:
    """(heads, T, T) maps for one sequence (1, T) and what they show; future positions are NaN."""
    captured = {}
    block = backbone.blocks[-1]
    handle = block.ln_attn.register_forward_hook(lambda m, i, out: captured.__setitem__("h", out))
    try:
        # Without a gradient the blocks run eagerly (compile: true too): the hook runs. Two copies of the sequence:
        # on CUDA a batch of one would compile FlexAttention's evaluation kernel once more (Dynamo specialises size 1)
        backbone.hidden_states(tokens.expand(2, -1))
    finally:
        handle.remove()
    h = captured["h"][:1]
    t, heads = tokens.shape[1], backbone.config.n_head
    terms = backbone.pe.score_bias(h, block.attn.layer, 0, None)
    if isinstance(terms, ScoreBias):
        maps, what = terms.rows(0, t, t, 1, heads, tokens.device)[0].float(), "additive bias"
    else:
        q, k, _ = block.attn.queries_keys_values(h, backbone.pe, 0)
        logits = (q @ k.transpose(-1, -2)).float() / math.sqrt(q.shape[-1])
        if terms is None:
            maps, what = logits[0], "attention scores"
        elif terms.softmax:  # what CoPE or DAPEv2 adds to the logits (DAPEv2: the PE's bias plus its correction)
            maps, what = (terms.scores(logits, q, 0, t) - logits)[0], "additive bias (from the logits)"
        else:  # stick-breaking: its log attention weights themselves (a key that gets nothing is left blank)
            maps = terms.scores(logits, q, 0, t)[0]
            maps, what = maps.masked_fill(maps == float("-inf"), float("nan")), "log attention weights (no softmax)"
    maps = maps.expand(heads, t, t).clone()
    if backbone.causal:
        maps.masked_fill_(~torch.ones(t, t, dtype=torch.bool, device=maps.device).tril(), float("nan"))
    return maps.cpu(), what


def draw_grid(maps: torch.Tensor, title: str):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    heads = maps.shape[0]
    cols = min(4, heads)
    rows = math.ceil(heads / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(3 * cols, 3 * rows), squeeze=False)
    for i, ax in enumerate(axes.flat):
        ax.axis("off")
        if i < heads:
            image = ax.imshow(maps[i].numpy(), cmap="viridis")
            ax.set_title(f"head {i}", fontsize=9)
            fig.colorbar(image, ax=ax, fraction=0.046)
    fig.suptitle(title)
    fig.tight_layout()
    return fig


class BiasPictures(L.Callback):
    """At each evaluation, logs ``bias/last_layer``: a grid of per-head maps over the first
    ``tokens`` tokens of the first validation window."""

    def __init__(self, tokens: int = 64):
        self.tokens = tokens
        self.text: torch.Tensor | None = None

    def on_validation_batch_start(self, trainer, pl_module, batch, batch_idx, dataloader_idx=0):
        if self.text is None and batch_idx == 0 and dataloader_idx == 0:
            # Within the training length, so every PE (a learnable table too) can draw it.
            self.text = batch["tokens"][:1, : min(self.tokens, pl_module.config.block_size)].detach().clone()

    def on_validation_end(self, trainer, pl_module):
        experiment = getattr(trainer.logger, "experiment", None)
        # A sharded (FSDP2) model's weights are on no one rank, and rank 0 alone cannot gather them: no pictures
        # there (a checkpoint's can be drawn in one process).
        if (trainer.sanity_checking or self.text is None or not trainer.is_global_zero
                or not hasattr(experiment, "add_figure") or isinstance(pl_module.backbone, FSDPModule)):
            return
        with trainer.precision_plugin.forward_context():  # as validation_step runs: one FlexAttention kernel on CUDA
            maps, what = last_layer_maps(pl_module.backbone, self.text.to(pl_module.device))
        title = f"{pl_module.config.label()}: last layer {what}, step {trainer.global_step}"
        experiment.add_figure("bias/last_layer", draw_grid(maps, title), trainer.global_step)
