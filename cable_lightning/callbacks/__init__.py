"""Callbacks: perplexity-vs-length records (and bias pictures)."""

from .bias_pictures import BiasPictures
from .length_eval import LengthEvalRecorder

__all__ = ["BiasPictures", "LengthEvalRecorder"]
