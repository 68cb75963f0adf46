"""Callbacks: perplexity-vs-length records, attention diagnostics, task accuracy (the passkey is a task), bias pictures,
throughput."""

from .bias_pictures import BiasPictures
from .diagnostics import AttentionDiagnostics
from .length_eval import LengthEvalRecorder
from .task_eval import TaskAccuracy
from .throughput import TokenThroughput

__all__ = ["AttentionDiagnostics", "BiasPictures", "LengthEvalRecorder", "TaskAccuracy", "TokenThroughput"]
