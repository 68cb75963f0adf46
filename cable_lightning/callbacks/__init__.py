"""Callbacks: perplexity-vs-length records, bias pictures, throughput."""

from .bias_pictures import BiasPictures
from .length_eval import LengthEvalRecorder
from .throughput import TokenThroughput

__all__ = ["BiasPictures", "LengthEvalRecorder", "TokenThroughput"]
