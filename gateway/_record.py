"""Recording a sample of the traffic to a JSON-lines file, for ``understudy load --replay``.

Each line: ``{"offset_s": 1.25, "route": "/v1/chat/completions", "session": "<pseudonym>",
"body": {...}}``, ``offset_s`` in seconds since the recording began.

Rules:
1. Off unless ``[record] path`` is set. Requests on the replayable routes (chat/completions,
   completions, embeddings) that reach the mirror are sampled by session key
   (``sampled("record", session, sample_rate)``), so a recorded conversation is whole.
   Requests the canary serves do not reach the mirror and are not recorded.
2. The hot path only appends (time, path, body, session) to a bounded queue of
   ``queue_items`` items and ``queue_bytes`` body bytes; when full the request is dropped
   and counted (``understudy_record_dropped{reason="queue_full"}``). Nothing is awaited.
3. A writer task parses, redacts and writes in a worker thread, in batches, off the loop.
4. No header is ever written. The route is the path without its query (a query may carry
   a key). The session key and the body's identifiers (``IDENTIFIERS``: ``user``, its
   successor ``safety_identifier``, ``prompt_cache_key``, vLLM's ``cache_salt`` and
   ``request_id``) are written as keyed hashes under a key drawn at start, never raw (a
   ``user`` is often an e-mail address, a cache salt a tenant's secret): stable within one
   file, so equal values stay equal for the replay, meaningless outside it. The file is
   created readable by its owner only (0600), whatever the umask.
5. Message contents, tool-call arguments, completion prompts and embedding inputs are
   written only with ``prompts = true``; otherwise each of their texts is replaced by filler
   of the same length (so a replay keeps the prompt sizes) and token ids by zeros; a tool
   call's ``arguments`` by a JSON object of the same length, since a server parses them
   (vLLM ``json.loads`` them for the chat template and fails the request otherwise). Only
   the fields named in ``PARAMETERS`` (the model, tool definitions, sampling and output
   parameters) are written as sent: every other field is redacted the same way, so a text
   outside the messages (a completion's ``suffix``, a ``prediction``, ``metadata``, vLLM's
   ``documents``, a field no one listed yet) is not written either.
6. The file holds at most ``max_bytes``: a line that would pass the bound is not written,
   counted as ``max_bytes``. A recording is never overwritten nor deleted: at start a
   non-empty file at ``path`` is moved to ``<path>.1`` after the ones kept before have each
   moved one number up (``.1`` to ``.2``, ...), as logrotate numbers them, so ``.1`` is
   always the previous run. Only the unbroken run ``.1`` .. ``.n`` moves, highest first, each
   to a name nothing has: a gap (one removed by hand) ends it, and a start that fails half-way
   has lost nothing. A path that is a directory is refused at start (never moved).
7. Stopping: the writer gets ``drain_timeout_s`` to write what is queued; what is left is
   counted as ``shutdown``; then the file is closed. A batch the worker thread still holds
   then is counted by that thread when it ends: written if it got the file first, else
   ``shutdown``.
8. The file holds whole lines only. It is unbuffered; a batch is written whole (a short write
   is continued) or, when the write fails (disk full, file too large), the file is cut back to
   its last whole line and the batch is counted as ``write_error``: half a line would make
   ``--replay`` refuse the whole file, and nothing is left in a buffer to fail again at close.
   A failing file is logged once, at WARNING, until a write succeeds again.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import os
import threading
import time
from collections import Counter, deque
from dataclasses import dataclass
from io import FileIO
from pathlib import Path
from typing import Any, Final

import orjson

from gateway._config import RecordConfig
from gateway._metrics import GatewayMetrics, RecordDropReason, Route
from gateway._sampler import sampled

__all__ = ["IDENTIFIERS", "PARAMETERS", "RECORDED_ROUTES", "TrafficRecorder", "redact"]

log = logging.getLogger("understudy.record")

RECORDED_ROUTES: Final[frozenset[Route]] = frozenset(
    {"chat_completions", "completions", "embeddings"})
WRITE_BATCH: Final = 256
"""Lines parsed and written per trip to the worker thread, at most."""
FILLER: Final = (
    "lorem ipsum dolor sit amet consectetur adipiscing elit sed do eiusmod tempor "
    "incididunt ut labore et dolore magna aliqua ut enim ad minim veniam quis nostrud "
)
PARAMETERS: Final = frozenset({
    # what is asked, and how it is answered (OpenAI's chat, completion and embedding fields)
    "model", "stream", "stream_options", "n", "tools", "tool_choice", "parallel_tool_calls",
    "functions", "function_call", "response_format", "modalities", "audio",
    "encoding_format", "dimensions", "echo", "store", "service_tier",
    # sampling (OpenAI's, then vLLM's extra ones)
    "max_tokens", "max_completion_tokens", "temperature", "top_p", "seed", "stop",
    "frequency_penalty", "presence_penalty", "logit_bias", "logprobs", "top_logprobs",
    "reasoning_effort", "verbosity", "best_of", "use_beam_search", "top_k", "min_p",
    "repetition_penalty", "length_penalty", "stop_token_ids", "include_stop_str_in_output",
    "ignore_eos", "min_tokens", "skip_special_tokens", "spaces_between_special_tokens",
    "truncate_prompt_tokens", "prompt_logprobs", "allowed_token_ids", "bad_words",
    "include_reasoning", "priority", "return_tokens_as_token_ids", "return_token_ids",
    # vLLM's prompt rendering and structured output: the operator's template and schemas,
    # like the tool definitions, not the conversation
    "add_generation_prompt", "continue_final_message", "add_special_tokens", "chat_template",
    "chat_template_kwargs", "mm_processor_kwargs", "structured_outputs", "guided_json",
    "guided_regex", "guided_choice", "guided_grammar", "guided_decoding_backend",
    "guided_whitespace_pattern", "structural_tag", "kv_transfer_params", "vllm_xargs",
    "normalize", "embed_dtype",
})
"""Body fields written as sent when prompts are redacted (rule 5); any other is redacted."""
IDENTIFIERS: Final = frozenset({
    "user", "safety_identifier", "prompt_cache_key", "cache_salt", "request_id"})
"""Body fields that name a person, a tenant or a request: written as pseudonyms (rule 4)."""
_KEPT_KEYS: Final = frozenset({"role", "type", "id", "tool_call_id"})
"""Message fields that are structure, not text, and stay as sent (rule 5)."""
_SAMPLER_NAME: Final = "record"


def _owner_only(path: str, flags: int) -> int:
    """Rule 4: a new recording is made readable by its owner only (mode 0600)."""
    return os.open(path, flags, 0o600)


def _filler(length: int) -> str:
    return (FILLER * (length // len(FILLER) + 1))[:length]


def _filler_arguments(length: int) -> str:
    """Rule 5: a JSON object of ``length`` characters (at least ``{}``)."""
    if length < len('{"_":""}'):
        return "{}".ljust(length)
    return '{"_":"' + _filler(length - len('{"_":""}')) + '"}'


def _redacted(value: Any, key: str = "") -> Any:
    if key in _KEPT_KEYS:
        return value
    if key == "arguments" and isinstance(value, str) and value:
        return _filler_arguments(len(value))
    if isinstance(value, str):
        return _filler(len(value))
    if isinstance(value, bool):
        return value
    if isinstance(value, int):
        return 0
    if isinstance(value, list):
        return [_redacted(item) for item in value]
    if isinstance(value, dict):
        out = {k: _redacted(v, k) for k, v in value.items()}
        function = value.get("function")
        if isinstance(function, dict) and isinstance(function.get("name"), str):
            out["function"]["name"] = function["name"]  # which tool: structure, not text
        return out
    return value


def redact(body: dict[str, Any]) -> dict[str, Any]:
    """Rule 5: ``body`` with its texts replaced by filler of the same length: every field
    but the ``PARAMETERS`` and the ``IDENTIFIERS`` (the recorder has made those pseudonyms
    before, rule 4)."""
    return {key: value if key in PARAMETERS or key in IDENTIFIERS else _redacted(value)
            for key, value in body.items()}


@dataclass(frozen=True, slots=True)
class _Pending:
    at: float  # monotonic
    path: str
    body: bytes
    session: str


class TrafficRecorder:
    """Rules 1-7: one per gateway app, started and stopped with the mirror."""

    def __init__(self, config: RecordConfig, metrics: GatewayMetrics) -> None:
        if config.path is None:
            raise ValueError("a recorder needs [record] path")
        self.config = config
        self.path: Path = config.path
        self._metrics = metrics
        self._queue: deque[_Pending] = deque()
        self._queued_bytes = 0
        self._wake = asyncio.Event()
        self._key = os.urandom(32)
        self._started = time.monotonic()
        self._file: FileIO | None = None
        self._size = 0  # bytes in the file: whole lines (rule 8)
        self._failing = False  # the last write failed: logged once (rule 8)
        self._lock = threading.Lock()  # the file between the writer thread and close
        self._writer: asyncio.Task[None] | None = None
        self._closing = False

    # -- hot path -------------------------------------------------------------------

    def offer(self, route: Route, raw_path: str, body: bytes, session: str) -> None:
        """Rule 2: O(1), never awaits."""
        if route not in RECORDED_ROUTES or self._closing:
            return
        if not sampled(_SAMPLER_NAME, session, self.config.sample_rate):
            return
        if (len(self._queue) >= self.config.queue_items
                or self._queued_bytes + len(body) > self.config.queue_bytes):
            self._drop("queue_full")
            return
        self._queue.append(_Pending(time.monotonic(), raw_path, body, session))
        self._queued_bytes += len(body)
        self._wake.set()

    # -- lifecycle ------------------------------------------------------------------

    async def start(self) -> None:
        self._file = await asyncio.to_thread(self._open)
        self._started = time.monotonic()
        self._writer = asyncio.create_task(self._write_loop(), name="record-writer")

    async def stop(self) -> None:
        """Rule 7. Stopping again does no more (a writer cancelled before is not awaited)."""
        self._closing = True
        self._wake.set()
        if self._writer is not None and not self._writer.cancelled():
            try:
                await asyncio.wait_for(asyncio.shield(self._writer), self.config.drain_timeout_s)
            except TimeoutError:
                self._writer.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await self._writer
        while self._queue:
            self._queued_bytes -= len(self._queue.popleft().body)
            self._drop("shutdown")
        await asyncio.to_thread(self._close)

    def _open(self) -> FileIO:
        # Only a regular file is a recording to keep: a directory (or a device) named by
        # mistake is not moved aside; opening it fails and the gateway does not start.
        if self.path.is_file() and self.path.stat().st_size > 0:
            self._keep_previous()
        # Owner only, whatever the umask: with ``prompts = true`` it holds the prompts.
        return FileIO(self.path, "w", opener=_owner_only)

    def _keep_previous(self) -> None:
        """Rule 6: ``path`` becomes ``path.1``; the kept ``.1`` .. ``.n`` move one number up."""
        kept = 0
        while os.path.lexists(self._kept(kept + 1)):
            kept += 1
        for number in range(kept, 0, -1):  # highest first: each moves to a name nothing has
            self._kept(number).rename(self._kept(number + 1))
        self.path.rename(self._kept(1))
        log.info("the previous traffic record is kept as %s%s", self._kept(1),
                 f" (older ones up to {self._kept(kept + 1).name})" if kept else "")

    def _kept(self, number: int) -> Path:
        return self.path.with_name(f"{self.path.name}.{number}")

    def _close(self) -> None:
        with self._lock:
            if self._file is not None:
                self._file.close()
                self._file = None

    # -- writer ---------------------------------------------------------------------

    async def _write_loop(self) -> None:
        while True:
            if not self._queue:
                if self._closing:
                    return
                self._wake.clear()
                await self._wake.wait()
                continue
            batch = [self._queue.popleft() for _ in range(min(WRITE_BATCH, len(self._queue)))]
            self._queued_bytes -= sum(len(item.body) for item in batch)
            await asyncio.to_thread(self._write_counted, batch)

    def _write_counted(self, batch: list[_Pending]) -> None:
        """``_write`` and its counts, in the worker thread (rule 7): a writer cancelled at the
        drain timeout leaves its thread going, and the batch it holds is counted when that
        ends, written or dropped, not lost with the awaiting task. Counters are thread-safe."""
        written, dropped = self._write(batch)
        self._metrics.record_written.inc(written)
        for reason, count in dropped.items():
            self._drop(reason, count)

    def _write(self, batch: list[_Pending]) -> tuple[int, Counter[RecordDropReason]]:
        """Rule 3, in a worker thread: parse, redact, bound (rule 6), write."""
        dropped: Counter[RecordDropReason] = Counter()
        lines: list[bytes] = []
        size = self._size
        for item in batch:
            line = self._line(item)
            if line is None:
                dropped["not_json"] += 1
            elif size + len(line) > self.config.max_bytes:
                dropped["max_bytes"] += 1
            else:
                lines.append(line)
                size += len(line)
        with self._lock:
            if self._file is None:
                dropped["shutdown"] += len(lines)
                return 0, dropped
            try:
                self._append(self._file, b"".join(lines))
            except OSError as exc:
                if not self._failing:
                    log.warning("writing the traffic record %s failed (%s): requests are "
                                "dropped as write_error until a write succeeds", self.path, exc)
                    self._failing = True
                dropped["write_error"] += len(lines)
                return 0, dropped
            if self._failing:
                log.warning("writing the traffic record %s succeeds again", self.path)
                self._failing = False
            self._size = size
        return len(lines), dropped

    def _append(self, file: FileIO, data: bytes) -> None:
        """Rule 8: all of ``data`` after the last whole line, or none of it."""
        view = memoryview(data)
        try:
            while view:
                view = view[file.write(view) or 0:]
        except OSError:
            with contextlib.suppress(OSError):  # cut the half line off, if the disk lets us
                file.truncate(self._size)
                file.seek(self._size)
            raise

    def _line(self, item: _Pending) -> bytes | None:
        try:
            body = orjson.loads(item.body)
        except orjson.JSONDecodeError:
            return None
        if not isinstance(body, dict):
            return None
        for key in IDENTIFIERS & body.keys():  # rule 4
            if isinstance(body[key], str):
                body[key] = self._pseudonym(body[key])
            elif body[key] is not None:  # not an identifier's shape: nothing of it is kept
                body[key] = _redacted(body[key])
        if not self.config.prompts:
            body = redact(body)
        doc = {
            "offset_s": round(max(0.0, item.at - self._started), 6),
            "route": item.path.partition("?")[0],
            "session": self._pseudonym(item.session),
            "body": body,
        }
        return orjson.dumps(doc) + b"\n"

    def _pseudonym(self, value: str) -> str:
        # A session header's bytes that are not UTF-8 arrive as lone surrogates (aiohttp's
        # surrogateescape): hashed as they are, as the sampler does; a plain encode() raised
        # in the writer and ended it, and with it the recording.
        data = value.encode("utf-8", "surrogatepass")
        return hashlib.blake2b(data, digest_size=12, key=self._key).hexdigest()

    def _drop(self, reason: RecordDropReason, count: int = 1) -> None:
        self._metrics.record_dropped.labels(reason).inc(count)
