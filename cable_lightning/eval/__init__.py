"""Length-extrapolation evaluation: windows over a fixed token stream, and reports."""

from .windows import EvalWindows, scored_targets, window_plan

__all__ = ["EvalWindows", "scored_targets", "window_plan"]
