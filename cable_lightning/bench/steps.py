"""The work the bench times, each a callable: a training step (forward, loss, backward) and an evaluation forward, of
the backbone and of a transformers peer, so both sides of a comparison do the same work."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..timing import timed


def training_batch(vocab_size, t, tokens_per_step, device):
    """(batch, t + 1) token ids: ``tokens_per_step // t`` rows (at least one)."""
    return torch.randint(0, vocab_size, (max(1, tokens_per_step // t), t + 1), device=device)


def train_step(model, x, device, dtype):
    """One training step of the backbone on ``x`` (forward and loss under autocast in ``dtype``, backward): a
    callable."""
    def step():
        with torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32):
            loss = model.loss(x[:, :-1], x[:, 1:])
        loss.backward()
        model.zero_grad(set_to_none=True)

    return step


def peer_train_step(peer, x, device, dtype):
    """:func:`train_step` of a transformers causal LM: its logits, and the backbone's loss on them (fp32 cross
    entropy of the next tokens), so both sides do the same work."""
    def step():
        with torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32):
            logits = peer(input_ids=x[:, :-1]).logits
            loss = F.cross_entropy(logits.float().flatten(0, 1), x[:, 1:].flatten())
        loss.backward()
        peer.zero_grad(set_to_none=True)

    return step


def eval_forward(model, t, device, dtype):
    """One evaluation forward (the memory-safe path: chunked attention, chunked LM head) at length t."""
    x = torch.randint(0, model.config.vocab_size, (1, t + 1), device=device)

    def forward():
        with torch.no_grad(), torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32):
            model.token_nll(x[:, :-1], x[:, 1:])

    return forward


def peer_eval_forward(peer, vocab_size, t, device, dtype):
    """:func:`eval_forward` of a peer: its logits at length t and their cross entropy, without gradients."""
    x = torch.randint(0, vocab_size, (1, t + 1), device=device)

    def forward():
        with torch.no_grad(), torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32):
            F.cross_entropy(peer(input_ids=x[:, :-1]).logits.float().flatten(0, 1), x[:, 1:].flatten())

    return forward


def eval_seconds(model, t, device, dtype, repeats):
    return timed(eval_forward(model, t, device, dtype), device, repeats)
