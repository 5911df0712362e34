"""What a scorer is and what it returns: the interface of the scorer family.

Rules every scorer keeps:
1. ``score`` never raises on what a backend sent: a failed observation (an error, a
   non-2xx status, text lost to a truncated capture) gives ``None`` for the values that
   depend on it, never a crash and never a made-up 0.
2. A per-backend metric carries both values (``candidate`` and ``primary``), measured the
   same way; a pairwise metric (a similarity, an agreement, a ratio) carries only
   ``candidate`` and ``primary`` is ``None``.
3. Every metric a scorer emits is listed in :data:`METRICS` with its direction, so that the
   judge knows whether a larger value is better without knowing the scorer.
4. A scorer may also score many exchanges in one call (:class:`BatchScorer`), for work
   that is cheaper together (the sentence encoder's). Only a scorer whose scores of one
   exchange do not depend on the others may: :func:`score_batch` runs the batch scorers
   first, then every other scorer exchange by exchange in order, so a stateful scorer
   (the throughput window) sees the same sequence as with :func:`score_exchange`, and
   every exchange gets the scores it would get alone.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Literal, Protocol, runtime_checkable

from evaluators._exchange import Exchange

__all__ = [
    "METRICS",
    "BatchScorer",
    "Direction",
    "MetricKind",
    "MetricSpec",
    "Score",
    "Scorer",
    "score_batch",
    "score_exchange",
]

Direction = Literal["higher", "lower"]
MetricKind = Literal["per_backend", "pairwise"]


@dataclass(frozen=True, slots=True)
class Score:
    metric: str
    candidate: float | None
    primary: float | None  # None for pairwise metrics

    def __post_init__(self) -> None:
        if self.metric not in METRICS:
            raise ValueError(f"unknown metric {self.metric!r}")
        for value in (self.candidate, self.primary):
            if value is not None and not math.isfinite(value):
                raise ValueError(f"{self.metric}: {value!r} is not a finite number")
        if METRICS[self.metric].kind == "pairwise" and self.primary is not None:
            raise ValueError(f"{self.metric} is pairwise: it has no primary value")


class Scorer(Protocol):
    @property
    def name(self) -> str: ...

    def score(self, exchange: Exchange) -> list[Score]: ...


@runtime_checkable
class BatchScorer(Scorer, Protocol):
    """A scorer that also scores a batch at once (rule 4); ``score_batch(xs)[i]`` equals
    ``score(xs[i])`` within float rounding."""

    def score_batch(self, exchanges: Sequence[Exchange]) -> list[list[Score]]: ...


@dataclass(frozen=True, slots=True)
class MetricSpec:
    direction: Direction  # which way is better
    kind: MetricKind
    unit: str
    description: str


def _spec(direction: Direction, kind: MetricKind, unit: str, description: str) -> MetricSpec:
    return MetricSpec(direction, kind, unit, description)


_H: Direction = "higher"
_L: Direction = "lower"
_B: MetricKind = "per_backend"
_P: MetricKind = "pairwise"

METRICS: MappingProxyType[str, MetricSpec] = MappingProxyType({
    "quality.exact_match": _spec(_H, _P, "1/0", "candidate text == primary text, byte for byte"),
    "quality.edit_similarity": _spec(
        _H, _P, "0..1", "normalized Levenshtein similarity of the texts"),
    "quality.token_f1": _spec(
        _H, _P, "0..1", "SQuAD token F1 of the normalized texts (MLQA's beyond ASCII)"),
    "quality.semantic_similarity": _spec(
        _H, _P, "-1..1", "cosine of all-MiniLM-L6-v2 embeddings of the texts"),
    "quality.tool_call_match": _spec(
        _H, _P, "1/0", "same calls (names, arguments equal as parsed JSON), in any order"),
    "quality.json_valid": _spec(
        _H, _B, "1/0", "text is a JSON object or array (when the primary's looks like JSON)"),
    "quality.finish_reason_match": _spec(_H, _P, "1/0", "same finish_reason"),
    "quality.embedding_distance": _spec(
        _L, _P, "0..2", "cosine distance (1 - cosine) of the two embeddings of each input, "
        "averaged (embeddings)"),
    "quality.choices_complete": _spec(
        _H, _B, "1/0", "as many choices as the request asked for (n, per prompt)"),
    "reliability.success": _spec(_H, _B, "1/0", "no error and a 2xx status"),
    "latency.ttft_s": _spec(_L, _B, "s", "time to first token (streamed answers)"),
    "latency.itl_mean_s": _spec(_L, _B, "s", "mean inter-chunk time (streamed, >= 2 gaps)"),
    "latency.itl_p99_s": _spec(_L, _B, "s", "99th percentile inter-chunk time (>= 2 gaps)"),
    "latency.e2e_s": _spec(_L, _B, "s", "request start to last byte"),
    "latency.ttft_ratio": _spec(_L, _P, "ratio", "candidate TTFT / primary TTFT"),
    "latency.e2e_ratio": _spec(_L, _P, "ratio", "candidate e2e / primary e2e"),
    "throughput.output_tps": _spec(
        _H, _B, "tokens/s", "decode rate (streamed) or completion tokens / e2e"),
    "cost.usd": _spec(_L, _B, "USD", "what the request cost under the backend's price model"),
    "cost.usd_per_mtok": _spec(
        _L, _B, "USD/1M tokens", "cost.usd per million completion tokens"),
    "cache.hit_ratio": _spec(_H, _B, "0..1", "cached prompt tokens / prompt tokens"),
    "capture.truncated": _spec(
        _L, _B, "1/0", "the answer outgrew [capture] max_bytes: its quality is not scored"),
})


def score_exchange(exchange: Exchange, scorers: Iterable[Scorer]) -> list[Score]:
    """Every score of every scorer for one exchange, in the scorers' order."""
    scores: list[Score] = []
    for scorer in scorers:
        scores.extend(scorer.score(exchange))
    return scores


def score_batch(exchanges: Sequence[Exchange],
                scorers: Sequence[Scorer]) -> list[list[Score] | Exception]:
    """Every score of every scorer for each exchange, as :func:`score_exchange` gives them
    one at a time (rule 4); an exchange whose scoring raised gets the exception instead.

    A batch scorer that raises on the batch is asked again exchange by exchange, so one
    bad exchange costs only its own scores.
    """
    batched: dict[int, list[list[Score]]] = {}
    for position, scorer in enumerate(scorers):
        if isinstance(scorer, BatchScorer) and len(exchanges) > 1:
            try:
                each = scorer.score_batch(exchanges)
            except Exception:  # retried one by one below, which reports it
                continue
            if len(each) == len(exchanges):
                batched[position] = each
    results: list[list[Score] | Exception] = []
    for i, exchange in enumerate(exchanges):
        try:
            scores: list[Score] = []
            for position, scorer in enumerate(scorers):
                done = batched.get(position)
                scores.extend(done[i] if done is not None else scorer.score(exchange))
        except Exception as exc:  # the caller counts it (scoring_error)
            results.append(exc)
        else:
            results.append(scores)
    return results
