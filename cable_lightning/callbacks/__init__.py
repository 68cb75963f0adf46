"""Callbacks: perplexity-vs-length records, passkey retrieval, task accuracy, bias pictures, throughput."""

from .bias_pictures import BiasPictures
from .length_eval import LengthEvalRecorder
from .passkey import PasskeyRetrieval
from .task_eval import TaskAccuracy
from .throughput import TokenThroughput

__all__ = ["BiasPictures", "LengthEvalRecorder", "PasskeyRetrieval", "TaskAccuracy", "TokenThroughput"]
