"""The scorer registry: every scorer by name, and how to build a chosen set from config.

Building is where resources are made: the throughput window that throughput and GPU-hour
cost share, and the semantic similarity's encoder when that scorer is asked for and no
encoder is handed in: by default the static table distilled from all-MiniLM-L6-v2
(``semantic_model = "static"``), or the six-layer encoder itself (``"minilm"``, about
90 MB, ~100x the CPU per exchange). The config itself is plain data.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from types import MappingProxyType
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from evaluators._embedding import SentenceEncoder
from evaluators._price import CostModel, CostScorer, PriceModel
from evaluators._score import Scorer
from evaluators._scorers_quality import (
    CaptureScorer,
    ChoiceCountScorer,
    EditSimilarityScorer,
    EmbeddingDistanceScorer,
    ExactMatchScorer,
    FinishReasonScorer,
    JsonValidityScorer,
    SemanticSimilarityScorer,
    TextSimilarity,
    TokenF1Scorer,
    ToolCallScorer,
)
from evaluators._scorers_timing import (
    CacheScorer,
    LatencyScorer,
    ReliabilityScorer,
    ThroughputScorer,
)
from evaluators._static_embedding import StaticSentenceEncoder
from evaluators._throughput import (
    DEFAULT_WINDOW_MAX_REQUESTS,
    DEFAULT_WINDOW_S,
    ThroughputWindow,
)

__all__ = ["DEFAULT_SCORERS", "SCORERS", "ScorerConfig", "ScorerResources", "build_scorers"]

SEMANTIC = "semantic_similarity"
SemanticModel = Literal["static", "minilm"]


class ScorerConfig(BaseModel):
    """Settings of the scorers; ``prices`` is keyed by backend name (primary or candidate)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    prices: dict[str, PriceModel] = Field(default_factory=dict)
    throughput_window_s: float = Field(DEFAULT_WINDOW_S, gt=0)
    throughput_window_max_requests: int = Field(DEFAULT_WINDOW_MAX_REQUESTS, ge=1)
    semantic_model: SemanticModel = "static"
    """The semantic similarity's encoder: the static table distilled from MiniLM, or
    MiniLM itself (bench/score.py measures both and their agreement)."""


@dataclass(frozen=True, slots=True)
class ScorerResources:
    config: ScorerConfig
    window: ThroughputWindow
    encoder: TextSimilarity | None


def _semantic(resources: ScorerResources) -> Scorer:
    if resources.encoder is None:  # build_scorers makes one; this guards direct use
        raise ValueError(f"{SEMANTIC} needs an encoder")
    return SemanticSimilarityScorer(resources.encoder)


SCORERS: MappingProxyType[str, Callable[[ScorerResources], Scorer]] = MappingProxyType({
    "exact_match": lambda r: ExactMatchScorer(),
    "edit_similarity": lambda r: EditSimilarityScorer(),
    "token_f1": lambda r: TokenF1Scorer(),
    SEMANTIC: _semantic,
    "tool_calls": lambda r: ToolCallScorer(),
    "json_validity": lambda r: JsonValidityScorer(),
    "finish_reason": lambda r: FinishReasonScorer(),
    "choices": lambda r: ChoiceCountScorer(),
    "embedding_distance": lambda r: EmbeddingDistanceScorer(),
    "reliability": lambda r: ReliabilityScorer(),
    "latency": lambda r: LatencyScorer(),
    "throughput": lambda r: ThroughputScorer(r.window),
    "cost": lambda r: CostScorer(CostModel(r.config.prices, r.window)),
    "cache": lambda r: CacheScorer(),
    "capture": lambda r: CaptureScorer(),
})

DEFAULT_SCORERS: tuple[str, ...] = tuple(SCORERS)


def build_scorers(names: Iterable[str] = DEFAULT_SCORERS, config: ScorerConfig | None = None,
                  *, encoder: TextSimilarity | None = None,
                  window: ThroughputWindow | None = None) -> list[Scorer]:
    """The named scorers, in order, sharing one throughput window and one encoder."""
    names = list(names)
    unknown = [n for n in names if n not in SCORERS]
    if unknown:
        raise ValueError(f"unknown scorers {unknown}; known: {sorted(SCORERS)}")
    if len(set(names)) != len(names):
        raise ValueError(f"scorers named twice: {names}")
    config = config if config is not None else ScorerConfig()
    if window is None:
        window = ThroughputWindow(config.throughput_window_s,
                                  config.throughput_window_max_requests)
    if encoder is None and SEMANTIC in names:
        encoder = (StaticSentenceEncoder() if config.semantic_model == "static"
                   else SentenceEncoder())
    resources = ScorerResources(config, window, encoder)
    return [SCORERS[name](resources) for name in names]
