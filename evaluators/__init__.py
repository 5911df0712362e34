"""Observations of backend answers and, built on them, the scores and the judge."""

from evaluators._observation import Capture, Observation, Usage, observe

__all__ = ["Capture", "Observation", "Usage", "observe"]
