"""DAPEv2 (Zheng et al., 2024, "DAPE V2: process attention score as feature map"): an encoding that wraps any
score-bias encoding (its ``base``) and reads the attention logits and the base's bias as a (B, 2H, Tq, Tk) feature
map. Runs, records and reports name it ``dape_v2+<base>``.

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
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import ConfigError
from .base import Encoding, LogitScores, OverBase, ScoreBias
from .cable import Cable
from .layout import with_layout
from .registry import encoding_from, score_bias_encodings


class DapeScores(LogitScores):
    """One layer's DAPEv2 scores over a PE's bias (a :class:`ScoreBias`)."""

    def __init__(self, bias: ScoreBias, convolutions: "DapeConvolutions"):
        # its documents are zeroed before each convolution
        super().__init__(bias.q_offset, bias.causal, getattr(bias, "layout", None))
        self.bias, self.convolutions = bias, convolutions
        heads = convolutions.reduce.out_channels
        # features (2H), hidden (width), logits, bias, correction and scores at once
        self.maps_per_head = 4 + math.ceil((2 * heads + convolutions.reduce.in_channels) / heads)

    def scores(self, logits, q, start, stop, key_padding=None):
        batch, heads, rows, n_keys = logits.shape
        bias = self.bias.rows(start, stop, n_keys, batch, heads, logits.device).to(logits.dtype).expand_as(logits)
        if torch.is_grad_enabled() or logits.device.type != "cpu":
            features = torch.cat([logits, bias], dim=1)
        else:  # CPU evaluation: channels-last maps, whose convolutions ran 2x faster (training's backward: slower)
            features = torch.empty(batch, 2 * heads, rows, n_keys, dtype=logits.dtype,
                                   memory_format=torch.channels_last)
            features[:, :heads], features[:, heads:] = logits, bias
        # Zero the future (and padding in a padded batch) before each convolution. In place, on new tensors that
        # autograd does not keep: a convolution keeps its input, not its output (LeakyReLU(0) = 0, so zeroing before
        # it is zeroing after).
        features = self.hide_(features, start, stop, 0.0, key_padding)
        hidden = F.leaky_relu_(self.hide_(self.convolutions.expand(features), start, stop, 0.0, key_padding))
        return self.convolutions.reduce(hidden).contiguous().add_(logits).add_(bias)


class DapeConvolutions(nn.Module):
    """One layer's two convolutions along the key axis; PyTorch's default initialisation (as DAPE's)."""

    def __init__(self, n_head: int, width: int, kernel: int):
        super().__init__()
        padding = (0, kernel // 2)  # centred on each key: the odd kernel keeps the key axis's length
        self.expand = nn.Conv2d(2 * n_head, width, (1, kernel), padding=padding)
        self.reduce = nn.Conv2d(width, n_head, (1, kernel), padding=padding)

    def augment(self, bias: ScoreBias) -> DapeScores:
        return DapeScores(bias, self)


class DapeV2Module(OverBase):
    """The base encoding's module and one pair of convolutions per layer over its scores."""

    def __init__(self, settings: "DapeV2", config):
        super().__init__(settings, config)
        self.layers = nn.ModuleList(DapeConvolutions(config.n_head, settings.width, settings.kernel)
                                    for _ in range(config.n_layer))

    per_layer = ("layers",)

    def score_bias(self, h, layer, offset, state, layout=None):
        return self.layers[layer].augment(self.base.score_bias(h, layer, offset, state, **with_layout(layout)))


@dataclass
class DapeV2(Encoding):
    """DAPEv2 over ``base`` (any encoding with a pointwise score bias): two (1 x ``kernel``) convolutions through
    ``width`` hidden channels correct the scores."""

    base: Encoding = field(default_factory=Cable)
    width: int = 32
    kernel: int = 3

    name = "dape_v2"
    module = DapeV2Module
    scores = "logits"

    def __post_init__(self):
        super().__post_init__()
        self.base = encoding_from(self.base)
        if self.base.scores not in ("bias", "foldable_bias"):
            raise ConfigError(f"dape_v2 augments a score bias and {self.base.name!r} has none; give it a base from: "
                              f"{', '.join(score_bias_encodings())}")
        if self.width < 1 or self.kernel < 1 or self.kernel % 2 == 0:
            raise ConfigError(f"dape_v2.width must be >= 1 and dape_v2.kernel odd and >= 1 (it is centred on each "
                              f"key), got width={self.width}, kernel={self.kernel}")

    def label(self, runtime: bool = True) -> str:
        return f"dape_v2+{self.base.label(runtime)}"

    def longest_length(self, block_size):
        return self.base.longest_length(block_size)

    def check(self, config):
        self.base.check(config)
