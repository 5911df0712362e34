"""Factories for real servers on loopback sockets, shared by the test suites."""

from __future__ import annotations

import asyncio
import socket
import subprocess
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import ExitStack, asynccontextmanager
from dataclasses import dataclass
from typing import Any

import openai
import psutil
from aiohttp import web
from hypothesis import HealthCheck, settings

from backends.sim import SIM_STATS, SimConfig, SimStats
from backends.sim import build_app as build_sim_app
from evaluators import EvaluationSink, MemorySink
from gateway import STATE, build_app, load_config, make_admin_runner, make_runner
from gateway._state import GatewayState


def fuzz_settings(max_examples: int, *suppress: HealthCheck) -> settings:
    """The suite's property tests: reproducible (derandomized, no example database) and
    not failed for slow data generation or a slow example on a loaded machine (no
    deadline: an example that ran past one and not on its replay was an "unreliable test
    timings" failure; speed is the benchmarks' to check)."""
    return settings(max_examples=max_examples, deadline=None, derandomize=True,
                    database=None, suppress_health_check=[HealthCheck.too_slow, *suppress])


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def free_ports(count: int) -> list[int]:
    """``count`` distinct free loopback ports, for servers that bind them together later.
    All are bound at once: ``free_port`` called again may hand out the port it just gave
    (the kernel picks at random, one pair in about 14,000)."""
    with ExitStack() as held:
        sockets = [held.enter_context(socket.socket()) for _ in range(count)]
        for sock in sockets:
            sock.bind(("127.0.0.1", 0))
        return [int(sock.getsockname()[1]) for sock in sockets]


@asynccontextmanager
async def serving(runner: web.BaseRunner) -> AsyncIterator[str]:
    """Start ``runner`` on an ephemeral loopback port; yield its root URL."""
    await runner.setup()
    try:
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = runner.addresses[0][1]
        yield f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()


