"""The judge's configuration: thresholds per metric, with named defaults.

:class:`Gates` holds the operator's thresholds as they are written in the config
(``max_ttft_p99_ratio: 1.2``). :meth:`Gates.gate_for` turns them into the checks of one
metric, a :class:`MetricGate`, by the metric's name:

1. A metric named in ``Gates.metrics`` gets exactly that gate (a ``None`` threshold
   switches its check off; ``min_samples=None`` falls back to ``Gates.min_samples``).
2. Pairwise metrics (one value per exchange, candidate against primary): the semantic
   similarity metric must keep its mean above ``min_semantic_similarity``, the
   embeddings' cosine distance (``quality.embedding_distance``) below
   ``max_embedding_distance`` (a distance, not a minimum cosine: the band of a limit is a
   share of it, and a share of a cosine near 1 spans all the room up to 1). Every
   pairwise metric but that distance is compared with the noise floor when a secondary's
   sample exists, within ``max_noise_floor_shift_ratio``, on the mean (relative to a
   floor near 0, a distance 0.0002 larger is 20 % worse; the floor still counts for it
   through the judge's rule 3, which relaxes a limit the replica itself does not keep,
   by at most ``max_noise_floor_miss`` of the limit, the same for a minimum and a
   maximum; a replica beyond that on one metric is no floor for any, the judge's rule
   11).
   The per-exchange latency ratios (``latency.*_ratio``) are latency: their median (a
   ratio's mean is pulled by its few slowest requests) within the latency tolerance
   ``max_median_shift_ratio``, so a candidate 4 % slower, inside the 10 % latency gate,
   does not fail its ratios'.
   Pairwise checks use the mean: many pairwise metrics are 0/1 agreements, whose
   Hodges-Lehmann shift is 0 whatever the two rates are.
3. Rate metrics (``rate_metrics``: 0/1 per exchange, such as ``reliability.success``):
   the rate may move toward worse by at most ``max_error_rate_increase`` (absolute). The
   check reads counts, not a bootstrap (``_checks`` rule 2), and passes only where their
   interval rules out a worsening beyond the limit (the judge's rule 1). A gate with
   ``max_mean_worsening`` holds no other check: a 0/1 metric's median, tail and spread
   say nothing its rate does not, and its counts are all the judge reads of it (so they
   may cover more than the capped values, the report's rule 6).
4. ``cost.*``: the mean (the spend per request) may grow by at most ``max_cost_ratio``.
5. ``cache.*`` is not gated: a mirrored candidate sees only a sample of the traffic, so
   its cache is colder than the primary's by construction. Nor is ``capture.*``: how often
   an answer outgrew the gateway's capture depends on that bound, not on the candidate
   alone; it says why quality samples are missing.
6. Any other per-backend metric (``latency.*``, ``throughput.*``): the median may move
   toward worse by at most ``max_median_shift_ratio`` of the primary's median. Latency
   spread may grow by at most ``max_std_ratio``; TTFT and end-to-end latency also bound
   the ratio of the bad tail (p99).
7. One growing window judged again and again (a held canary step, each interval) spends
   its error rate ``1 - confidence`` over the looks (:meth:`Gates.for_look`): look ``k``
   is judged at ``(1 - confidence) * 6 / (pi**2 * k**2)``, which sums to ``1 - confidence``
   over any number of looks. Judged at the full rate every time, a candidate 4 % slower
   (inside the 10 % latency gate) was rolled back by one of ten looks in 20 % of canaries,
   an identical one in 3 % (``bench/judge_calibration.py --looks 10``).

``evaluators/_checks.py`` applies one metric's gate to its statistics; how a check grades
is the judge's rule 2 (``evaluators/_judge.py``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Final, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from evaluators._statistics import DEFAULT_CONFIDENCE, MIN_COMPARABLE_SAMPLES

__all__ = [
    "CACHE_PREFIX",
    "CAPTURE_PREFIX",
    "COST_PREFIX",
    "DEFAULT_MARGINAL_BAND",
    "DEFAULT_MAX_COST_RATIO",
    "DEFAULT_MAX_E2E_P99_RATIO",
    "DEFAULT_MAX_EMBEDDING_DISTANCE",
    "DEFAULT_MAX_ERROR_RATE_INCREASE",
    "DEFAULT_MAX_JUDGED_EXCHANGES",
    "DEFAULT_MAX_MEDIAN_SHIFT_RATIO",
    "DEFAULT_MAX_NOISE_FLOOR_MISS",
    "DEFAULT_MAX_NOISE_FLOOR_SHIFT_RATIO",
    "DEFAULT_MAX_STD_RATIO",
    "DEFAULT_MAX_TTFT_P99_RATIO",
    "DEFAULT_MIN_SAMPLES",
    "DEFAULT_MIN_SEMANTIC_SIMILARITY",
    "E2E_METRIC",
    "EMBEDDING_DISTANCE_METRIC",
    "LATENCY_PREFIX",
    "RATE_METRICS",
    "SEMANTIC_SIMILARITY_METRIC",
    "TTFT_METRIC",
    "Gates",
    "MetricGate",
]

TTFT_METRIC: Final = "latency.ttft_s"
E2E_METRIC: Final = "latency.e2e_s"
SEMANTIC_SIMILARITY_METRIC: Final = "quality.semantic_similarity"
EMBEDDING_DISTANCE_METRIC: Final = "quality.embedding_distance"
LATENCY_PREFIX: Final = "latency."
COST_PREFIX: Final = "cost."
CACHE_PREFIX: Final = "cache."
CAPTURE_PREFIX: Final = "capture."
RATE_METRICS: Final = ("reliability.success", "quality.json_valid", "quality.choices_complete")

DEFAULT_MIN_SAMPLES: Final = 30
DEFAULT_MAX_MEDIAN_SHIFT_RATIO: Final = 0.10
DEFAULT_MAX_STD_RATIO: Final = 1.25
DEFAULT_MAX_TTFT_P99_RATIO: Final = 1.2
DEFAULT_MAX_E2E_P99_RATIO: Final = 1.2
DEFAULT_MIN_SEMANTIC_SIMILARITY: Final = 0.85
DEFAULT_MAX_EMBEDDING_DISTANCE: Final = 0.01
"""Rule 2: an embedding model served with int8 or fp8 weights keeps its vectors within
this cosine distance (1 - cosine) of the full-precision model's; past it, nearest-neighbour
rankings change."""
DEFAULT_MAX_COST_RATIO: Final = 1.10
DEFAULT_MAX_ERROR_RATE_INCREASE: Final = 0.01
DEFAULT_MAX_NOISE_FLOOR_SHIFT_RATIO: Final = 0.02
DEFAULT_MAX_NOISE_FLOOR_MISS: Final = 0.2
"""The judge's rule 3: how far, as a share of a pairwise limit, a noise-floor replica may
itself miss that limit and still relax it (a similarity minimum of 0.85 to 0.68 at most, an
embedding-distance maximum of 0.01 to 0.012). A replica further off is no noise floor."""
DEFAULT_MARGINAL_BAND: Final = 0.05
DEFAULT_MAX_JUDGED_EXCHANGES: Final = 2000
"""A judgement reads the newest this many scored exchanges of its window at most: the
bootstraps cost ~2 ms per value and metric on one core, so ~4 s at this bound."""


class MetricGate(BaseModel):
    """The checks applied to one metric; a ``None`` threshold switches its check off."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    min_samples: int | None = Field(default=None, ge=MIN_COMPARABLE_SAMPLES)
    # Per-backend metrics, candidate against primary, each oriented so that larger is
    # worse (a ratio is primary/candidate when higher is better):
    max_shift_ratio: float | None = Field(default=None, ge=0.0)
    max_mean_ratio: float | None = Field(default=None, ge=1.0)
    max_mean_worsening: float | None = Field(default=None, ge=0.0)
    max_tail_ratio: float | None = Field(default=None, ge=1.0)
    max_std_ratio: float | None = Field(default=None, ge=1.0)
    # Pairwise metrics:
    min_mean: float | None = None
    max_mean: float | None = None
    max_noise_floor_shift_ratio: float | None = Field(default=None, ge=0.0)
    noise_floor_statistic: Literal["mean", "median"] = "mean"
    """What the noise-floor check compares: the mean (0/1 agreements, whose median shift
    is 0 whatever their rates) or the median (a ratio, whose mean a few slow requests
    pull: the Hodges-Lehmann shift)."""

    @model_validator(mode="after")
    def _a_rate_alone(self) -> MetricGate:
        """Rule 3: a rate's gate checks its rate and nothing else."""
        others = {"max_shift_ratio": self.max_shift_ratio, "max_mean_ratio": self.max_mean_ratio,
                  "max_tail_ratio": self.max_tail_ratio, "max_std_ratio": self.max_std_ratio}
        if self.max_mean_worsening is not None and any(v is not None for v in others.values()):
            named = ", ".join(k for k, v in others.items() if v is not None)
            raise ValueError(f"max_mean_worsening gates a 0/1 metric by its rate alone, "
                             f"not also by {named}")
        return self

    @property
    def has_backend_checks(self) -> bool:
        return any(
            x is not None
            for x in (
                self.max_shift_ratio,
                self.max_mean_ratio,
                self.max_mean_worsening,
                self.max_tail_ratio,
                self.max_std_ratio,
            )
        )

    @property
    def has_limit_checks(self) -> bool:
        return self.min_mean is not None or self.max_mean is not None

    def tested_checks(self, *, noise_floor: bool) -> int:
        """How many checks with a p-value this gate makes once its metric is judged (the
        judge's rule 10 tests them together); ``noise_floor``: a floor was measured."""
        limits = (self.max_shift_ratio, self.max_mean_ratio, self.max_mean_worsening,
                  self.max_tail_ratio, self.max_std_ratio, self.min_mean, self.max_mean)
        floor = noise_floor and self.max_noise_floor_shift_ratio is not None
        return sum(x is not None for x in limits) + int(floor)


