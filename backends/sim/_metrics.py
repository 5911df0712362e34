"""The simulator's Prometheus metrics: vLLM's series (``backends.openai_wire``) and a
simulated KV cache behind ``vllm:kv_cache_usage_perc``."""

from __future__ import annotations

from typing import Literal

from backends.openai_wire import VLLMSeries

__all__ = ["KV_CACHE_CAPACITY_TOKENS", "SimMetrics"]

# Tokens the simulated KV cache holds when full; in-flight prompt + answer tokens over
# this is what `vllm:kv_cache_usage_perc` reports.
KV_CACHE_CAPACITY_TOKENS = 65_536


class SimMetrics(VLLMSeries):
    """vLLM's series for one simulator app, with a simulated KV cache."""

    def __init__(self, model: str) -> None:
        super().__init__(model)
        self._held_tokens = 0

    def hold_tokens(self, tokens: int) -> None:
        """Account tokens of an in-flight request in the simulated KV cache."""
        self._held_tokens += tokens
        self.kv_usage.set(min(1.0, self._held_tokens / KV_CACHE_CAPACITY_TOKENS))

    def finished(
        self,
        outcome: Literal["completed", "cancelled", "faulted"],
        finish_reason: Literal["stop", "length"],
        elapsed_s: float,
    ) -> None:
        """Count an ended request as vLLM does: by finish reason, abort or error."""
        if outcome == "completed":
            self.e2e.observe(elapsed_s)
            self.count_outcome(finish_reason)
        else:
            self.count_outcome("abort" if outcome == "cancelled" else "error")
