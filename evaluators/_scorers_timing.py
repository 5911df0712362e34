"""Per-backend scorers: reliability, latency, throughput and prefix-cache use.

Each value is measured the same way on the primary and on the candidate. Only an ``ok``
answer has meaningful timings or usage: a 500 returned in 2 ms is not a fast answer, so a
failed observation gives ``None`` here and counts in ``reliability.success`` instead.
TTFT and inter-chunk times exist only for streamed answers.

An answer cut because its client went away (``CLIENT_DISCONNECTED``: an agent that stops
reading a stream) did not fail on the backend's side: its success is unknown (``None``),
never a failure that would make the primary look less reliable than its candidate.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from evaluators._exchange import Exchange
from evaluators._observation import CLIENT_DISCONNECTED, Observation
from evaluators._score import Score
from evaluators._throughput import ThroughputWindow, output_tokens_per_s

__all__ = [
    "CacheScorer",
    "LatencyScorer",
    "ReliabilityScorer",
    "ThroughputScorer",
    "cache_hit_ratio",
    "itl_stats",
]

MIN_GAPS_FOR_ITL = 2
ITL_PERCENTILE = 99.0
_NO_ITL: tuple[None, None] = (None, None)


def _both(exchange: Exchange) -> tuple[Observation, Observation]:
    return exchange.candidate_observation, exchange.primary


def _ttft(observation: Observation) -> float | None:
    return observation.ttft_s if observation.ok and observation.streamed else None


def _e2e(observation: Observation) -> float | None:
    return observation.e2e_s if observation.ok else None


def itl_stats(observation: Observation) -> tuple[float, float] | None:
    """Mean and 99th percentile of the inter-chunk times; None below two gaps."""
    gaps = observation.chunk_gaps_s
    if not observation.ok or not observation.streamed or len(gaps) < MIN_GAPS_FOR_ITL:
        return None
    return float(np.mean(gaps)), float(np.percentile(gaps, ITL_PERCENTILE))


def _ratio(candidate: float | None, primary: float | None) -> float | None:
    if candidate is None or primary is None or primary <= 0:
        return None
    return candidate / primary


def _success(observation: Observation) -> float | None:
    """1.0 answered, 0.0 failed, None when the client cut it (the backend did not fail)."""
    return None if observation.error == CLIENT_DISCONNECTED else float(observation.ok)


@dataclass(frozen=True, slots=True)
class ReliabilityScorer:
    name: str = "reliability"

    def score(self, exchange: Exchange) -> list[Score]:
        cand, prim = _both(exchange)
        return [Score("reliability.success", _success(cand), _success(prim))]


@dataclass(frozen=True, slots=True)
class LatencyScorer:
    name: str = "latency"

    def score(self, exchange: Exchange) -> list[Score]:
        cand, prim = _both(exchange)
        cand_itl, prim_itl = itl_stats(cand) or _NO_ITL, itl_stats(prim) or _NO_ITL
        return [
            Score("latency.ttft_s", _ttft(cand), _ttft(prim)),
            Score("latency.itl_mean_s", cand_itl[0], prim_itl[0]),
            Score("latency.itl_p99_s", cand_itl[1], prim_itl[1]),
            Score("latency.e2e_s", _e2e(cand), _e2e(prim)),
            Score("latency.ttft_ratio", _ratio(_ttft(cand), _ttft(prim)), None),
            Score("latency.e2e_ratio", _ratio(_e2e(cand), _e2e(prim)), None),
        ]


@dataclass(frozen=True, slots=True)
class ThroughputScorer:
    """Each answer's output rate; also feeds ``window`` (if any) for the GPU-hour price."""

    window: ThroughputWindow | None = None
    name: str = "throughput"

    def score(self, exchange: Exchange) -> list[Score]:
        cand, prim = _both(exchange)
        if self.window is not None:
            self.window.record(prim)
            self.window.record(cand)
        return [Score("throughput.output_tps", output_tokens_per_s(cand),
                      output_tokens_per_s(prim))]


def cache_hit_ratio(observation: Observation) -> float | None:
    """Cached prompt tokens / prompt tokens; None when the backend did not report them."""
    usage = observation.usage
    if (not observation.ok or usage is None or usage.cached_tokens is None
            or not usage.prompt_tokens):
        return None
    return usage.cached_tokens / usage.prompt_tokens


@dataclass(frozen=True, slots=True)
class CacheScorer:
    name: str = "cache"

    def score(self, exchange: Exchange) -> list[Score]:
        cand, prim = _both(exchange)
        return [Score("cache.hit_ratio", cache_hit_ratio(cand), cache_hit_ratio(prim))]
