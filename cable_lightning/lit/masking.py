"""BERT-style masking for MLM, in plain torch so it runs inside a LightningModule step on any device."""

from __future__ import annotations

import functools
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
    draws: torch.Tensor | None = None,
    maskable: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Choose ``probability`` of the non-special tokens; of those 80% become ``mask_id``, 10% a random token,
    10% stay. Returns ``(input_ids, labels)`` with ``labels`` = the original id where chosen, else -100.

    Every decision comes from three uniform draws per token, ``draws`` of shape ``(3, *ids.shape)`` (chosen, what
    to do, which random token): drawn from ``generator`` when not given, or given by :func:`position_draws` so
    that a token's masking depends on its place in a stream, not on the window that holds it.
    Random replacements are drawn uniformly from ``[0, vocab_size)`` minus the special ids and ``mask_id``, so
    they never forge a document separator. ``maskable`` (bool, like ``ids``): where False, a token is never
    chosen (a task's answer, which the caller hides itself). ``ids`` is left untouched.
    """
    if not 0.0 <= probability <= 1.0:
        raise ConfigError(f"masking probability must be in [0, 1], got {probability}")
    device = ids.device
    if draws is None:
        draws = torch.rand((3, *ids.shape), generator=generator, device=device)
    specials, pool = vocabulary(vocab_size, tuple(sorted({int(i) for i in special_ids})), mask_id, ids.dtype, device)
    candidates = ~torch.isin(ids, specials) if specials.numel() else torch.ones_like(ids, dtype=torch.bool)
    if maskable is not None:
        candidates = candidates & maskable

    chosen = (draws[0] < probability) & candidates
    labels = torch.where(chosen, ids, torch.full_like(ids, IGNORE_INDEX))
    to_mask = chosen & (draws[1] < 0.8)
    to_random = chosen & (draws[1] >= 0.8) & (draws[1] < 0.9)

    random_ids = pool[(draws[2] * len(pool)).long().clamp(max=len(pool) - 1)]

    inputs = torch.where(to_mask, torch.full_like(ids, mask_id), ids)
    inputs = torch.where(to_random, random_ids, inputs)
    return inputs, labels


@functools.lru_cache(maxsize=16)
def vocabulary(vocab_size: int, special_ids: tuple[int, ...], mask_id: int, dtype: torch.dtype,
               device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(the special ids, the ids a random replacement is drawn from) on ``device``: made on the host and copied once.
    Made on the device at every step they were three host syncs a step on a GPU (two copies of Python lists and the
    ``nonzero`` that sizes the pool)."""
    allowed = torch.ones(vocab_size, dtype=torch.bool)
    banned = torch.tensor([*special_ids, mask_id])
    allowed[banned[(banned >= 0) & (banned < vocab_size)]] = False
    return torch.tensor(special_ids, dtype=dtype).to(device), allowed.nonzero().squeeze(1).to(dtype).to(device)


DRAW_BLOCK = 4096  # stream positions per seeded block of position_draws


def position_draws(positions: torch.Tensor, seed: int) -> torch.Tensor:
    """The ``(3, *positions.shape)`` uniform draws of :func:`mask_tokens` as a function of each token's position in
    a stream (and ``seed``) alone. Evaluation masks this way, so every evaluation length and window mode masks the
    same tokens of the validation stream and MLM perplexities compare across lengths on the same targets. Draws are
    made on the CPU in blocks of :data:`DRAW_BLOCK` positions, each from a generator seeded by (seed, block)."""
    flat = positions.reshape(-1).cpu()
    blocks = flat.div(DRAW_BLOCK, rounding_mode="floor")
    out = torch.empty(3, flat.numel())
    for block in blocks.unique().tolist():
        table = torch.rand(3, DRAW_BLOCK, generator=torch.Generator().manual_seed(seed * 1_000_003 + block))
        where = blocks == block
        out[:, where] = table[:, flat[where] - block * DRAW_BLOCK]
    return out.reshape(3, *positions.shape).to(positions.device)
