"""A verb's module run as a program: say which verb runs it, never exit 0 having done nothing."""

from cable_lightning.verbs import replaced_entry_point

replaced_entry_point("cable_lightning.bench")
