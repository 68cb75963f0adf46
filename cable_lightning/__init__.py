"""cable_lightning: train short, test long. Positional-encoding research on Lightning."""

__version__ = "0.1.0"
