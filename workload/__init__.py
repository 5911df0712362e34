"""The agentic multi-turn workload: ``understudy load`` and its programmatic API.

``run_workload(spec, base_url, api_key=..., on_turn=...)`` drives Poisson-arriving sessions
with tools, tool results and think time through the official ``openai`` client;
``replay_workload(path, base_url, ...)`` sends a gateway's recorded traffic again with its
timing. Both return a ``WorkloadSummary``; ``on_turn`` sees each ``TurnResult`` as it ends.
"""

import typing

from gateway.lazy_exports import lazy_exports as _lazy_exports

if typing.TYPE_CHECKING:
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

# Loaded on first use (PEP 562): ``understudy load --help`` (gateway/cli.py) imports only the
# command's module, not the openai client the driver needs.
_EXPORTED_FROM = {
    "DEFAULT_SESSION_HEADER": "workload._spec",
    "SYSTEM_PROMPT": "workload._script",
    "TOOLS": "workload._script",
    "DepthStats": "workload._spec",
    "OnTurn": "workload._driver",
    "ReplaySpec": "workload._spec",
    "SessionScript": "workload._script",
    "TrafficRecord": "workload._replay",
    "TurnResult": "workload._spec",
    "WorkloadSpec": "workload._spec",
    "WorkloadSummary": "workload._spec",
    "load_command": "workload._cli",
    "read_records": "workload._replay",
    "replay_workload": "workload._replay",
    "run_workload": "workload._driver",
    "summary_table": "workload._summary",
    "tool_result": "workload._script",
}


__getattr__, __dir__ = _lazy_exports(__name__, _EXPORTED_FROM)
