"""Stick-breaking attention (Tan et al., 2024, "Scaling stick-breaking attention"): no softmax and no positional
encoding. Query i breaks a stick of length 1 at its keys from the nearest back: key j takes the share
beta_ij = sigmoid(z_ij) of what the nearer keys left,
    A_ij = beta_ij * prod_{j < k < i} (1 - beta_ik),        z_ij = q_i . k_j / sqrt(d),  keys j < i,
and the output is sum_j A_ij v_j (the weights sum to at most 1; what is left of the stick is attended to nowhere).
The order of the keys is the position information: a recency bias built from the logits themselves.

In log space, log A_ij = logsigmoid(z_ij) + sum_{j < k < i} logsigmoid(-z_ik): the sum is a cumulative sum over
keys taken from the query backwards (reverse order), so the weights that matter, near the query, are sums of few
terms and exact; far keys reach large negative logs, whose exp is 0 rather than a NaN or an underflowing product.
Bidirectional encoders break one stick on each side of the query, outwards (the query's own key excluded).
Needs the logits of every key in a row, so it runs on blocks of query rows (the chunked path); fused kernels cannot.

The weights are those of the authors' reference (shawntan/stickbreaking-attention, sb_ref.py). Their released models
and kernel tests then add the remainder, (1 - sum_j A_ij) times the query's own value v_i; here the remainder goes to
no value, so a query whose keys take little of the stick has a small output (and the first token's output is zero).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .base import Encoding, LogitScores, PositionalEncoding


class StickBreakingScores(LogitScores):
    """log A for rows [start, stop); -inf wherever a key gets no share (the query itself, and the future)."""

    maps_per_head = 6  # logits, the two log-sigmoids, the reversed cumulative sum and its shift, the result
    softmax = False

    def scores(self, logits, q, start, stop, key_padding=None):
        n_keys = logits.shape[-1]
        own = torch.arange(start, stop, device=logits.device).view(-1, 1) + self.q_offset
        keys = torch.arange(n_keys, device=logits.device).view(1, -1)
        before, after = keys < own, keys > own
        log_left = F.logsigmoid(-logits)  # log(1 - beta): what a key leaves to the keys beyond it
        # sum over keys strictly between j and i: the inclusive running sum from the query outwards, shifted by one
        # key (no subtraction, so near keys keep full precision)
        behind = log_left.masked_fill(~before, 0.0).flip(-1).cumsum(-1).flip(-1)
        log_stick = F.pad(behind[..., 1:], (0, 1))
        if not self.causal:
            ahead = log_left.masked_fill(~after, 0.0).cumsum(-1)
            log_stick = torch.where(before, log_stick, F.pad(ahead[..., :-1], (1, 0)))
        scores = F.logsigmoid(logits) + log_stick
        seen = before if self.causal else before | after
        return scores.masked_fill(~seen, float("-inf"))


class StickBreakingModule(PositionalEncoding):
    reads_positions = False  # the order of the keys; a stick spans only keys of the query's document

    def score_bias(self, h, layer, offset, state, layout=None):
        return StickBreakingScores(offset, self.causal, layout)


@dataclass
class StickBreaking(Encoding):
    """Stick-breaking attention: each key takes sigmoid(q.k / sqrt(d)) of the stick the nearer keys left; no softmax,
    no position encoding, no parameters."""

    name = "stick_breaking"
    module = StickBreakingModule
    scores = "logits"
    softmax = False
