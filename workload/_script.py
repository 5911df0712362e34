"""The synthetic agentic conversations ``understudy load`` and bench/multiturn.py send: a
system prompt describing tools, a task, then "tool results" (log lines, JSON records, metric
tables) appended turn after turn behind the model's own answers.

Rules:
1. Everything is drawn from ``random.Random(seed)``: the same seed gives the same texts, byte
   for byte, so runs that must see one workload (the policy runs) use one seed.
2. Sizes are asked for in tokens and met within about a line (``CHARS_PER_TOKEN``, measured
   on SmolLM2's tokenizer for each generator); the benchmark buckets by the ``prompt_tokens``
   the server counted, never by these estimates.
3. Every session shares the system prompt (agents of one product share their tool
   descriptions); tasks and tool results differ per session and per turn.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass

__all__ = [
    "CHARS_PER_TOKEN",
    "SYSTEM_PROMPT",
    "TOOLS",
    "SessionScript",
    "tool_result",
]

# Characters per SmolLM2 token of each generator's text below (measured with the engine's
# tokenizer over 20 seeds: digits are single tokens, so number-heavy text is dense).
CHARS_PER_TOKEN = {"search_logs": 1.82, "list_deployments": 1.96, "query_metrics": 1.28}

_TOOLS = (
    (
        "search_logs",
        "Search the log store.",
        {"service": "string", "level": "string", "since": "ISO-8601 time", "limit": "integer"},
    ),
    (
        "query_metrics",
        "Read a time series.",
        {"metric": "string", "host": "string", "window": "duration", "step": "duration"},
    ),
    (
        "list_deployments",
        "List the deployments of a service.",
        {"service": "string", "env": "string"},
    ),
    ("get_incident", "Fetch an incident record.", {"incident_id": "string"}),
    ("run_query", "Run a read-only SQL query on the inventory.", {"sql": "string"}),
    (
        "restart_service",
        "Restart a service on one host (needs approval).",
        {"service": "string", "host": "string", "reason": "string"},
    ),
    (
        "open_ticket",
        "Open a ticket for a team.",
        {"team": "string", "title": "string", "body": "string", "severity": "integer"},
    ),
    ("http_probe", "Probe an HTTP endpoint from a region.", {"url": "string", "region": "string"}),
)


_JSON_TYPES = {"integer": "integer"}


def _tool_definitions() -> tuple[dict[str, object], ...]:
    """The same tools as OpenAI ``tools`` entries (function definitions), for servers that
    render them into the prompt or answer with ``tool_calls``."""
    out: list[dict[str, object]] = []
    for name, what, params in _TOOLS:
        properties = {
            key: {"type": _JSON_TYPES.get(kind, "string"), "description": kind}
            for key, kind in params.items()
        }
        out.append({
            "type": "function",
            "function": {
                "name": name,
                "description": what,
                "parameters": {"type": "object", "properties": properties,
                               "required": list(params)},
            },
        })
    return tuple(out)


TOOLS = _tool_definitions()


def _system_prompt() -> str:
    lines = [
        "You are an operations agent for a payments platform. You investigate alerts by "
        "calling tools, one call per turn, and you explain each step in one or two sentences. "
        "Answer with the next tool call as JSON, or with a short diagnosis when you are done.",
        "",
        "Tools:",
    ]
    for name, what, params in _TOOLS:
        args = ", ".join(f'"{key}": {kind}' for key, kind in params.items())
        lines.append(f"- {name}: {what} Arguments: {{{args}}}.")
    lines += [
        "",
        "Rules: never restart a service without an incident id; quote log lines exactly; "
        "prefer metrics over logs for latency questions; say which host you looked at.",
    ]
    return "\n".join(lines)


SYSTEM_PROMPT = _system_prompt()

_SERVICES = (
    "ledger",
    "checkout",
    "fraud-score",
    "payouts",
    "auth",
    "fx-rates",
    "webhooks",
    "settlement",
    "card-vault",
    "notifier",
)
_LEVELS = ("INFO", "INFO", "INFO", "WARN", "WARN", "ERROR", "DEBUG")
_EVENTS = (
    "request completed",
    "upstream timeout",
    "retrying after backoff",
    "connection reset by peer",
    "cache miss for key",
    "slow query detected",
    "circuit breaker opened",
    "token refreshed",
    "queue depth above threshold",
    "payment authorised",
    "payment declined by issuer",
    "webhook delivery failed",
    "lock wait exceeded",
    "rebalanced partitions",
)
_REGIONS = ("eu-west-1", "eu-central-1", "us-east-1", "us-west-2", "ap-south-1")
_STATES = ("running", "degraded", "draining", "failed", "pending")
_TASKS = (
    "Alert: p99 latency of {svc} doubled in the last 30 minutes. Find the cause.",
    "Alert: error rate of {svc} above 2% in {region}. Investigate and propose a fix.",
    "A customer reports duplicate charges from {svc}. Check what happened today.",
    "Alert: {svc} queue depth keeps growing on {host}. Find out why.",
    "Deployment of {svc} to {region} stalled at 40%. Decide whether to roll back.",
)


def _host(rng: random.Random) -> str:
    return f"{rng.choice(_SERVICES)}-{rng.randint(1, 24):02d}.{rng.choice(_REGIONS)}"


def _log_lines(rng: random.Random, budget: int) -> list[str]:
    lines: list[str] = []
    minute, second = rng.randint(0, 59), 0
    while budget > 0:
        second += rng.randint(0, 9)
        minute, second = (minute + second // 60) % 60, second % 60
        line = (
            f"2025-03-{rng.randint(1, 28):02d}T14:{minute:02d}:{second:02d}Z "
            f"{rng.choice(_LEVELS):5s} {rng.choice(_SERVICES)} [{_host(rng)}] "
            f"{rng.choice(_EVENTS)} req={rng.getrandbits(32):08x} "
            f"took={rng.randint(1, 4000)}ms"
        )
        lines.append(line)
        budget -= len(line) + 1
    return lines


def _records(rng: random.Random, budget: int) -> list[str]:
    lines: list[str] = []
    while budget > 0:
        record = {
            "id": f"dep-{rng.getrandbits(24):06x}",
            "service": rng.choice(_SERVICES),
            "host": _host(rng),
            "state": rng.choice(_STATES),
            "version": f"{rng.randint(1, 9)}.{rng.randint(0, 30)}.{rng.randint(0, 99)}",
            "latency_ms": {"p50": rng.randint(2, 90), "p99": rng.randint(90, 3000)},
        }
        line = json.dumps(record)
        lines.append(line)
        budget -= len(line) + 1
    return lines


def _metric_table(rng: random.Random, budget: int) -> list[str]:
    lines = ["time,host,rps,errors,p50_ms,p99_ms,cpu_pct"]
    minute = rng.randint(0, 50)
    while budget > 0:
        minute = (minute + 1) % 60
        line = (
            f"14:{minute:02d},{_host(rng)},{rng.randint(50, 2000)},{rng.randint(0, 40)},"
            f"{rng.randint(2, 80)},{rng.randint(80, 2500)},{rng.randint(5, 99)}"
        )
        lines.append(line)
        budget -= len(line) + 1
    return lines


_GENERATORS = {
    "search_logs": _log_lines,
    "list_deployments": _records,
    "query_metrics": _metric_table,
}


def tool_result(rng: random.Random, tokens: int) -> str:
    """A tool's answer of about ``tokens`` tokens, as the user message an agent loop sends."""
    tool = rng.choice(sorted(_GENERATORS))
    body = _GENERATORS[tool](rng, int(tokens * CHARS_PER_TOKEN[tool]))
    return f"Tool result ({tool}, {len(body)} lines):\n" + "\n".join(body)


