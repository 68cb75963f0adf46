"""Callbacks: perplexity-vs-length records, task accuracy (the passkey is a task), bias pictures, throughput."""

from .bias_pictures import BiasPictures
from .length_eval import LengthEvalRecorder
from .task_eval import TaskAccuracy
from .throughput import TokenThroughput

__all__ = ["BiasPictures", "LengthEvalRecorder", "TaskAccuracy", "TokenThroughput"]
