"""Agentic multi-turn sessions against an OpenAI-compatible server.

Rules:
1. Sessions arrive as a Poisson process: the first at once, then gaps drawn from an
   exponential of mean ``1 / rate`` (``random.Random(seed)``). No session starts at or after
   ``duration_s``; at most ``concurrency`` run at once (a later arrival waits for a slot).
2. A session sends its turns one after another. Each turn's request is the history so far:
   the system prompt and ``tools``, the task, then per earlier turn the model's answer (with
   its tool calls, if any) and that turn's tool result — as ``tool`` messages answering the
   calls, or as a user message when the model called none.
3. Between a turn's answer and the next turn a session thinks ``think_s * (1 ± THINK_JITTER)``
   (uniform). No turn is sent at or after ``duration_s``; a session ends at its first failed
   turn (its history has no answer to continue from). Turns not sent are counted.
4. Turns still in flight ``drain_s`` after ``duration_s`` are cancelled and recorded as
   ``cancelled``. Every turn sent is reported exactly once, to ``on_turn`` and in the summary.
5. Every request carries ``session_header: <session id>``, so a gateway samples whole
   sessions (DESIGN.md invariant 5).
6. ``stop`` set (the command's Ctrl-C) ends the run early, also while the model is still being
   looked up: no session starts after it (those not started are counted as not sent), turns
   in flight are cancelled at once and recorded as ``cancelled``, and the summary of what was
   sent is returned.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from openai import AsyncOpenAI

from workload._call import Answer, open_client, send
from workload._script import SYSTEM_PROMPT, TOOLS, SessionScript
from workload._spec import MAX_SESSIONS, THINK_JITTER, TurnResult, WorkloadSpec, WorkloadSummary
from workload._summary import summarize

__all__ = ["OnTurn", "resolve_model", "run_workload", "settle", "stopped_within"]

OnTurn = Callable[[TurnResult], None]
"""Called once per turn sent, as soon as it ends (rule 4): a progress display's hook."""

NO_OUTPUT = "(no output)"

_T = TypeVar("_T")


async def resolve_model(client: AsyncOpenAI, model: str | None) -> str:
    """``model``, or the first model the server lists."""
    if model is not None:
        return model
    page = await client.models.list()
    for entry in page.data:
        return entry.id
    raise RuntimeError("the server lists no model; pass one")


async def stopped_within(stop: asyncio.Event, delay_s: float) -> bool:
    """Wait ``delay_s`` or until ``stop`` is set, whichever comes first; whether it is set."""
    if delay_s > 0 and not stop.is_set():
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), delay_s)
    return stop.is_set()


async def unless_stopped(awaitable: Awaitable[_T], stop: asyncio.Event) -> _T | None:
    """``awaitable``'s result, or None when ``stop`` is set first (it is then cancelled)."""
    task = asyncio.ensure_future(awaitable)
    stopped = asyncio.ensure_future(stop.wait())
    try:
        await asyncio.wait((task, stopped), return_when=asyncio.FIRST_COMPLETED)
    finally:
        stopped.cancel()
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
    return None if task.cancelled() else task.result()


async def settle(tasks: list[asyncio.Task[None]], timeout_s: float, stop: asyncio.Event
                 ) -> None:
    """Wait for ``tasks`` up to ``timeout_s`` or until ``stop`` is set; cancel those left
    (each records its turn as ``cancelled``) and await them all. A task's exception is a bug
    (or a failing ``on_turn``), not a server's failure: it is raised."""
    if not tasks:
        return
    all_done = asyncio.ensure_future(asyncio.wait(tasks))
    stopped = asyncio.ensure_future(stop.wait())
    try:
        await asyncio.wait((all_done, stopped), timeout=max(0.0, timeout_s),
                           return_when=asyncio.FIRST_COMPLETED)
    finally:
        all_done.cancel()
        stopped.cancel()
    for task in tasks:
        task.cancel()  # a finished one is left as it is
    for outcome in await asyncio.gather(*tasks, return_exceptions=True):
        if isinstance(outcome, Exception):
            raise outcome


async def run_workload(spec: WorkloadSpec, base_url: str, *, api_key: str | None = None,
                       on_turn: OnTurn | None = None, stop: asyncio.Event | None = None
                       ) -> WorkloadSummary:
    """Run ``spec`` against ``base_url`` (a server root or an OpenAI base URL ending in
    ``/v1``) and return its summary; ``on_turn`` sees each turn as it ends; ``stop`` ends
    the run early (rule 6)."""
    stop = stop or asyncio.Event()
    client = open_client(base_url, api_key, spec.request_timeout_s)
    try:
        async with asyncio.timeout(spec.request_timeout_s):
            model = await unless_stopped(resolve_model(client, spec.model), stop)
        if model is None:  # rule 6: stopped before the first session
            return summarize([], 0.0, spec.sessions * spec.turns)
        return await _Run(spec, client, model, on_turn, stop).run()
    finally:
        await client.close()


