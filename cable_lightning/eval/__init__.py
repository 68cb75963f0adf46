"""Length-extrapolation measurement: loss by position, intervals and paired tests over seeds, and the report."""

from .positions import PositionNLL, position_buckets

__all__ = ["PositionNLL", "position_buckets"]
