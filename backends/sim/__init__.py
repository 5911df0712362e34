"""A vLLM OpenAI-protocol simulator for tests and benchmarks.

It answers /v1/chat/completions, /v1/completions, /v1/embeddings, /v1/models, /health
and /metrics as vLLM's OpenAI server does, with deterministic text, configurable
timing, reported prefix-cache hits and injectable faults. `build_app` gives the aiohttp
application, whose counters are under `SIM_STATS`; `running_sim` serves one on a loopback
socket for tests; `sim_command` runs one from the command line.
"""

from backends.sim._app import SIM_STATS, build_app
from backends.sim._cli import sim_command
from backends.sim._config import FaultMode, SimConfig
from backends.sim._server import RunningSim, running_sim
from backends.sim._stats import MAX_RECORDED_REQUESTS, RecordedRequest, SimStats

__all__ = [
    "MAX_RECORDED_REQUESTS",
    "SIM_STATS",
    "FaultMode",
    "RecordedRequest",
    "RunningSim",
    "SimConfig",
    "SimStats",
    "build_app",
    "running_sim",
    "sim_command",
]
