"""DAPEv2 (Zheng et al., 2024, "DAPE V2: process attention score as feature map"): an augmentation of any
score-bias PE that reads the attention logits and the PE's bias as a (B, 2H, Tq, Tk) feature map.

Per layer, for query row i and key j:
    features = [q.k / sqrt(d), bias]                    2H channels, zeroed where j > i (causal)
    hidden   = LeakyReLU(conv_(1 x k)(features))        2H -> width channels, zeroed where j > i (causal)
    scores   = q.k / sqrt(d) + bias + conv_(1 x k)(hidden)   width -> H channels
then the causal mask and softmax. The kernels span keys only, so rows are independent; zeroing the
future before each convolution keeps a later key out of the diagonal's window and makes a row's scores
depend on its own keys alone, the same in blocks of rows, in cached decoding and at any total length.
Bidirectional encoders zero nothing.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from .base import LogitScores, ScoreBias


class DapeScores(LogitScores):
    """One layer's DAPEv2 scores over a PE's bias (a :class:`ScoreBias`)."""

    def __init__(self, bias: ScoreBias, convolutions: "DapeV2"):
        super().__init__(bias.q_offset, bias.causal)
        self.bias, self.convolutions = bias, convolutions
        heads = convolutions.reduce.out_channels
        # features (2H), hidden (width), logits, bias, correction and scores at once
        self.maps_per_head = 4 + math.ceil((2 * heads + convolutions.reduce.in_channels) / heads)

    def scores(self, logits, q, start, stop):
        batch, heads, _, n_keys = logits.shape
        bias = self.bias.rows(start, stop, n_keys, batch, heads, logits.device).to(logits.dtype).expand_as(logits)
        features = torch.cat([logits, bias], dim=1)
        future = self.future(start, stop, n_keys, logits.device) if self.causal else None
        if future is not None:
            features = features.masked_fill(future, 0.0)
        hidden = F.leaky_relu(self.convolutions.expand(features))
        if future is not None:
            hidden = hidden.masked_fill(future, 0.0)
        return logits + bias + self.convolutions.reduce(hidden)


class DapeV2(nn.Module):
    """One layer's two convolutions along the key axis; PyTorch's default initialisation (as DAPE's)."""

    def __init__(self, n_head: int, width: int, kernel: int):
        super().__init__()
        padding = (0, kernel // 2)  # centred on each key: the odd kernel keeps the key axis's length
        self.expand = nn.Conv2d(2 * n_head, width, (1, kernel), padding=padding)
        self.reduce = nn.Conv2d(width, n_head, (1, kernel), padding=padding)

    def augment(self, bias: ScoreBias) -> DapeScores:
        return DapeScores(bias, self)
