"""``gateway._app.serve``: the process's listeners, started and stopped as ``understudy serve``
runs them (real sockets)."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import sys
import time

import psutil
import pytest
from aiohttp import web

from gateway._app import serve
from gateway._config import load_config
from tests.utils import HANG_S, eventually, run_sim, waiting_in

TOKEN = "shutdown-admin-token-0123"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def _refuses(port: int) -> bool:
    """Whether nothing listens on ``port`` (a connection the listener queued when it closed
    is reset)."""
    try:
        _, probe = await asyncio.open_connection("127.0.0.1", port)
    except (ConnectionRefusedError, ConnectionResetError):
        return True
    probe.close()
    await probe.wait_closed()
    return False


async def test_an_admin_request_in_flight_holds_neither_the_proxy_nor_the_exit() -> None:
    """An admin request whose body never ends (an operator's stalled upload) held shutdown
    for aiohttp's default 60 s whatever ``shutdown_timeout_s`` said, and meanwhile the
    proxy's port kept accepting new requests. Now every listener stops accepting at once,
    and the admin API drains within ``shutdown_timeout_s`` too."""
    admin_port = _free_port()
    async with run_sim() as sim:
        config = load_config(None, {
            "primary": {"url": sim.url}, "evaluation": {"enabled": False},
            "server": {"host": "127.0.0.1", "port": 0, "shutdown_timeout_s": 0.5},
            "admin": {"port": admin_port, "token": TOKEN}})
        stop = asyncio.Event()
        ready: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        serving = asyncio.create_task(serve(config, stop=stop, on_ready=ready.set_result))
        try:
            port = await asyncio.wait_for(ready, 10)
            _, writer = await asyncio.open_connection("127.0.0.1", admin_port)
            writer.write(b"POST /admin/v1/rollback HTTP/1.1\r\nHost: x\r\nAuthorization: "
                         b"Bearer " + TOKEN.encode() + b"\r\nContent-Length: 100\r\n\r\n{")
            await writer.drain()
            await eventually(lambda: waiting_in(web.BaseRequest.read))  # the handler reads it
            stopped = time.monotonic()
            stop.set()
            # The proxy refuses while the admin request drains (its handler still waits for
            # the body), not once that is done.
            async with asyncio.timeout(HANG_S):
                while True:
                    assert waiting_in(web.BaseRequest.read), \
                        "the proxy still accepted after the stop, until the admin API drained"
                    if await _refuses(port) and waiting_in(web.BaseRequest.read):
                        break
                    await asyncio.sleep(0.02)
            async with asyncio.timeout(10):
                await serving
            assert time.monotonic() - stopped < 3, time.monotonic() - stopped
            writer.close()
        finally:
            stop.set()
            if not serving.done():
                serving.cancel()


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
async def test_a_signal_while_starting_ends_the_start_cleanly(sig: signal.Signals) -> None:
    """SIGTERM while the gateway started (reaching its store, spawning the scoring child)
    killed it by the signal, its scoring child left running; SIGINT was 'Aborted!', exit 1.
    Now the start finishes, nothing is listened on, and the process exits 0 with its child."""
    with socket.socket() as closed:  # a store at a port bound, never listening: refused
        closed.bind(("127.0.0.1", 0))
        store = f"postgresql+asyncpg://u:pw@127.0.0.1:{closed.getsockname()[1]}/db"
        port = _free_port()
        env = {name: value for name, value in os.environ.items()
               if not name.upper().startswith("UNDERSTUDY_")}  # fmt: skip
        process = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "gateway.cli", "serve", "--primary", "http://127.0.0.1:9",
            "--port", str(port), "--db", store, env=env, stderr=asyncio.subprocess.PIPE)
        assert process.stderr is not None
        lines: list[bytes] = []
        try:
            async with asyncio.timeout(60):
                # The first failed attempt at the store: inside the start (its wait for the
                # store is STORE_START_WAIT_S), before anything listens.
                while b"not ready, retrying" not in (line := await process.stderr.readline()):
                    assert line, b"".join(lines).decode()
                    lines.append(line)
                children = psutil.Process(process.pid).children(recursive=True)
                process.send_signal(sig)
                lines.append(await process.stderr.read())
                await process.wait()
        finally:
            if process.returncode is None:
                process.kill()
                await process.wait()
    output = b"".join(lines).decode()
    assert process.returncode == 0, output[-3000:]
    assert "Traceback" not in output and "leaked" not in output and "Aborted" not in output
    assert "understudy gateway on" not in output  # never listened
    _, alive = psutil.wait_procs(children, timeout=5)
    assert not alive, f"left running: {alive}"
