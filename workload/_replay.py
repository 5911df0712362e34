"""Recorded traffic sent again with its original relative timing.

The file is JSON lines, one request each, as the gateway's ``[record]`` section writes them:
``{"offset_s": 1.25, "route": "/v1/chat/completions", "session": "9f2c...", "body": {...}}``.

Rules:
1. At most ``max_requests`` records are read; a line that is not such a record (not UTF-8,
   not JSON, a string with a lone surrogate, which no request can carry, an ``offset_s``
   that is not a finite number >= 0, a ``route`` that is not a string) is an error naming
   its line number, and so is a file with no record at all: a wrong file fails loudly, not
   as an empty replay, and before anything is sent. The lines past ``max_requests`` are not
   read as records, only counted, in ``lines_past_max_requests``: records or junk, nobody
   knows, so they are not ``not_sent`` (which counts records read and then not sent). No
   line is read whole past ``MAX_RECORD_LINE_BYTES``: a longer one, wherever it is, is such
   an error.
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
   what was sent is returned. Set while the file is still checked (rule 1), it ends the check
   within ``HALT_CHECK_LINES`` lines and the replay with an empty summary: nothing was sent,
   and the records were not all counted.
6. Memory does not grow with the file: the first pass checks every line and keeps only where
   each record lies (``_Entry``: its offset, line position, route, session, depth); a
   record's body is read again from the file when its request takes a slot, so at most
   ``concurrency`` bodies are held. The file stays open for the replay: a recording moved
   aside meanwhile (a gateway's restart) is still the one read.
"""

from __future__ import annotations

import asyncio
import math
import sys
import threading
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, Final

import orjson

from workload._call import ReplayRoute, open_client, send
from workload._driver import OnTurn, result_of, settle, stopped_within
from workload._spec import ReplaySpec, TurnResult, WorkloadSummary
from workload._summary import summarize

__all__ = ["REPLAY_ROUTES", "TrafficRecord", "read_records", "replay_workload"]

MAX_RECORD_LINE_BYTES: Final = 64 * 2**20
"""A line longer than this is no record (rule 1): eight times the gateway's default
``max_body_bytes``. A file that is no recording (weights, an archive) has lines of any
length, and a line is read whole to be checked."""
HALT_CHECK_LINES: Final = 4096
"""Rule 5: the check looks at ``stop`` after this many lines."""
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


@dataclass(frozen=True, slots=True)
class _Entry:
    """Rule 6: a record checked and left in the file, ``position`` its line's first byte."""

    offset_s: float
    position: int
    number: int  # the line's, for messages
    route: str
    session: str | None
    turn: int


def read_records(path: Path, max_requests: int) -> list[TrafficRecord]:
    """Rule 1: the first ``max_requests`` records of ``path``, in offset order."""
    with path.open("rb") as fh:
        entries, _ = _index(fh, path, max_requests)
        return [_load(fh, path, entry) for entry in entries]


class _Halted(Exception):
    """Rule 5: the check ended by ``stop``."""


def _index(fh: BinaryIO, path: Path, max_requests: int,
           halt: threading.Event | None = None) -> tuple[list[_Entry], int]:
    """Rules 1, 6: where the first ``max_requests`` records of ``fh`` lie, in offset order,
    and how many non-blank lines follow them. ``halt`` set: ``_Halted`` (rule 5)."""
    entries: list[_Entry] = []
    left = 0
    position = 0
    for number, line in enumerate(iter(_line_reader(fh), b""), start=1):
        if halt is not None and number % HALT_CHECK_LINES == 0 and halt.is_set():
            raise _Halted
        at, position = position, position + len(line)
        if len(line) > MAX_RECORD_LINE_BYTES:
            raise ValueError(f"{path}:{number}: not a traffic record (a line over "
                             f"{MAX_RECORD_LINE_BYTES} bytes)")
        if not line.strip():
            continue
        if len(entries) >= max_requests:
            left += 1
            continue
        item = _parsed(line, path, number)
        session = None if item.session is None else sys.intern(item.session)
        entries.append(_Entry(item.offset_s, at, number, sys.intern(item.route), session,
                              item.turn))
    if not entries:
        raise ValueError(f"{path}: no traffic records")
    entries.sort(key=lambda e: e.offset_s)
    return entries, left


