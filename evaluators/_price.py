"""What a request cost on a backend, under that backend's price model.

Two models, chosen per backend by ``mode``:

``per_token`` (a hosted API, or an internal transfer price)::

    usd = (uncached_prompt * prompt_usd_per_mtok
           + cached_prompt * cached_prompt_usd_per_mtok
           + completion * completion_usd_per_mtok) / 1e6

  Without a cached-prompt price every prompt token costs the prompt price and the cached
  count is not needed. With one, the cached count must be known: an unreported count is
  unknown, not 0, so the cost is unknown (vLLM reports it with
  ``--enable-prompt-tokens-details``).

``gpu_hour`` (a deployment you rent by the hour)::

    usd = gpu_count * gpu_usd_per_hour / 3600 * completion_tokens / tokens_per_s

  ``tokens_per_s`` is the deployment's aggregate output rate: ``capacity_tokens_per_s``
  when configured (a benchmarked rate: the cost at that load), else the rate measured by
  the :class:`ThroughputWindow` over the requests around this one (busy time only; see
  ``_throughput``). Each output token is charged an equal share of the GPU-seconds, so
  prefill is paid for through the measured rate (it slows the rate down) rather than per
  prompt token: a long-prompt request is undercharged and a long-answer one overcharged,
  but over the window the charges add up to the busy GPU time. Unknown rate: unknown cost.

``cost.usd_per_mtok`` is ``usd`` per million completion tokens (what an output token
costs, its prompt included); a session's cost is the sum over its exchanges, unknown if
any exchange's cost is unknown.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

from evaluators._exchange import Exchange
from evaluators._observation import Observation
from evaluators._score import Score
from evaluators._throughput import ThroughputWindow

__all__ = [
    "CostModel",
    "CostScorer",
    "GpuHourPrice",
    "PriceModel",
    "SessionCost",
    "TokenPrice",
    "session_costs",
]

TOKENS_PER_MTOK = 1_000_000
SECONDS_PER_HOUR = 3600.0


class TokenPrice(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    mode: Literal["per_token"] = "per_token"
    prompt_usd_per_mtok: float = Field(ge=0)
    completion_usd_per_mtok: float = Field(ge=0)
    cached_prompt_usd_per_mtok: float | None = Field(None, ge=0)

    def usd(self, observation: Observation) -> float | None:
        usage = observation.usage
        if usage is None or usage.prompt_tokens is None or usage.completion_tokens is None:
            return None
        cached_usd = 0.0
        uncached = usage.prompt_tokens
        if self.cached_prompt_usd_per_mtok is not None:
            if usage.cached_tokens is None:
                return None
            uncached -= usage.cached_tokens
            cached_usd = usage.cached_tokens * self.cached_prompt_usd_per_mtok
        return (uncached * self.prompt_usd_per_mtok + cached_usd
                + usage.completion_tokens * self.completion_usd_per_mtok) / TOKENS_PER_MTOK


class GpuHourPrice(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    mode: Literal["gpu_hour"] = "gpu_hour"
    gpu_usd_per_hour: float = Field(gt=0)
    gpu_count: int = Field(1, ge=1)
    capacity_tokens_per_s: float | None = Field(None, gt=0)

    def usd(self, observation: Observation, tokens_per_s: float | None) -> float | None:
        usage = observation.usage
        rate = self.capacity_tokens_per_s or tokens_per_s
        if usage is None or usage.completion_tokens is None or not rate:
            return None
        gpu_seconds = usage.completion_tokens / rate
        return self.gpu_count * self.gpu_usd_per_hour / SECONDS_PER_HOUR * gpu_seconds


PriceModel = Annotated[TokenPrice | GpuHourPrice, Field(discriminator="mode")]


class CostModel:
    """The price model of every priced backend, and the measured rates GPU pricing needs."""

    def __init__(self, prices: Mapping[str, PriceModel],
                 window: ThroughputWindow | None = None) -> None:
        self.prices = dict(prices)
        self.window = window

    def request_usd(self, observation: Observation) -> float | None:
        """The cost of one answer; None if unpriced, failed, or its usage is unknown."""
        price = self.prices.get(observation.backend)
        if price is None or not observation.ok:
            return None
        if isinstance(price, TokenPrice):
            return price.usd(observation)
        rate = None
        if price.capacity_tokens_per_s is None and self.window is not None:
            self.window.record(observation)  # idempotent; the rate must include this one
            rate = self.window.tokens_per_s(observation.backend,
                                            at=_ended_at(observation))
        return price.usd(observation, rate)


def _ended_at(observation: Observation) -> float | None:
    if observation.e2e_s is None:
        return None
    return observation.started_at + observation.e2e_s


def _per_mtok(usd: float | None, observation: Observation) -> float | None:
    usage = observation.usage
    if usd is None or usage is None or not usage.completion_tokens:
        return None
    return usd / usage.completion_tokens * TOKENS_PER_MTOK


@dataclass(frozen=True, slots=True)
class CostScorer:
    model: CostModel
    name: str = "cost"

    def score(self, exchange: Exchange) -> list[Score]:
        cand, prim = exchange.candidate_observation, exchange.primary
        cand_usd, prim_usd = self.model.request_usd(cand), self.model.request_usd(prim)
        return [
            Score("cost.usd", cand_usd, prim_usd),
            Score("cost.usd_per_mtok", _per_mtok(cand_usd, cand), _per_mtok(prim_usd, prim)),
        ]


@dataclass(frozen=True, slots=True)
class SessionCost:
    session_key: str
    candidate: str
    exchanges: int
    candidate_usd: float | None  # None: at least one exchange's cost is unknown
    primary_usd: float | None


def session_costs(exchanges: Iterable[Exchange], model: CostModel) -> list[SessionCost]:
    """What each (session, candidate) pair cost on both sides, summed over its exchanges."""
    totals: dict[tuple[str, str], tuple[int, float | None, float | None]] = {}
    for exchange in exchanges:
        key = (exchange.session_key, exchange.candidate)
        count, cand, prim = totals.get(key, (0, 0.0, 0.0))
        totals[key] = (count + 1,
                       _add(cand, model.request_usd(exchange.candidate_observation)),
                       _add(prim, model.request_usd(exchange.primary)))
    return [SessionCost(session, candidate, count, cand, prim)
            for (session, candidate), (count, cand, prim) in totals.items()]


def _add(total: float | None, value: float | None) -> float | None:
    return None if total is None or value is None else total + value
