"""Observations of backend answers and, built on them, the scores and the judge."""

from evaluators._exchange import EvaluationSink, Exchange, MemorySink
from evaluators._observation import Capture, Observation, Usage, observe

__all__ = [
    "Capture",
    "EvaluationSink",
    "Exchange",
    "MemorySink",
    "Observation",
    "Usage",
    "observe",
]
