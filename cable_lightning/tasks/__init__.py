"""Synthetic tasks: their generation (:mod:`.generation`, what the data module trains and evaluates on; the
algorithmic tasks of the Chomsky-hierarchy benchmark in :mod:`.chomsky`) and their scoring (:mod:`.scoring`, exact
match, per-token accuracy and the effective length), kept together and below both the data and the LightningModules,
which use them."""

from . import chomsky  # noqa: F401  (registers the algorithmic tasks beside the long-context ones)
