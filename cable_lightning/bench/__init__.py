"""``python -m cable_lightning bench``: speed and memory of every positional encoding on one backbone shape
(``command``: the verb, its flags and its output). One module per measurement: ``training`` (the main table:
training tokens/s and MFU, evaluation seconds and peak memory, each against ``nope``), ``memory`` (an evaluation's
peak memory), ``padded`` (a padded fine-tuning step), ``peers`` (transformers' models and the CABLE paper's code,
built in ``peer_models``), ``bf16`` (bf16 autocast against fp32), ``compiled`` (compiled blocks against eager),
``in_turns`` (each encoding timed in turns with NoPE) and ``loop_overhead`` (a fit's step over its bare step); each
holds the table it prints. ``variants`` and ``steps`` are
the models and the work they time; the clocks are :mod:`cable_lightning.timing`'s."""

from .command import main

__all__ = ["main"]
