"""The two files every export carries (copied verbatim; they must not import cable_lightning)."""
