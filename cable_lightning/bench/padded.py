"""A fine-tuning step of a padded batch of a bidirectional encoder, as sentence-transformers runs one, in each way
the backbone can take it (``--padded_batch``)."""

from __future__ import annotations

import torch

from ..timing import timed

PADDED_MODES = ("per_span", "one_group", "grouped")


def padded_step_seconds(model, rows, longest, device, repeats, mode):
    """One fine-tuning step of a padded batch as sentence-transformers runs it (mean pooling of the real tokens, a
    loss on the pooled vectors, backward): ``rows`` rows of lengths drawn from 1..``longest``, right-padded. ``mode``
    (:data:`PADDED_MODES`): ``per_span``, each distinct span as its own sub-batch (how the transformers wrapper ran a
    padded batch before the backbone took a padding mask); ``one_group``, one call with the padding mask and every
    row padded to the longest (``padding_waste`` 1.0, the first padding mask); ``grouped``, one call with the padding
    mask as the backbone runs it (groups of similar length)."""
    generator = torch.Generator().manual_seed(0)
    lengths = torch.randint(1, longest + 1, (rows,), generator=generator).to(device)
    x = torch.randint(0, model.config.vocab_size, (rows, longest), generator=generator).to(device)
    mask = torch.arange(longest, device=device) < lengths[:, None]
    default_waste = model.padding_waste

    def step():
        if mode == "per_span":
            hidden = torch.zeros(rows, longest, model.config.n_embd, device=device)
            for n in lengths.unique().tolist():
                same = (lengths == n).nonzero().flatten()
                hidden[same, :n] = model.hidden_states(x[same, :n])
        else:
            model.padding_waste = 1.0 if mode == "one_group" else default_waste
            hidden = model.hidden_states(x, padding_mask=mask)
            model.padding_waste = default_waste
        pooled = (hidden * mask[..., None]).sum(1) / lengths[:, None]
        pooled.square().mean().backward()
        model.zero_grad(set_to_none=True)

    return timed(step, device, repeats)
