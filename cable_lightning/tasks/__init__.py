"""Synthetic long-context tasks: their generation (:mod:`.generation`, what the data module trains and evaluates on)
and their scoring (:mod:`.scoring`, exact match and the effective length), kept together and below both the data
and the LightningModules, which use them."""
