"""The agentic multi-turn workload: ``understudy load`` and its programmatic API.

``run_workload(spec, base_url, api_key=..., on_turn=...)`` drives Poisson-arriving sessions
with tools, tool results and think time through the official ``openai`` client;
``replay_workload(path, base_url, ...)`` sends a gateway's recorded traffic again with its
timing. Both return a ``WorkloadSummary``; ``on_turn`` sees each ``TurnResult`` as it ends.
"""

from workload._cli import load_command
from workload._driver import OnTurn, run_workload
from workload._replay import TrafficRecord, read_records, replay_workload
from workload._script import SYSTEM_PROMPT, TOOLS, SessionScript, tool_result
from workload._spec import (
    DEFAULT_SESSION_HEADER,
    DepthStats,
    ReplaySpec,
    TurnResult,
    WorkloadSpec,
    WorkloadSummary,
)
from workload._summary import summary_table

__all__ = [
    "DEFAULT_SESSION_HEADER",
    "SYSTEM_PROMPT",
    "TOOLS",
    "DepthStats",
    "OnTurn",
    "ReplaySpec",
    "SessionScript",
    "TrafficRecord",
    "TurnResult",
    "WorkloadSpec",
    "WorkloadSummary",
    "load_command",
    "read_records",
    "replay_workload",
    "run_workload",
    "summary_table",
    "tool_result",
]
