"""KERPLE: learned conditionally-positive-definite distance kernels (Chi et al., 2022).

The kernels are the authors' released ones (chijames/KERPLE, ParallelKerpleLog and ParallelKerplePower). How r1 and r2
are kept positive differs: the released code clamps the raw parameters in place at every forward (at 0.01, the power's
exponent also at 2) and draws them uniformly at the start; here they are softplus (the exponent 2 sigmoid) of free
parameters, which need no clamp and whose gradient never stops at a bound, starting at r1 = r2 = 1."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .base import Encoding, PositionalBias, PositionalEncoding


class KerpleBias(PositionalBias):
    def __init__(self, r1, r2, form, q_offset, causal, layout=None):
        super().__init__(q_offset, causal, layout)
        self.r1, self.r2, self.form = r1, r2, form

    def at(self, h, i, j):
        d = (i - j).abs().to(self.r1.dtype)
        if self.form == "log":
            return -self.r1[h] * torch.log1p(self.r2[h] * d)
        # d^r2 for d >= 1; 0 at d = 0 (clamped so the gradient wrt r2 never sees log(0)).
        return -self.r1[h] * torch.where(d > 0, d.clamp(min=1.0) ** self.r2[h], torch.zeros_like(d))


class KerpleModule(PositionalEncoding):
    """r1, r2 > 0 learned per head and layer (softplus-parametrised; power: 0 < r2 <= 2)."""

    def __init__(self, settings, config):
        super().__init__(settings, config)
        self.form = settings.form
        # Raw parameters chosen so that r1 = 1 and r2 = 1 at initialisation.
        self.r1_raw = nn.Parameter(torch.full((config.n_layer, config.n_head), 0.5413))
        r2_init = 0.5413 if self.form == "log" else 0.0
        self.r2_raw = nn.Parameter(torch.full((config.n_layer, config.n_head), r2_init))

    per_layer = ("r1_raw", "r2_raw")

    def coefficients(self, layer):
        r1 = F.softplus(self.r1_raw[layer])
        r2 = F.softplus(self.r2_raw[layer]) if self.form == "log" else 2.0 * torch.sigmoid(self.r2_raw[layer])
        return r1, r2

    def score_bias(self, h, layer, offset, state, layout=None):
        r1, r2 = self.coefficients(layer)
        return KerpleBias(r1, r2, self.form, offset, self.causal, layout)


@dataclass
class KerpleLog(Encoding):
    """KERPLE log: -r1 log(1 + r2 |i - j|)."""

    name = "kerple_log"
    module = KerpleModule
    scores = "bias"
    form = "log"


@dataclass
class KerplePower(Encoding):
    """KERPLE power: -r1 |i - j|^r2 with 0 < r2 <= 2."""

    name = "kerple_power"
    module = KerpleModule
    scores = "bias"
    form = "power"
