"""Observations of backend answers and, built on them, the scores, the judge and its report.

The store (schema, batched writer, queries, shared routing state) is the public
subpackage :mod:`evaluators.store`.
"""

from evaluators._checks import Outcome
from evaluators._exchange import (
    EvaluationSink,
    Exchange,
    MemorySink,
    json_requested,
    requested_choices,
)
from evaluators._gates import Gates, MetricGate
from evaluators._judge import judge
from evaluators._observation import Capture, Observation, Usage, observe
from evaluators._pipeline import EvaluationPipeline, EvaluationProcessError, PipelineState
from evaluators._pipeline_stats import PipelineStats
from evaluators._report import (
    Report,
    ReportInputs,
    build_report,
    judge_inputs,
    load_report_inputs,
    record_report,
)
from evaluators._sample_bias import turn_depth_bucket
from evaluators._score import METRICS, Score, Scorer
from evaluators._scorers import DEFAULT_SCORERS, SCORERS, ScorerConfig
from evaluators._verdicts import MetricSamples, MetricVerdict, Verdict

__all__ = [
    "DEFAULT_SCORERS",
    "METRICS",
    "SCORERS",
    "Capture",
    "EvaluationPipeline",
    "EvaluationProcessError",
    "EvaluationSink",
    "Exchange",
    "Gates",
    "MemorySink",
    "MetricGate",
    "MetricSamples",
    "MetricVerdict",
    "Observation",
    "Outcome",
    "PipelineState",
    "PipelineStats",
    "Report",
    "ReportInputs",
    "Score",
    "Scorer",
    "ScorerConfig",
    "Usage",
    "Verdict",
    "build_report",
    "json_requested",
    "judge",
    "judge_inputs",
    "load_report_inputs",
    "observe",
    "record_report",
    "requested_choices",
    "turn_depth_bucket",
]