@dataclass(frozen=True, slots=True)
class SessionScript:
    """What the client side of one conversation says: its task, then one tool result per
    later turn. The assistant messages in between come from the server under test."""

    name: str
    task: str
    tool_results: tuple[str, ...]

    @property
    def turns(self) -> int:
        return 1 + len(self.tool_results)

    @classmethod
    def draw(
        cls,
        name: str,
        seed: int,
        *,
        turns: int,
        tool_tokens: tuple[int, int],
        context_tokens: int = 0,
    ) -> SessionScript:
        """``turns`` turns; each later turn appends a tool result of ``tool_tokens`` (a range,
        drawn per turn); ``context_tokens`` > 0 puts a first tool result into the task."""
        rng = random.Random(seed)
        task = rng.choice(_TASKS).format(
            svc=rng.choice(_SERVICES), region=rng.choice(_REGIONS), host=_host(rng)
        )
        if context_tokens:
            task += "\nHere is what the pager attached.\n" + tool_result(rng, context_tokens)
        results = tuple(
            tool_result(rng, rng.randint(*tool_tokens)) for _ in range(max(0, turns - 1))
        )
        return cls(name, task, results)

    def messages(self, answers: list[str]) -> list[dict[str, str]]:
        """The request of turn ``len(answers)``: the history with the answers given so far."""
        if len(answers) >= self.turns:
            raise ValueError(f"{self.name} has {self.turns} turns")
        out = [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": self.task}]
        for answer, result in zip(answers, self.tool_results, strict=False):
            out += [{"role": "assistant", "content": answer}, {"role": "user", "content": result}]
        return out
