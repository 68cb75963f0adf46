"""Length-extrapolation evaluation: windows over a fixed token stream, loss by position, synthetic tasks."""

from .positions import PositionNLL, position_buckets
from .windows import EvalWindows, scored_targets, window_plan

__all__ = ["EvalWindows", "PositionNLL", "position_buckets", "scored_targets", "window_plan"]