class _Run:
    def __init__(self, spec: WorkloadSpec, client: AsyncOpenAI, model: str,
                 on_turn: OnTurn | None, stop: asyncio.Event) -> None:
        self.spec = spec
        self.stop = stop
        self.client = client
        self.model = model
        self.on_turn = on_turn
        self.results: list[TurnResult] = []
        self.not_sent = 0
        self.planned: dict[str, int] = {}  # each session started: its turns
        self.slots = asyncio.Semaphore(spec.concurrency)
        loop = asyncio.get_running_loop()
        self.started = loop.time()
        self.deadline = self.started + spec.duration_s

    async def run(self) -> WorkloadSummary:
        spec = self.spec
        loop = asyncio.get_running_loop()
        arrivals = random.Random(spec.seed)
        tasks: list[asyncio.Task[None]] = []
        at = 0.0
        for index in range(spec.sessions):  # rule 1
            if index:
                at += arrivals.expovariate(spec.rate)
            if (at >= spec.duration_s
                    or await stopped_within(self.stop, self.started + at - loop.time())):
                self.not_sent += (spec.sessions - index) * spec.turns  # rules 1, 6
                break
            self.planned[self._name(index)] = spec.turns
            tasks.append(asyncio.create_task(self._session(index), name=f"load-session-{index}"))
        try:
            await settle(tasks, self.deadline + spec.drain_s - loop.time(), self.stop)  # rule 4
        finally:
            for task in tasks:
                task.cancel()
        return summarize(self.results, loop.time() - self.started, self.not_sent, self.planned)

    def _name(self, index: int) -> str:
        return f"{self.spec.session_prefix}-{self.spec.seed}-{index:05d}"

    async def _session(self, index: int) -> None:
        spec = self.spec
        name = self._name(index)
        script = SessionScript.draw(name, spec.seed * MAX_SESSIONS + index, turns=spec.turns,
                                    tool_tokens=spec.tool_tokens,
                                    context_tokens=spec.context_tokens)
        think = random.Random(f"{spec.seed}:{index}:think")
        messages: list[dict[str, Any]] = [
            {"role": "system", "content": SYSTEM_PROMPT},
            {"role": "user", "content": script.task},
        ]
        loop = asyncio.get_running_loop()
        sent = 0
        try:
            async with self.slots:
                for turn in range(spec.turns):
                    if loop.time() >= self.deadline:  # rule 3
                        return
                    sent += 1
                    answer = await self._turn(name, turn, messages)
                    if answer.error is not None or turn + 1 == spec.turns:
                        return
                    messages += _next_messages(answer, script.tool_results[turn], name, turn)
                    pause = spec.think_s * think.uniform(1 - THINK_JITTER, 1 + THINK_JITTER)
                    if loop.time() + pause >= self.deadline:
                        return
                    await asyncio.sleep(pause)
        finally:
            # Rules 3, 4, 6: every turn is sent or counted, also those of a session cancelled
            # while it waited for a slot or thought.
            self.not_sent += spec.turns - sent

    async def _turn(self, session: str, turn: int, messages: list[dict[str, Any]]) -> Answer:
        spec = self.spec
        body: dict[str, Any] = {
            "model": self.model, "messages": list(messages), "max_tokens": spec.max_tokens,
            "temperature": spec.temperature, "stream": spec.stream,
        }
        if spec.stream:
            body["stream_options"] = {"include_usage": True}
        if spec.tool_choice != "omit":
            body["tools"] = list(TOOLS)
            body["tool_choice"] = spec.tool_choice
        loop = asyncio.get_running_loop()
        started_s = loop.time() - self.started
        headers = {spec.session_header: session}
        try:
            answer = await send(self.client, "chat_completions", body, headers,
                                spec.request_timeout_s)
        except asyncio.CancelledError:
            self._record(TurnResult(session, turn, started_s, None,
                                    loop.time() - self.started - started_s, error="cancelled"))
            raise
        self._record(result_of(answer, session, turn, started_s))
        return answer

    def _record(self, result: TurnResult) -> None:
        self.results.append(result)
        if self.on_turn is not None:
            self.on_turn(result)


def result_of(answer: Answer, session: str, turn: int, started_s: float) -> TurnResult:
    return TurnResult(session, turn, started_s, answer.ttft_s, answer.e2e_s,
                      prompt_tokens=answer.prompt_tokens,
                      completion_tokens=answer.completion_tokens,
                      cached_tokens=answer.cached_tokens, tool_calls=len(answer.tool_calls),
                      error=answer.error)


def _next_messages(answer: Answer, tool_result: str, session: str, turn: int
                   ) -> list[dict[str, Any]]:
    """Rule 2: the model's answer, then the tool result as the answer's calls expect it."""
    assistant: dict[str, Any] = {"role": "assistant", "content": answer.content}
    if not answer.tool_calls:
        return [assistant, {"role": "user", "content": tool_result}]
    calls = [
        {**call, "id": call.get("id") or f"call-{session}-{turn}-{i}"}
        for i, call in enumerate(answer.tool_calls)
    ]
    assistant["tool_calls"] = calls
    out = [assistant]
    for i, call in enumerate(calls):
        out.append({"role": "tool", "tool_call_id": call["id"],
                    "content": tool_result if i == 0 else NO_OUTPUT})
    return out
