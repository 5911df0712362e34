"""One engine stepped by one worker thread, feeding the request handlers of an event loop.

Rules
-----
1. Only the worker thread touches the ``Engine``.  Handlers, on the event loop, post commands
   (add, abort) to an inbox under a lock; the thread applies them between two steps, so a new
   request joins the running batch at the next step and an aborted one leaves it there.
2. The thread steps while the engine has unfinished requests and sleeps on an event otherwise.
   numpy releases the GIL inside its products, so the event loop keeps serving during a step.
3. After each step the thread hands that step's events to the event loop in ONE
   ``call_soon_threadsafe``; there each request's tokens go to its own asyncio queue (one item
   per step, so a queue holds at most ``max_tokens`` items) and the metrics are observed.
   Events of a request whose handler already left are dropped.
4. Admission is bounded: at most ``capacity`` requests are in flight (submitted, not finished,
   not released).  One more is refused with ``EngineOverloaded`` -- at once, never queued --
   and counted (``understudy_engine_requests_refused_total{reason="overloaded"}``).
5. A handler always releases its request when it is done with it; one that did not finish
   (client gone, stop string matched, shutdown) is aborted in the engine, so the engine never
   keeps computing for nobody.  A request its handler ended on a stop string is counted as
   vLLM counts it, finished by ``stop`` with its end-to-end latency, not as aborted.
6. A step that raises kills the loop: every in-flight request gets ``EngineFailed``, new ones
   are refused with it, and ``alive`` turns false (``/health`` reports it).
7. Other work on the engine (importing or exporting KV blocks) goes through ``call``: the
   function runs on the worker thread between two steps, in order with adds and aborts, and
   its result (or exception) resolves the caller's future.  A call pending when the loop stops
   or fails gets ``EngineStopped`` / ``EngineFailed``.
"""

from __future__ import annotations

import asyncio
import enum
import itertools
import logging
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from backends.openai_wire import error_body

from ..model._sampling import SamplingParams
from ._engine import Engine
from ._metrics import EngineMetrics
from ._request import EngineStats, TokenEvent

__all__ = [
    "EngineFailed",
    "EngineLoop",
    "EngineOverloaded",
    "EngineRejected",
    "EngineServerError",
    "EngineStopped",
    "RequestHandle",
]

log = logging.getLogger(__name__)

T = TypeVar("T")


class EngineServerError(Exception):
    """Why the engine did not answer a request; ``status`` is the HTTP status it becomes.

    EngineServerError
    ├── EngineRejected    400  the engine refused the request (e.g. it can never fit the pool)
    ├── EngineOverloaded  503  too many requests in flight
    ├── EngineStopped     503  the server is shutting down
    └── EngineFailed      500  a step raised; the engine is dead
    """

    status = 500
    err_type = "InternalServerError"

    def body(self) -> dict[str, Any]:
        """The OpenAI error body this error is answered with."""
        return error_body(str(self), status=self.status, err_type=self.err_type)


class EngineRejected(EngineServerError):
    status = 400
    err_type = "BadRequestError"


class EngineOverloaded(EngineServerError):
    status = 503
    err_type = "ServiceUnavailableError"


class EngineStopped(EngineServerError):
    status = 503
    err_type = "ServiceUnavailableError"


class EngineFailed(EngineServerError):
    pass


class _State(enum.Enum):
    CREATED = "created"
    RUNNING = "running"
    STOPPED = "stopped"
    FAILED = "failed"


@dataclass(slots=True, eq=False)
class RequestHandle:
    """The event-loop side of one request: the queue its tokens arrive on, its timings."""

    engine_id: str
    arrived_at: float
    queue: asyncio.Queue[list[TokenEvent] | EngineServerError] = field(
        default_factory=asyncio.Queue
    )
    first_token_at: float | None = None
    last_token_at: float | None = None
    finished: bool = False


@dataclass(frozen=True, slots=True)
class _Add:
    engine_id: str
    prompt: tuple[int, ...]
    params: SamplingParams
    retain_kv_s: float | None = None
    cache_salt: str | None = None


@dataclass(frozen=True, slots=True)
class _Call:
    function: Callable[[Engine], Any]
    future: asyncio.Future[Any]


@dataclass(frozen=True, slots=True)
class _Abort:
    engine_id: str