@asynccontextmanager
async def answering_once(answer: bytes) -> AsyncIterator[str]:
    """A loopback server that reads each connection's request head, writes ``answer`` and
    closes: an upstream that speaks garbage. Yields its root URL."""

    async def answer_and_close(reader: asyncio.StreamReader,
                               writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(answer)
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(answer_and_close, "127.0.0.1", 0)
    async with server:
        yield f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"


@dataclass
class RunningApp:
    """An app serving on a loopback port: its root URL and the app."""

    url: str
    app: web.Application

    @property
    def base_url(self) -> str:
        """Where the OpenAI API's paths start (what an OpenAI client is given)."""
        return self.url + "/v1"


@dataclass
class RunningSim(RunningApp):
    @property
    def stats(self) -> SimStats:
        return self.app[SIM_STATS]


@asynccontextmanager
async def run_sim(**config: Any) -> AsyncIterator[RunningSim]:
    app = build_sim_app(SimConfig(**config))
    async with serving(web.AppRunner(app, handler_cancellation=True)) as url:
        yield RunningSim(url, app)


@dataclass
class RunningGateway(RunningApp):
    runner: web.AppRunner
    admin_url: str = ""

    @property
    def state(self) -> GatewayState:
        return self.app[STATE]

    @property
    def sink(self) -> MemorySink:
        sink = self.state.mirror.sink
        assert isinstance(sink, MemorySink)
        return sink

    def metric(self, name: str, **labels: str) -> float:
        value = self.state.metrics.registry.get_sample_value(name, labels)
        return 0.0 if value is None else value

    @property
    def written_records(self) -> int:
        """Score records the store writer has written, as the scoring process last reported
        (0 before its first report); the gateway must run with evaluation on."""
        scorekeeper = self.state.scorekeeper
        assert scorekeeper is not None, "this gateway runs with evaluation off"
        stats = scorekeeper.writer_stats
        return stats.written_records if stats is not None else 0


@asynccontextmanager
async def run_gateway(
    primary_url: str,
    *,
    candidates: list[dict[str, Any]] | None = None,
    sink: EvaluationSink | None = None,
    **sections: dict[str, Any],
) -> AsyncIterator[RunningGateway]:
    overrides: dict[str, Any] = {"primary": {"url": primary_url}, "server": {"port": 0}}
    for name, values in sections.items():
        overrides.setdefault(name, {}).update(values)
    if candidates is not None:
        overrides["candidates"] = candidates
    overrides.setdefault("evaluation", {}).setdefault("enabled", False)
    app = build_app(load_config(None, overrides), sink)
    runner = make_runner(app)
    async with serving(runner) as url:
        admin = make_admin_runner(app)
        async with serving(admin) as admin_url:
            yield RunningGateway(url, app, runner, admin_url + "/admin/v1")


@asynccontextmanager
async def judged_candidate(store_url: str, candidate: dict[str, Any],
                           **backend: Any) -> AsyncIterator[RunningGateway]:
    """A gateway judging the simulator ``cand`` (``backend`` and ``candidate``'s settings)
    against a primary simulator (``backend``'s) and its replica, ``replica``, the noise
    floor; scores go to ``store_url``, a metric is judged from 10 values."""
    async with run_sim(**backend) as primary, run_sim(**backend) as secondary, \
            run_sim(**{**backend, **candidate}) as cand, \
            run_gateway(primary.url, candidates=[
                {"name": "cand", "url": cand.url},
                {"name": "replica", "url": secondary.url, "role": "secondary"}],
                evaluation={"enabled": True, "store": {"url": store_url},
                            "gates": {"min_samples": 10}}) as gw:
        yield gw


HANG_S = 30.0  # a wait that only catches a hang, not a slow machine


async def eventually(condition: Callable[[], bool], within_s: float = HANG_S) -> None:
    """Wait until ``condition()`` holds; fail after ``within_s`` seconds (by default only a
    hang: a loaded CI machine takes seconds for what takes milliseconds idle)."""
    async with asyncio.timeout(within_s):
        while not condition():  # noqa: ASYNC110 - polling a plain predicate
            await asyncio.sleep(0.02)


def waiting_in(function: Callable[..., Awaitable[Any]]) -> bool:
    """Whether a task of the running loop is suspended inside ``function`` (a coroutine
    function), at any depth of its awaits: a server in this process that waits for the rest
    of a request's body waits in ``web.BaseRequest.read`` (aiohttp) or ``read_body`` (the
    gateway's front). What a test waits for where a sleep stood for "the server got there"."""
    code = function.__code__
    for task in asyncio.all_tasks():
        awaited: Any = task.get_coro()
        while awaited is not None:
            if getattr(awaited, "cr_code", None) is code:
                return True
            awaited = getattr(awaited, "cr_await", None)
    return False


async def leave_stream_after(stream: openai.AsyncStream[Any], chunks: int) -> None:
    """Read ``chunks`` chunks of ``stream``, then close it: a client that goes away mid-answer."""
    received = 0
    async for _ in stream:
        received += 1
        if received == chunks:
            break
    await stream.close()


async def timed_chats(gw: RunningGateway, n: int, tag: str) -> list[float]:
    """Send ``n`` chat requests through ``gw`` one after another; return each one's latency
    in seconds (all must succeed)."""
    client = openai.AsyncOpenAI(base_url=gw.base_url, api_key="x", max_retries=0)
    latencies = []
    try:
        for i in range(n):
            started = time.monotonic()
            await client.chat.completions.create(
                model="sim-model", messages=[{"role": "user", "content": f"{tag} {i}"}])
            latencies.append(time.monotonic() - started)
    finally:
        await client.close()
    return latencies


def kill_left_running(parent: subprocess.Popen[Any], started: list[psutil.Process]) -> list[str]:
    """After ``parent`` (a Popen) was stopped: kill it if it still runs, and kill each of
    ``started`` (its children) it left running; the command lines of those it left."""
    if parent.poll() is None:
        parent.kill()
    left = [c for c in started if c.is_running() and c.status() != psutil.STATUS_ZOMBIE]
    running = [" ".join(c.cmdline()[-6:]) for c in left]
    for child in left:
        child.kill()
    return running
