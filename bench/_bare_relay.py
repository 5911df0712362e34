"""A bare aiohttp relay: the floor the gateway's own work is measured against.

    python bench/_bare_relay.py --primary http://127.0.0.1:8100 --port 8081

The same stack as the gateway (aiohttp server and client, uvloop, one pooled session, the
body read once, each upstream chunk written as it arrives) and nothing else: no capture,
no metrics, no usage filter, no header policy beyond the content type. Whatever the
gateway costs above this, per chunk, is understudy's own.
"""

from __future__ import annotations

import argparse
from collections.abc import AsyncIterator

import aiohttp
import uvloop
from aiohttp import web

_SESSION = web.AppKey("session", aiohttp.ClientSession)
_PRIMARY = web.AppKey("primary", str)


async def _relay(request: web.Request) -> web.StreamResponse:
    body = await request.read()
    session = request.app[_SESSION]
    headers = {"Content-Type": request.headers.get("Content-Type", "application/json")}
    async with session.request(request.method, request.app[_PRIMARY] + request.raw_path,
                               data=body or None, headers=headers) as up:
        response = web.StreamResponse(status=up.status, headers={
            "Content-Type": up.headers.get("Content-Type", "application/octet-stream")})
        await response.prepare(request)
        while chunk := await up.content.readany():
            await response.write(chunk)
        await response.write_eof()
        return response


async def _health(request: web.Request) -> web.Response:
    return web.Response(text="ok")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--primary", required=True)
    parser.add_argument("--port", type=int, required=True)
    args = parser.parse_args()

    async def session_ctx(app: web.Application) -> AsyncIterator[None]:
        app[_SESSION] = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=1024), auto_decompress=False,
            timeout=aiohttp.ClientTimeout(total=None))
        yield
        await app[_SESSION].close()

    app = web.Application()
    app[_PRIMARY] = args.primary.rstrip("/")
    app.cleanup_ctx.append(session_ctx)
    app.router.add_get("/health", _health)
    app.router.add_route("*", "/v1/{tail:.*}", _relay)
    web.run_app(app, host="127.0.0.1", port=args.port, access_log=None, print=None,
                loop=uvloop.new_event_loop())


if __name__ == "__main__":
    main()
