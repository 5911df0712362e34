"""Observations of backend answers and, built on them, the scores, the judge and the store."""

from evaluators._embedding import SentenceEncoder
from evaluators._exchange import EvaluationSink, Exchange, MemorySink
from evaluators._gates import Gates, MetricGate, Outcome
from evaluators._judge import MetricSamples, MetricVerdict, Verdict, judge
from evaluators._observation import Capture, Observation, Usage, observe
from evaluators._pipeline import (
    EvaluationPipeline,
    EvaluationProcessError,
    PipelineState,
    PipelineStats,
)
from evaluators._price import CostModel, GpuHourPrice, PriceModel, TokenPrice, session_costs
from evaluators._report import Report, build_report
from evaluators._score import METRICS, MetricSpec, Score, Scorer, score_exchange
from evaluators._scorers import DEFAULT_SCORERS, SCORERS, ScorerConfig, build_scorers
from evaluators._statistics import Comparison, compare_samples, summarize_pairwise
from evaluators._store import (
    ScoreWriter,
    StoreConfig,
    StoreError,
    create_engine,
    downgrade,
    session_factory,
    upgrade,
)

__all__ = [
    "DEFAULT_SCORERS",
    "METRICS",
    "SCORERS",
    "Capture",
    "Comparison",
    "CostModel",
    "EvaluationPipeline",
    "EvaluationProcessError",
    "EvaluationSink",
    "Exchange",
    "Gates",
    "GpuHourPrice",
    "MemorySink",
    "MetricGate",
    "MetricSamples",
    "MetricSpec",
    "MetricVerdict",
    "Observation",
    "Outcome",
    "PipelineState",
    "PipelineStats",
    "PriceModel",
    "Report",
    "Score",
    "ScoreWriter",
    "Scorer",
    "ScorerConfig",
    "SentenceEncoder",
    "StoreConfig",
    "StoreError",
    "TokenPrice",
    "Usage",
    "Verdict",
    "build_report",
    "build_scorers",
    "compare_samples",
    "create_engine",
    "downgrade",
    "judge",
    "observe",
    "score_exchange",
    "session_costs",
    "session_factory",
    "summarize_pairwise",
    "upgrade",
]
