"""BERT-style masking for MLM, in plain torch so it runs inside a LightningModule step on any device."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from ..errors import ConfigError

IGNORE_INDEX = -100  # what F.cross_entropy skips by default


def mask_tokens(
    ids: torch.Tensor,
    mask_id: int,
    vocab_size: int,
    probability: float = 0.15,
    generator: torch.Generator | None = None,
    special_ids: Iterable[int] = (),
) -> tuple[torch.Tensor, torch.Tensor]:
    """Choose ``probability`` of the non-special tokens; of those 80% become ``mask_id``, 10% a random token,
    10% stay. Returns ``(input_ids, labels)`` with ``labels`` = the original id where chosen, else -100.

    Random replacements are drawn uniformly from ``[0, vocab_size)`` minus the special ids and ``mask_id``, so
    they never forge a document separator. ``ids`` is left untouched.
    """
    if not 0.0 <= probability <= 1.0:
        raise ConfigError(f"masking probability must be in [0, 1], got {probability}")
    device = ids.device
    specials = torch.tensor(sorted({int(i) for i in special_ids}), dtype=ids.dtype, device=device)
    candidates = ~torch.isin(ids, specials) if specials.numel() else torch.ones_like(ids, dtype=torch.bool)

    def uniform() -> torch.Tensor:
        return torch.rand(ids.shape, generator=generator, device=device)

    chosen = (uniform() < probability) & candidates
    labels = torch.where(chosen, ids, torch.full_like(ids, IGNORE_INDEX))
    action = uniform()
    to_mask = chosen & (action < 0.8)
    to_random = chosen & (action >= 0.8) & (action < 0.9)

    allowed = torch.ones(vocab_size, dtype=torch.bool, device=device)
    banned = torch.cat([specials.long(), torch.tensor([mask_id], device=device)])
    allowed[banned[(banned >= 0) & (banned < vocab_size)]] = False
    pool = allowed.nonzero().squeeze(1).to(ids.dtype)
    random_ids = pool[torch.randint(len(pool), ids.shape, generator=generator, device=device)]

    inputs = torch.where(to_mask, torch.full_like(ids, mask_id), ids)
    inputs = torch.where(to_random, random_ids, inputs)
    return inputs, labels
