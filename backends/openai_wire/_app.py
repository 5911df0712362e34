"""What every server of vLLM's OpenAI API adds to its aiohttp app, and serving one on a socket.

- ``install_openai_app``: the FastAPI-style error middleware (an unknown route or method is
  ``{"detail": ...}``, a bug a JSON error with status 500, as vLLM's exception handler
  answers; a body past the app's ``client_max_size`` a JSON 413, one aiohttp cannot read (a
  false Content-Encoding) a JSON 400, a client gone mid-body nothing, and no traceback for
  any of these), ``GET /v1/models`` for the one served model and ``GET /version``
  (``{"version": ...}``, the server's own release).
- ``serve_app``: an app on a real socket until the block exits; in-flight answers get
  ``SHUTDOWN_TIMEOUT_S`` to finish at shutdown.
- ``serve_until_signalled``: the command line's loop (uvloop where installed) around a running
  server, until SIGINT or SIGTERM.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import time
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, AsyncExitStack, asynccontextmanager
from dataclasses import dataclass
from typing import TypeVar

import uvloop
from aiohttp import web
from aiohttp.typedefs import Handler
from aiohttp.web import RequestPayloadError

from ._answer import ID_HEX_DIGITS, client_left, json_response
from ._bodies import model_list
from ._errors import error_body

__all__ = [
    "SERVED_MODEL",
    "SERVER_VERSION",
    "SHUTDOWN_TIMEOUT_S",
    "ServedApp",
    "ServedModel",
    "install_openai_app",
    "serve_app",
    "serve_until_signalled",
]

log = logging.getLogger(__name__)

# In-flight answers get this long to finish at shutdown.
SHUTDOWN_TIMEOUT_S = 5.0
_STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


@dataclass(frozen=True, slots=True)
class ServedModel:
    """The model a server answers for, as ``/v1/models`` lists it."""

    name: str
    # The context window: a number, or a function that tells it at each request (a router's,
    # which learns its nodes' windows once it runs).
    max_model_len: int | Callable[[], int]
    # When the model card was made; None: at each request, as vLLM does.
    created: int | None = None

    def window(self) -> int:
        """The context window as of now."""
        limit = self.max_model_len
        return limit if isinstance(limit, int) else limit()


SERVED_MODEL = web.AppKey("served_model", ServedModel)
SERVER_VERSION = web.AppKey("server_version", str)


def install_openai_app(app: web.Application, model: ServedModel, *, version: str) -> None:
    """The error middleware, ``GET /v1/models`` for ``model`` and ``GET /version``, which
    answers ``version`` as vLLM answers its own."""
    app[SERVED_MODEL] = model
    app[SERVER_VERSION] = version
    app.middlewares.append(_fastapi_style_errors)
    app.router.add_get("/v1/models", _models)
    app.router.add_get("/version", _version)


@web.middleware
async def _fastapi_style_errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except (web.HTTPNotFound, web.HTTPMethodNotAllowed) as exc:
        headers = {"Allow": exc.headers["Allow"]} if "Allow" in exc.headers else None
        response = json_response({"detail": exc.reason}, exc.status)
        if headers is not None:
            response.headers.update(headers)
        return response
    except web.HTTPRequestEntityTooLarge as exc:
        return json_response(error_body(exc.text or exc.reason, status=exc.status), exc.status)
    except web.HTTPException:
        raise
    except RequestPayloadError as exc:
        # A body aiohttp cannot read: a Content-Encoding it cannot decode, a broken chunk.
        message = f"The request body could not be read: {' '.join(str(exc).split())}"
        # The rest cannot be read either: end the body, or aiohttp reads on to drain it after
        # the answer, meets the same error and logs it; and close the connection after it.
        request.content.feed_eof()
        response = json_response(error_body(message, status=400), 400)
        response.force_close()
        return response
    except Exception as exc:
        if isinstance(exc, ConnectionResetError) and client_left(request):
            return web.Response()  # the client left (mid-body, mid-answer): nobody to tell
        log.exception("unexpected error answering %s %s", request.method, request.path)
        return json_response(error_body(f"{type(exc).__name__}: {exc}", status=500), 500)


async def _models(request: web.Request) -> web.StreamResponse:
    model = request.app[SERVED_MODEL]
    return json_response(
        model_list(
            model=model.name,
            created=int(time.time()) if model.created is None else model.created,
            max_model_len=model.window(),
            permission_id=f"modelperm-{uuid.uuid4().hex[:ID_HEX_DIGITS]}",
        )
    )


async def _version(request: web.Request) -> web.StreamResponse:
    return json_response({"version": request.app[SERVER_VERSION]})


@dataclass(frozen=True, slots=True)
class ServedApp:
    """A started server: where it listens and its app."""

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


@asynccontextmanager
async def serve_app(
    app: web.Application, host: str, port: int, *, handler_cancellation: bool = False
) -> AsyncIterator[ServedApp]:
    """Serve ``app`` on ``host`` and ``port`` (0 picks a free one) until the block exits."""
    runner = web.AppRunner(
        app,
        handle_signals=False,
        handler_cancellation=handler_cancellation,
        shutdown_timeout=SHUTDOWN_TIMEOUT_S,
    )
    await runner.setup()
    try:
        site = web.TCPSite(runner, host, port)
        await site.start()
        bound_host, bound_port = runner.addresses[0][:2]
        yield ServedApp(app=app, host=str(bound_host), port=int(bound_port))
    finally:
        await runner.cleanup()


Served = TypeVar("Served", bound=ServedApp)


def serve_until_signalled(
    server: Callable[[], AbstractAsyncContextManager[Served]], describe: Callable[[Served], str]
) -> None:
    """Run ``server()`` until SIGINT or SIGTERM, printing ``describe(server)`` once it listens.
    A server that cannot listen (its port in use, an address not this host's) ends the command
    with one line and exit status 1, not a traceback."""
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        refused = runner.run(_serve_until_signalled(server, describe))
    if refused is not None:
        raise SystemExit(f"Error: cannot serve: {refused}")


async def _serve_until_signalled(
    server: Callable[[], AbstractAsyncContextManager[Served]], describe: Callable[[Served], str]
) -> OSError | None:
    """Serve until stopped; the error of a server that could not start listening, or None."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in _STOP_SIGNALS:
        loop.add_signal_handler(signum, stop.set)
    try:
        async with AsyncExitStack() as stack:
            try:
                served = await stack.enter_async_context(server())
            except OSError as exc:
                return exc
            print(describe(served), flush=True)
            await stop.wait()
        return None
    finally:
        for signum in _STOP_SIGNALS:
            loop.remove_signal_handler(signum)
