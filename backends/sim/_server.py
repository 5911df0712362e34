"""Running a simulator on a real socket, for the CLI and for tests in any package."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass

from aiohttp import web

from backends.sim._app import SIM_STATS, build_app
from backends.sim._config import SimConfig
from backends.sim._stats import SimStats

__all__ = ["SHUTDOWN_TIMEOUT_S", "RunningSim", "running_sim"]

# In-flight answers get this long to finish at shutdown; hung ones end at once.
SHUTDOWN_TIMEOUT_S = 5.0


@dataclass(frozen=True, slots=True)
class RunningSim:
    """A started simulator: where it listens and its app (for `SIM_STATS`)."""

    app: web.Application
    host: str
    port: int

    @property
    def base_url(self) -> str:
        """The OpenAI client's base_url: ``http://host:port/v1``."""
        return f"http://{self.host}:{self.port}/v1"

    @property
    def root_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def stats(self) -> SimStats:
        return self.app[SIM_STATS]


@asynccontextmanager
async def running_sim(config: SimConfig) -> AsyncIterator[RunningSim]:
    """Serve `config` on its host and port (0 picks a free one) until the block exits."""
    app = build_app(config)
    runner = web.AppRunner(app, handle_signals=False, shutdown_timeout=SHUTDOWN_TIMEOUT_S)
    await runner.setup()
    try:
        site = web.TCPSite(runner, config.host, config.port)
        await site.start()
        host, port = runner.addresses[0][:2]
        yield RunningSim(app=app, host=str(host), port=int(port))
    finally:
        await runner.cleanup()
