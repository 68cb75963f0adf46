"""Callbacks: perplexity-vs-length records (and bias pictures)."""

from .length_eval import LengthEvalRecorder

__all__ = ["LengthEvalRecorder"]
