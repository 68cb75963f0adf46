"""FoX, the Forgetting Transformer (Lin et al., 2025): a forget gate per head and token, f_t = sigmoid(w . x_t + c),
and bias[i, j] = sum_{j < u <= i} log f_u. With S_t = sum_{u <= t} -log f_u this is -(S_i - S_j): CABLE_NW with
b_t = -log f_t, so it runs on CABLE's module (cumulative sums, cache and fold path) with its own token bias.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.nn.functional as F
from torch import Tensor

from .base import Encoding
from .cable import CumulativeBias


def negative_log_sigmoid(logit: Tensor) -> Tensor:
    """-log sigmoid(z) = softplus(-z) >= 0: the penalty a forget gate sigmoid(z) adds per token. Written with
    logsigmoid: softplus's backward, compiled with Dynamo's aot_eager backend, returned other strides than the traced
    graph assumed (a view in the graph then failed: tests/test_compiled_blocks.py)."""
    return -F.logsigmoid(logit)


@dataclass
class Fox(Encoding):
    """FoX's data-dependent forget gate. Initialised as the authors' default for it: weights N(0, 0.02), offset c = 0
    (f = 1/2 at the start, a strong recency bias the model learns away from where it needs distant tokens)."""

    name = "fox"
    module = CumulativeBias
    scores = "foldable_bias"
    weighted = False
    kernel = "linear"
    gate_offset = True

    def token_bias(self):
        return negative_log_sigmoid