def _line_reader(fh: BinaryIO) -> Callable[[], bytes]:
    """``fh``'s next line, cut one byte past ``MAX_RECORD_LINE_BYTES`` (rule 1)."""
    return lambda: fh.readline(MAX_RECORD_LINE_BYTES + 1)


def _load(fh: BinaryIO, path: Path, entry: _Entry) -> TrafficRecord:
    """Rule 6: ``entry``'s record, read again. No await between the seek and the read: the
    one file object serves every request of the replay."""
    fh.seek(entry.position)
    return _parsed(_line_reader(fh)(), path, entry.number)


def _parsed(line: bytes, path: Path, number: int) -> TrafficRecord:
    try:  # orjson reads UTF-8 alone and refuses lone surrogates: both ValueErrors
        return _record(orjson.loads(line))
    except (ValueError, TypeError, KeyError) as exc:
        raise ValueError(f"{path}:{number}: not a traffic record ({exc})") from exc


def _record(doc: Any) -> TrafficRecord:
    if not isinstance(doc, dict) or not isinstance(doc.get("body"), dict):
        raise ValueError("expected an object with a 'body' object")
    offset_s = doc["offset_s"]
    if isinstance(offset_s, bool) or not isinstance(offset_s, int | float):
        raise TypeError(f"offset_s must be a number, got {type(offset_s).__name__}")
    session = doc.get("session")
    return TrafficRecord(float(offset_s), doc["route"], doc["body"],
                         session if isinstance(session, str) else None)


async def _checked(fh: BinaryIO, path: Path, max_requests: int, stop: asyncio.Event
                   ) -> tuple[list[_Entry], int] | None:
    """``_index`` in a thread (a large file takes seconds: not on the loop, which handles
    Ctrl-C); None when ``stop`` is set first (rule 5). The thread has ended when this
    returns, so the file may be closed."""
    halt = threading.Event()
    checking = asyncio.ensure_future(asyncio.to_thread(_index, fh, path, max_requests, halt))
    stopped = asyncio.ensure_future(stop.wait())
    try:
        await asyncio.wait((checking, stopped), return_when=asyncio.FIRST_COMPLETED)
    finally:
        stopped.cancel()
        if not checking.done():
            halt.set()
            await asyncio.wait((checking,))
    try:
        return checking.result()
    except _Halted:
        return None


async def replay_workload(path: Path, base_url: str, *, spec: ReplaySpec | None = None,
                          api_key: str | None = None, on_turn: OnTurn | None = None,
                          stop: asyncio.Event | None = None) -> WorkloadSummary:
    """Send the records of ``path`` to ``base_url`` as rules 1-5 say."""
    spec = spec or ReplaySpec()
    stop = stop or asyncio.Event()
    fh = path.open("rb")
    try:
        checked = await _checked(fh, path, spec.max_requests, stop)
        if checked is None:  # rule 5
            fh.close()
            return summarize([], 0.0)
        records, past_max_requests = checked
        client = open_client(base_url, api_key, spec.request_timeout_s)
    except BaseException:
        fh.close()
        raise
    loop = asyncio.get_running_loop()
    started = loop.time()
    results: list[TurnResult] = []
    not_sent = 0
    slots = asyncio.Semaphore(spec.concurrency)

    def record(result: TurnResult) -> None:
        results.append(result)
        if on_turn is not None:
            on_turn(result)

    async def one(index: int, item: _Entry, route: ReplayRoute) -> None:
        nonlocal not_sent
        session = item.session or f"replay-{index}"
        headers = {spec.session_header: session}
        try:
            await slots.acquire()
        except asyncio.CancelledError:
            not_sent += 1  # rules 4, 5: never sent, counted
            raise
        try:
            body = _load(fh, path, item).body  # rule 6: read when it is sent
            if spec.model is not None:
                body["model"] = spec.model
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
        first = records[0].offset_s  # _index refuses a file with none
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
        fh.close()
    planned = Counter(item.session or f"replay-{index}" for index, item in enumerate(records))
    return summarize(results, loop.time() - started, not_sent, planned,
                     lines_past_max_requests=past_max_requests)