class Gates(BaseModel):
    """Thresholds for judging a candidate; see the module's rules for how they apply."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    min_samples: int = Field(default=DEFAULT_MIN_SAMPLES, ge=MIN_COMPARABLE_SAMPLES)
    max_judged_exchanges: int = Field(default=DEFAULT_MAX_JUDGED_EXCHANGES,
                                      ge=MIN_COMPARABLE_SAMPLES)
    confidence: float = Field(default=DEFAULT_CONFIDENCE, gt=0.0, lt=1.0)
    max_median_shift_ratio: float | None = Field(default=DEFAULT_MAX_MEDIAN_SHIFT_RATIO, ge=0.0)
    max_std_ratio: float | None = Field(default=DEFAULT_MAX_STD_RATIO, ge=1.0)
    max_ttft_p99_ratio: float | None = Field(default=DEFAULT_MAX_TTFT_P99_RATIO, ge=1.0)
    max_e2e_p99_ratio: float | None = Field(default=DEFAULT_MAX_E2E_P99_RATIO, ge=1.0)
    min_semantic_similarity: float | None = DEFAULT_MIN_SEMANTIC_SIMILARITY
    max_embedding_distance: float | None = Field(default=DEFAULT_MAX_EMBEDDING_DISTANCE,
                                                  ge=0.0)
    max_cost_ratio: float | None = Field(default=DEFAULT_MAX_COST_RATIO, ge=1.0)
    max_error_rate_increase: float | None = Field(default=DEFAULT_MAX_ERROR_RATE_INCREASE, ge=0.0)
    max_noise_floor_shift_ratio: float | None = Field(
        default=DEFAULT_MAX_NOISE_FLOOR_SHIFT_RATIO, ge=0.0
    )
    max_noise_floor_miss: float = Field(default=DEFAULT_MAX_NOISE_FLOOR_MISS, ge=0.0)
    # MARGINAL within +/- marginal_band * |threshold| of each threshold.
    marginal_band: float = Field(default=DEFAULT_MARGINAL_BAND, ge=0.0, lt=1.0)
    # 0/1 metrics judged by their rate (the mean), not by a shift of the median.
    rate_metrics: tuple[str, ...] = RATE_METRICS
    # Metrics that must be present: one without samples is INCONCLUSIVE, not skipped.
    required_metrics: tuple[str, ...] = ()
    metrics: Mapping[str, MetricGate] = Field(default_factory=dict)

    def gate_for(self, metric: str, *, pairwise: bool) -> MetricGate:
        explicit = self.metrics.get(metric)
        if explicit is not None:
            return explicit
        if pairwise:
            similarity = metric == SEMANTIC_SIMILARITY_METRIC
            embedding = metric == EMBEDDING_DISTANCE_METRIC
            # A per-exchange latency ratio is latency: it gets the latency tolerance, not
            # the answers' agreement's (rule 2).
            latency = metric.startswith(LATENCY_PREFIX)
            return MetricGate(
                min_mean=self.min_semantic_similarity if similarity else None,
                max_mean=self.max_embedding_distance if embedding else None,
                max_noise_floor_shift_ratio=(
                    None if embedding
                    else self.max_median_shift_ratio if latency
                    else self.max_noise_floor_shift_ratio),
                noise_floor_statistic="median" if latency else "mean",
            )
        if metric in self.rate_metrics:
            return MetricGate(max_mean_worsening=self.max_error_rate_increase)
        if metric.startswith(COST_PREFIX):
            return MetricGate(max_mean_ratio=self.max_cost_ratio)
        if metric.startswith((CACHE_PREFIX, CAPTURE_PREFIX)):
            return MetricGate()
        if not metric.startswith(LATENCY_PREFIX):
            return MetricGate(max_shift_ratio=self.max_median_shift_ratio)
        tails = {TTFT_METRIC: self.max_ttft_p99_ratio, E2E_METRIC: self.max_e2e_p99_ratio}
        return MetricGate(
            max_shift_ratio=self.max_median_shift_ratio,
            max_std_ratio=self.max_std_ratio,
            max_tail_ratio=tails.get(metric),
        )

    def min_samples_for(self, gate: MetricGate) -> int:
        return self.min_samples if gate.min_samples is None else gate.min_samples

    def for_look(self, look: int) -> Gates:
        """Rule 7: these gates for the ``look``-th judgement (from 1) of one growing window."""
        if look < 1:
            raise ValueError(f"look must be at least 1, not {look}")
        error_rate = (1.0 - self.confidence) * 6.0 / (math.pi ** 2 * look ** 2)
        return self.model_copy(update={"confidence": 1.0 - error_rate})
