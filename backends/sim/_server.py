"""Running a simulator on a real socket, for the CLI and for tests in any package."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass

from backends.openai_wire import ServedApp, serve_app
from backends.sim._app import SIM_STATS, build_app
from backends.sim._config import SimConfig
from backends.sim._stats import SimStats

__all__ = ["RunningSim", "running_sim"]


@dataclass(frozen=True, slots=True)
class RunningSim(ServedApp):
    """A started simulator: where it listens and its app (for `SIM_STATS`)."""

    @property
    def stats(self) -> SimStats:
        return self.app[SIM_STATS]


@asynccontextmanager
async def running_sim(config: SimConfig) -> AsyncIterator[RunningSim]:
    """Serve `config` on its host and port (0 picks a free one) until the block exits."""
    async with serve_app(build_app(config), config.host, config.port) as served:
        yield RunningSim(app=served.app, host=served.host, port=served.port)