class EngineLoop:
    """Continuous batching over one engine for the handlers of one event loop."""

    def __init__(self, engine: Engine, metrics: EngineMetrics, *, capacity: int) -> None:
        if capacity < 1:
            raise ValueError("capacity must be >= 1")
        self.engine = engine
        self.capacity = capacity
        self._metrics = metrics
        self._lock = threading.Lock()
        self._inbox: list[_Add | _Abort | _Call] = []
        self._calls: set[asyncio.Future[Any]] = set()
        self._wake = threading.Event()
        self._stopping = False
        self._handles: dict[str, RequestHandle] = {}
        self._ids = itertools.count()
        self._state = _State.CREATED
        self._failure: str | None = None
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    # -- lifecycle (event loop) -------------------------------------------------------------

    def start(self) -> None:
        if self._state is not _State.CREATED:
            raise RuntimeError(f"an engine loop starts once; it is {self._state.value}")
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self._state = _State.RUNNING
        self._thread.start()

    async def stop(self, timeout_s: float) -> None:
        """Refuse new requests, end in-flight ones, and wait for the thread (at most
        ``timeout_s``: a long prefill step cannot be interrupted)."""
        if self._state is _State.RUNNING:
            self._state = _State.STOPPED
        for handle in self._handles.values():
            handle.finished = True
            self._metrics.finished("abort")
            handle.queue.put_nowait(EngineStopped("The server is shutting down."))
        self._handles.clear()
        self._settle_calls(EngineStopped("The server is shutting down."))
        with self._lock:
            self._stopping = True
            self._wake.set()
        thread = self._thread
        if thread is not None and thread.is_alive():
            await asyncio.to_thread(thread.join, timeout_s)
            if thread.is_alive():
                log.warning("engine loop still in a step after %.1f s; left behind", timeout_s)

    @property
    def alive(self) -> bool:
        return self._state is _State.RUNNING

    @property
    def num_in_flight(self) -> int:
        return len(self._handles)

    # -- requests (event loop) --------------------------------------------------------------

    def submit(
        self,
        prompt: Sequence[int],
        params: SamplingParams,
        *,
        arrived_at: float,
        retain_kv_s: float | None = None,
        cache_salt: str | None = None,
    ) -> RequestHandle:
        """Queue a request for the next step; raise if the loop cannot take it now."""
        self._check_running()
        if len(self._handles) >= self.capacity:
            self._metrics.refused("overloaded")
            raise EngineOverloaded(
                f"The server is at capacity ({self.capacity} requests in flight); retry later."
            )
        handle = RequestHandle(engine_id=f"req-{next(self._ids)}", arrived_at=arrived_at)
        self._handles[handle.engine_id] = handle
        self._post(_Add(handle.engine_id, tuple(prompt), params, retain_kv_s, cache_salt))
        return handle

    async def call(self, function: Callable[[Engine], T]) -> T:
        """Run ``function(engine)`` on the worker thread between two steps (rule 7)."""
        self._check_running()
        future: asyncio.Future[T] = asyncio.get_running_loop().create_future()
        self._calls.add(future)
        self._post(_Call(function, future))
        try:
            return await future
        finally:
            self._calls.discard(future)

    def _check_running(self) -> None:
        if self._state is _State.FAILED:
            self._metrics.refused("failed")
            raise EngineFailed(self._failure or "The engine failed.")
        if self._state is not _State.RUNNING:
            self._metrics.refused("stopped")
            raise EngineStopped("The engine is not running.")

    def release(self, handle: RequestHandle, *, stopped: bool = False) -> None:
        """The handler is done with ``handle``; abort it in the engine if it did not finish.
        ``stopped``: the handler ended the answer on a stop string (rule 5)."""
        if handle.finished:
            return
        handle.finished = True
        if self._handles.pop(handle.engine_id, None) is not None:
            if stopped:
                loop = self._loop
                assert loop is not None
                self._metrics.e2e.observe(loop.time() - handle.arrived_at)
            self._metrics.finished("stop" if stopped else "abort")
            self._post(_Abort(handle.engine_id))

    def _post(self, command: _Add | _Abort | _Call) -> None:
        with self._lock:
            self._inbox.append(command)
            self._wake.set()

    # -- delivery (event loop) --------------------------------------------------------------

    def _deliver(
        self, events: list[TokenEvent], rejected: list[tuple[str, str]], stats: EngineStats
    ) -> None:
        loop = self._loop
        assert loop is not None
        now = loop.time()
        batches: dict[str, list[TokenEvent]] = {}
        for event in events:
            batches.setdefault(event.request_id, []).append(event)
        metrics = self._metrics
        for engine_id, batch in batches.items():
            handle = self._handles.get(engine_id)
            if handle is None:
                continue  # released while the step ran
            if handle.last_token_at is None:
                handle.first_token_at = now
                metrics.ttft.observe(now - handle.arrived_at)
                metrics.prompt_tokens.inc(batch[0].num_prompt_tokens)
            else:
                metrics.itl.observe(now - handle.last_token_at)
            for _ in batch[1:]:  # several tokens of one step (verified drafts)
                metrics.itl.observe(0.0)
            handle.last_token_at = now
            metrics.generation_tokens.inc(len(batch))
            last = batch[-1]
            if last.finish_reason is not None:
                handle.finished = True
                del self._handles[engine_id]
                metrics.e2e.observe(now - handle.arrived_at)
                metrics.finished(last.finish_reason)
            handle.queue.put_nowait(batch)
        for engine_id, message in rejected:
            handle = self._handles.pop(engine_id, None)
            if handle is not None:
                handle.finished = True
                metrics.finished("error")
                handle.queue.put_nowait(EngineRejected(message))
        metrics.observe_stats(stats)

    def _fail(self, message: str) -> None:
        if self._state is _State.RUNNING:
            self._state = _State.FAILED
        self._failure = message
        for handle in self._handles.values():
            handle.finished = True
            self._metrics.finished("error")
            handle.queue.put_nowait(EngineFailed(message))
        self._handles.clear()
        self._settle_calls(EngineFailed(message))

    def _settle_calls(self, error: EngineServerError) -> None:
        for future in self._calls:
            if not future.done():
                future.set_exception(error)
        self._calls.clear()

    @staticmethod
    def _resolve(future: asyncio.Future[Any], result: Any, error: BaseException | None) -> None:
        if future.done():
            return  # the caller was cancelled, or the loop stopped first
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)

    # -- the worker thread ------------------------------------------------------------------

    def _run(self) -> None:
        engine = self.engine
        try:
            while True:
                with self._lock:
                    commands, self._inbox = self._inbox, []
                    if self._stopping:
                        return
                    if not commands:
                        self._wake.clear()
                rejected: list[tuple[str, str]] = []
                for command in commands:
                    if isinstance(command, _Abort):
                        engine.abort(command.engine_id)
                    elif isinstance(command, _Call):
                        self._run_call(command)
                    else:
                        try:
                            engine.add_request(
                                command.engine_id,
                                command.prompt,
                                command.params,
                                retain_kv_s=command.retain_kv_s,
                                cache_salt=command.cache_salt,
                            )
                        except ValueError as exc:
                            rejected.append((command.engine_id, str(exc)))
                if not engine.has_unfinished_requests():
                    if commands and not self._hand_over([], rejected, engine.stats()):
                        return
                    self._wake.wait()
                    continue
                events = engine.step()
                if not self._hand_over(events, rejected, engine.stats()):
                    return
        except Exception as exc:
            log.exception("engine step failed")
            loop = self._loop
            assert loop is not None
            message = f"The engine failed: {type(exc).__name__}: {exc}"
            try:
                loop.call_soon_threadsafe(self._fail, message)
            except RuntimeError:
                pass  # the event loop is closed

    def _run_call(self, call: _Call) -> None:
        loop = self._loop
        assert loop is not None
        result: Any = None
        error: BaseException | None = None
        try:
            result = call.function(self.engine)
        except Exception as exc:  # the caller's to handle; the engine is unharmed
            error = exc
        try:
            loop.call_soon_threadsafe(self._resolve, call.future, result, error)
        except RuntimeError:
            pass  # the event loop is closed

    def _hand_over(
        self, events: list[TokenEvent], rejected: list[tuple[str, str]], stats: EngineStats
    ) -> bool:
        """Pass one step's results to the event loop; False once that loop is closed."""
        loop = self._loop
        assert loop is not None
        try:
            loop.call_soon_threadsafe(self._deliver, events, rejected, stats)
        except RuntimeError:
            return False
        return True
