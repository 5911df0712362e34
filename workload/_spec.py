"""What a workload run is asked to do (``WorkloadSpec``, ``ReplaySpec``: pydantic, the edge)
and what it reports (``TurnResult``, ``DepthStats``, ``WorkloadSummary``: frozen data).

Every loop of a run is bounded by these numbers: sessions and turns in count
(``MAX_SESSIONS``, ``MAX_TURNS``, ``MAX_REPLAY_REQUESTS``), the run in time
(``duration_s`` plus ``drain_s``), each request by ``request_timeout_s``; each of those
times is at most ``MAX_DURATION_S`` (an infinite one would be no bound).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Annotated, Any, Final, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field

__all__ = [
    "DEFAULT_SESSION_HEADER",
    "MAX_REPLAY_REQUESTS",
    "MAX_SESSIONS",
    "MAX_TURNS",
    "THINK_JITTER",
    "DepthStats",
    "ReplaySpec",
    "TurnResult",
    "WorkloadSpec",
    "WorkloadSummary",
]

MAX_SESSIONS: Final = 10_000
MAX_TURNS: Final = 64
MAX_CONCURRENCY: Final = 1024
MAX_REPLAY_REQUESTS: Final = 100_000
MAX_DURATION_S: Final = 24 * 3600.0
DEFAULT_SESSION_HEADER: Final = "X-Session-Id"
"""The gateway's ``[mirror] session_header`` default: every turn of a session carries it, so
a gateway samples whole conversations."""
THINK_JITTER: Final = 0.5
"""A think time is drawn uniformly from ``think_s * (1 ± THINK_JITTER)``: mean ``think_s``,
never below half of it, never above one and a half times it."""
_HEADER_NAME: Final = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
"""An HTTP field name (RFC 9110 token): any other would fail every request at the client."""
DEFAULT_REQUEST_TIMEOUT_S: Final = 300.0
DEFAULT_DRAIN_S: Final = 30.0


def _header_name(value: str) -> str:
    if not _HEADER_NAME.fullmatch(value):
        raise ValueError("must be an HTTP header name: letters, digits and !#$%&'*+-.^_`|~")
    return value


_HeaderName = Annotated[str, Field(min_length=1, max_length=128), AfterValidator(_header_name)]


class _Spec(BaseModel):
    # NaN and infinity are no rate or bound: refused as such ("--rate nan" was refused as
    # "rate: Input should be less than or equal to 10000").
    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)


class WorkloadSpec(_Spec):
    """Agentic sessions: Poisson arrivals at ``rate`` sessions/s, ``turns`` turns each,
    ``think_s`` between a turn's answer and the next turn, at most ``concurrency`` sessions
    at once; no session starts and no turn is sent after ``duration_s``."""

    sessions: int = Field(8, ge=1, le=MAX_SESSIONS)
    turns: int = Field(4, ge=1, le=MAX_TURNS)
    rate: float = Field(1.0, gt=0, le=10_000)
    think_s: float = Field(1.0, ge=0, le=3600)
    duration_s: float = Field(300.0, gt=0, le=MAX_DURATION_S)
    concurrency: int = Field(16, ge=1, le=MAX_CONCURRENCY)
    model: str | None = None  # None: the first model the server lists
    max_tokens: int = Field(64, ge=1, le=32_768)
    temperature: float = Field(0.0, ge=0, le=2)
    tool_tokens: tuple[int, int] = (150, 400)  # a tool result's size, drawn per turn
    context_tokens: int = Field(0, ge=0, le=100_000)  # a first tool result in the task
    # "auto": send the ``tools`` definitions and let the model call them (vLLM needs
    # --enable-auto-tool-choice and a --tool-call-parser); "none": send them, no calls;
    # "omit": send no tools at all (tool results still follow each turn as user messages).
    tool_choice: Literal["auto", "none", "omit"] = "auto"
    stream: bool = True  # streaming measures TTFT; without it only e2e
    seed: int = 0
    session_header: _HeaderName = DEFAULT_SESSION_HEADER
    session_prefix: str = Field("load", min_length=1, max_length=64)
    request_timeout_s: float = Field(DEFAULT_REQUEST_TIMEOUT_S, gt=0, le=MAX_DURATION_S)
    # in-flight turns' grace after duration_s
    drain_s: float = Field(DEFAULT_DRAIN_S, ge=0, le=MAX_DURATION_S)


class ReplaySpec(_Spec):
    """Recorded requests sent again at their recorded offsets (divided by ``speed``)."""

    speed: float = Field(1.0, gt=0, le=1000)
    max_requests: int = Field(MAX_REPLAY_REQUESTS, ge=1, le=MAX_REPLAY_REQUESTS)
    duration_s: float = Field(MAX_DURATION_S, gt=0, le=MAX_DURATION_S)
    concurrency: int = Field(64, ge=1, le=MAX_CONCURRENCY)
    model: str | None = None  # replaces each recorded body's model when given
    session_header: _HeaderName = DEFAULT_SESSION_HEADER
    request_timeout_s: float = Field(DEFAULT_REQUEST_TIMEOUT_S, gt=0, le=MAX_DURATION_S)
    drain_s: float = Field(DEFAULT_DRAIN_S, ge=0, le=MAX_DURATION_S)


@dataclass(frozen=True, slots=True)
class TurnResult:
    """One request of a run. ``turn`` is its depth: the assistant messages before it.
    Token counts are None when the server did not report them (unknown, not 0)."""

    session: str
    turn: int
    started_s: float  # when it was sent, seconds since the run began
    ttft_s: float | None
    e2e_s: float
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    cached_tokens: int | None = None
    tool_calls: int = 0
    error: str | None = None

    def __post_init__(self) -> None:
        if self.turn < 0 or self.e2e_s < 0:
            raise ValueError(f"turn and e2e_s must be >= 0, got {self.turn}, {self.e2e_s}")

    @property
    def ok(self) -> bool:
        return self.error is None


@dataclass(frozen=True, slots=True)
class DepthStats:
    """Latency percentiles of the successful turns at one depth (None: no such turn)."""

    turn: int
    turns: int
    errors: int
    ttft_p50_s: float | None
    ttft_p99_s: float | None
    e2e_p50_s: float | None
    e2e_p99_s: float | None
    prompt_tokens_mean: float | None
    cached_tokens_mean: float | None


@dataclass(frozen=True, slots=True)
class WorkloadSummary:
    sessions: int  # sessions (or replayed session keys) that sent at least one turn
    sessions_completed: int  # every turn planned for it sent and answered without error
    turns: int
    errors: int
    wall_s: float
    by_depth: tuple[DepthStats, ...]
    results: tuple[TurnResult, ...]
    not_sent: int = 0  # turns or records read and cut by a bound (duration, drain, stop, route)
    errors_by_kind: tuple[tuple[str, int], ...] = ()  # ("http_500", 3), ...: most first
    # A replay's non-blank lines past --max-requests: never read as records (junk or not),
    # so neither sent nor not_sent.
    lines_past_max_requests: int = 0

    def __post_init__(self) -> None:
        if sum(count for _, count in self.errors_by_kind) != self.errors:
            raise ValueError(f"errors_by_kind {self.errors_by_kind} must add up to {self.errors}")

    def to_json(self, *, results: bool = False) -> dict[str, Any]:
        out: dict[str, Any] = {
            "sessions": self.sessions,
            "sessions_completed": self.sessions_completed,
            "turns": self.turns,
            "errors": self.errors,
            "errors_by_kind": dict(self.errors_by_kind),
            "not_sent": self.not_sent,
            "lines_past_max_requests": self.lines_past_max_requests,
            "wall_s": round(self.wall_s, 3),
            "by_depth": [_fields(d) for d in self.by_depth],
        }
        if results:
            out["results"] = [_fields(r) for r in self.results]
        return out


def _fields(item: TurnResult | DepthStats) -> dict[str, Any]:
    return {name: getattr(item, name) for name in item.__slots__}
