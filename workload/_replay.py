"""Recorded traffic sent again with its original relative timing.

The file is JSON lines, one request each, as the gateway's ``[record]`` section writes them:
``{"offset_s": 1.25, "route": "/v1/chat/completions", "session": "9f2c...", "body": {...}}``.

Rules:
1. At most ``max_requests`` records are read; a line that is not such a record (not UTF-8,
   not JSON, an ``offset_s`` that is not a finite number >= 0, a ``route`` that is not a
   string) is an error naming its line number, and so is a file with no record at all: a
   wrong file fails loudly, not as an empty replay. The lines past ``max_requests`` are not
   read as records, only counted, in ``not_sent``.
2. Records are sent in offset order, each at ``(offset_s - first offset) / speed`` after the
   replay began, whatever the answers' speed: an open loop, as production is. At most
   ``concurrency`` are in flight; a record whose send time is at or past ``duration_s`` is
   not sent, nor one on a route this client cannot send (both counted in ``not_sent``).
3. A record's session key goes out in ``session_header``, so a gateway samples the replayed
   sessions as it sampled the recorded ones. Its turn depth is the assistant messages in
   its body.
4. Requests still in flight ``drain_s`` after the last send time are cancelled and recorded
   as ``cancelled``; those still waiting for a slot then are counted as not sent.
5. ``stop`` set (the command's Ctrl-C) ends the replay early: records not yet sent are counted
   as not sent, requests in flight are cancelled at once (``cancelled``), and the summary of
   what was sent is returned.
"""

from __future__ import annotations

import asyncio
import json
import math
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from workload._call import ReplayRoute, open_client, send
from workload._driver import OnTurn, result_of, settle, stopped_within
from workload._spec import ReplaySpec, TurnResult, WorkloadSummary
from workload._summary import summarize

__all__ = ["REPLAY_ROUTES", "TrafficRecord", "read_records", "replay_workload"]

REPLAY_ROUTES: Final[dict[str, ReplayRoute]] = {
    "/v1/chat/completions": "chat_completions",
    "/v1/completions": "completions",
    "/v1/embeddings": "embeddings",
}


@dataclass(frozen=True, slots=True)
class TrafficRecord:
    offset_s: float
    route: str
    body: dict[str, Any]
    session: str | None = None

    def __post_init__(self) -> None:
        if not (math.isfinite(self.offset_s) and self.offset_s >= 0):
            raise ValueError(f"offset_s must be a finite number >= 0, got {self.offset_s}")
        if not isinstance(self.route, str):
            raise TypeError(f"route must be a string, got {type(self.route).__name__}")

    @property
    def turn(self) -> int:
        messages = self.body.get("messages")
        if not isinstance(messages, list):
            return 0
        return sum(1 for m in messages if isinstance(m, dict) and m.get("role") == "assistant")


def read_records(path: Path, max_requests: int) -> list[TrafficRecord]:
    """Rule 1: the first ``max_requests`` records of ``path``, in offset order."""
    return _read(path, max_requests)[0]


def _read(path: Path, max_requests: int) -> tuple[list[TrafficRecord], int]:
    """Rule 1: the first ``max_requests`` records of ``path`` in offset order, and how many
    non-blank lines follow them."""
    records: list[TrafficRecord] = []
    left = 0
    with path.open("rb") as fh:
        for number, line in enumerate(fh, start=1):
            if not line.strip():
                continue
            if len(records) >= max_requests:
                left += 1
                continue
            try:  # json.loads decodes the bytes: not UTF-8 is a ValueError too
                records.append(_record(json.loads(line)))
            except (ValueError, TypeError, KeyError) as exc:
                raise ValueError(f"{path}:{number}: not a traffic record ({exc})") from exc
    if not records:
        raise ValueError(f"{path}: no traffic records")
    records.sort(key=lambda r: r.offset_s)
    return records, left


def _record(doc: Any) -> TrafficRecord:
    if not isinstance(doc, dict) or not isinstance(doc.get("body"), dict):
        raise ValueError("expected an object with a 'body' object")
    session = doc.get("session")
    return TrafficRecord(float(doc["offset_s"]), doc["route"], doc["body"],
                         session if isinstance(session, str) else None)


async def replay_workload(path: Path, base_url: str, *, spec: ReplaySpec | None = None,
                          api_key: str | None = None, on_turn: OnTurn | None = None,
                          stop: asyncio.Event | None = None) -> WorkloadSummary:
    """Send the records of ``path`` to ``base_url`` as rules 1-5 say."""
    spec = spec or ReplaySpec()
    stop = stop or asyncio.Event()
    records, not_sent = _read(path, spec.max_requests)
    client = open_client(base_url, api_key, spec.request_timeout_s)
    loop = asyncio.get_running_loop()
    started = loop.time()
    results: list[TurnResult] = []
    slots = asyncio.Semaphore(spec.concurrency)

    def record(result: TurnResult) -> None:
        results.append(result)
        if on_turn is not None:
            on_turn(result)

    async def one(index: int, item: TrafficRecord, route: ReplayRoute) -> None:
        nonlocal not_sent
        body = dict(item.body)
        if spec.model is not None:
            body["model"] = spec.model
        session = item.session or f"replay-{index}"
        headers = {spec.session_header: session}
        try:
            await slots.acquire()
        except asyncio.CancelledError:
            not_sent += 1  # rules 4, 5: never sent, counted
            raise
        try:
            started_s = loop.time() - started
            try:
                answer = await send(client, route, body, headers, spec.request_timeout_s)
            except asyncio.CancelledError:
                record(TurnResult(session, item.turn, started_s, None,
                                  loop.time() - started - started_s, error="cancelled"))
                raise
        finally:
            slots.release()
        record(result_of(answer, session, item.turn, started_s))

    tasks: list[asyncio.Task[None]] = []
    try:
        first = records[0].offset_s  # read_records refuses a file with none
        last_at = 0.0
        for index, item in enumerate(records):  # rule 2
            at = (item.offset_s - first) / spec.speed
            route = REPLAY_ROUTES.get(item.route)
            if at >= spec.duration_s or route is None:
                not_sent += 1
                continue
            if await stopped_within(stop, started + at - loop.time()):
                not_sent += len(records) - index  # rule 5
                break
            last_at = at
            tasks.append(asyncio.create_task(one(index, item, route)))
        await settle(tasks, started + last_at + spec.drain_s - loop.time(), stop)  # rule 4
    finally:
        for task in tasks:
            task.cancel()
        await client.close()
    planned = Counter(item.session or f"replay-{index}" for index, item in enumerate(records))
    return summarize(results, loop.time() - started, not_sent, planned)
