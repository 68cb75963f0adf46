"""Callbacks: perplexity-vs-length records, passkey retrieval, bias pictures, throughput."""

from .bias_pictures import BiasPictures
from .length_eval import LengthEvalRecorder
from .passkey import PasskeyRetrieval
from .throughput import TokenThroughput

__all__ = ["BiasPictures", "LengthEvalRecorder", "PasskeyRetrieval", "TokenThroughput"]
