"""Mirroring: sampled production requests replayed on each candidate, off the hot path.

Rules (DESIGN.md invariants 1, 3, 6, 7):
1. ``offer`` is the only part on the hot path. Per candidate it does a route check, a
   hash for sampling (``mirror_sampled``: its own namespace, so a candidate named
   ``canary`` or ``record`` samples independently of the canary's routing and the
   recorder, ``_sampler`` rule 4), and ``CandidateBuffer.offer`` — O(1), no await, no I/O.
2. Every request that reaches ``offer`` ends, for each candidate, counted exactly once:
   dropped with a reason (``MirrorDropReason``: ``route``, ``canary``, ``not_sampled``,
   ``paused``, ``dedup``, ``buffer_full``, ``budget``, ``shutdown``, ``removed``,
   ``internal``, ``join_timeout``, ``sink_full``, ``duplicate_id``) or joined and handed to
   the evaluation sink.
   A join is keyed by the request id, which a client may send (``X-Request-Id``): a request
   whose id is still being joined (a client reusing ids, a retry while the first's replay
   runs) is not mirrored (``duplicate_id``), and only a request ``offer`` queued hands its
   primary Observation to the joiner, so no answer is paired with another request's and
   none is lost uncounted. A removed candidate's Prometheus series are gone
   (``_metrics`` rule 2): what still ends for it after its removal (a join that waited for
   the primary) is counted in the sample-bias tally, not in a series of its name.
3. A candidate's workers (``max_concurrency`` of them) replay requests streaming, and
   record the candidate's Observation exactly as the relay records the primary's, so
   candidate TTFT and inter-token latency are measured.
4. A candidate receives only an allow-list of the client's headers (``_headers.py``);
   credentials only when it is configured to receive them.
5. Stopping: buffers close (queued items dropped as ``shutdown``), in-flight replays get
   ``drain_timeout_s`` to finish, the rest are cancelled; afterwards the budget is zero.
   A candidate removed while the mirror stops (a routing another replica changed, adopted
   meanwhile) is stopped once, by its removal, and the stop waits for that removal's drain
   as for its own. What the stop dropped is logged, a warning per candidate: the counter
   ends with the process.
6. With ``[record]`` on, ``offer`` also hands each request to the ``TrafficRecorder``
   (``_record.py``: O(1), no await) before any candidate is considered, and the mirror
   counts as active without candidates, so the relay offers it every request.
7. A body with a ``Content-Encoding`` (gzip, deflate) is read from a bounded decoded copy
   (``_body_coding.py``): its session key, turn depth and choices, what is recorded and
   its prompt size are the JSON's, as for a plain body; the body queued and sent to a
   candidate stays coded as the client sent it (a rewrite is coded again). This is the
   one case where ``offer`` does more than O(1): one decompression, bounded, only for a
   coded body on an inference route.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import Counter

import orjson
from multidict import CIMultiDict

from evaluators import (
    Capture,
    EvaluationSink,
    Exchange,
    Observation,
    json_requested,
    observe,
    requested_choices,
)
from gateway._body_coding import decode, with_fields
from gateway._budget import MemoryBudget, payload_key
from gateway._buffer import BufferClosed, CandidateBuffer, MirrorItem, MirrorRequest
from gateway._config import CandidateConfig, CaptureConfig, MirrorConfig, RecordConfig
from gateway._exceptions import UpstreamError
from gateway._headers import candidate_allow_list, credential_headers
from gateway._join import Joiner
from gateway._metrics import GatewayMetrics, MirrorDropReason, Route
from gateway._record import RECORDED_ROUTES, TrafficRecorder
from gateway._sampler import mirror_sampled, session_key
from gateway._scrape import BackendLoad
from gateway._traffic import TrafficTally, turn_depth
from gateway._upstream import Upstream

__all__ = ["Candidate", "Mirror"]

log = logging.getLogger("understudy.mirror")

# How often stale joins are swept, at most.
JOIN_SWEEP_INTERVAL_S = 1.0


class Candidate:
    """One candidate deployment: its config, connection pool, buffer and workers."""

    def __init__(self, config: CandidateConfig, budget: MemoryBudget,
                 mirror: MirrorConfig | None = None) -> None:
        self.config = config
        self.name = config.name
        self._mirror = mirror or MirrorConfig()
        self._credentials = credential_headers(self._mirror.credential_headers)
        self.upstream = Upstream(config, forward_credentials=config.forward_credentials,
                                 allowed_headers=self._allowed_headers(config),
                                 credentials=self._credentials)
        self.buffer = CandidateBuffer(config.name, config.buffer_items, config.buffer_bytes,
                                      budget)
        self.paused = False
        self.workers: set[asyncio.Task[None]] = set()
        self.idle: set[asyncio.Task[None]] = set()
        self.in_flight = 0
        self.stop_reason: MirrorDropReason = "shutdown"  # what a cancelled replay counts as

    def reconfigure(self, config: CandidateConfig) -> None:
        """Apply a new config of the same name and URL (rate, concurrency, buffer, ...)."""
        if (config.name, config.url) != (self.config.name, self.config.url):
            raise ValueError("a candidate's name and url cannot change; remove and re-add it")
        self.config = config
        self.upstream.config = config
        self.upstream.forward_credentials = config.forward_credentials
        self.upstream.allowed_headers = self._allowed_headers(config)
        self.buffer.max_items = config.buffer_items
        self.buffer.max_bytes = config.buffer_bytes


    def _allowed_headers(self, config: CandidateConfig) -> frozenset[str]:
        return candidate_allow_list(
            self._mirror.session_header, (*self._mirror.forward_headers, *config.forward_headers),
            credentials=self._credentials if config.forward_credentials else None)


class Mirror:
    def __init__(self, config: MirrorConfig, candidates: tuple[CandidateConfig, ...],
                 capture: CaptureConfig, metrics: GatewayMetrics, sink: EvaluationSink,
                 record: RecordConfig | None = None) -> None:
        self.config = config
        self.budget = MemoryBudget(config.memory_budget_bytes)
        self.metrics = metrics
        self.sink = sink
        self._capture = capture
        self._routes: frozenset[str] = frozenset(config.routes)
        self.candidates: dict[str, Candidate] = {
            c.name: Candidate(c, self.budget, config) for c in candidates
        }
        self.joiner = Joiner(self.budget, sink, config.join_timeout_s,
                             on_drop=self._count_drop, on_join=self._count_join)
        self._sweeper: asyncio.Task[None] | None = None
        self.traffic = TrafficTally()  # all traffic seen, and the drops, by prompt size
        self._shutdown_drops: Counter[str] = Counter()  # rule 5: said in the log at the stop
        self._removals: set[asyncio.Task[None]] = set()  # candidates removed, still draining
        self.backend_load: BackendLoad | None = None  # the scraped running counts, if any
        self.recorder = (TrafficRecorder(record, metrics)
                         if record is not None and record.path is not None else None)
        metrics.budget_limit.set(config.memory_budget_bytes)
        metrics.budget_used.set_function(lambda: self.budget.used)

    @property
    def active(self) -> bool:
        """Whether the relay offers requests here (rule 6)."""
        return bool(self.candidates) or self.recorder is not None

    # -- hot path -------------------------------------------------------------------

    def offer(self, route: Route, method: str, raw_path: str,
              headers: CIMultiDict[str], body: bytes,
              payload: dict[str, object] | None, request_id: str, session: str) -> bool:
        """Queue the request for every candidate that samples it. Never awaits. Whether
        it was queued for one: then its primary Observation is awaited (rule 2)."""
        readable = body
        coding = headers.get("Content-Encoding") if payload is None and body else None
        if coding is not None and route in RECORDED_ROUTES:
            readable, payload = self._decoded(coding, body)
            if payload is not None and session == f"r:{request_id}":
                # The relay found no key in a body it could not read (rule 7).
                session = session_key(headers, payload, self.config.session_header,
                                      request_id)
        if self.recorder is not None:
            self.recorder.offer(route, raw_path, readable, session)
        if route not in self._routes:
            self.skip("route")
            return False
        now = time.monotonic()
        depth = turn_depth(payload)
        size = len(readable)
        self.traffic.seen(route, payload is not None and payload.get("stream") is True, depth,
                          size)
        if self.joiner.expects(request_id):  # rule 2: that id's join is another request's
            for name in self.candidates:
                self._count_drop(name, "duplicate_id", size)
            return False
        request: MirrorRequest | None = None
        key = b""
        queued = False
        for candidate in self.candidates.values():
            config = candidate.config
            unit_key = session if config.sampling_unit == "session" else request_id
            if candidate.paused:
                self._count_drop(candidate.name, "paused", size)
                continue
            if not mirror_sampled(candidate.name, unit_key, config.sample_rate):
                self._count_drop(candidate.name, "not_sampled", size)
                continue
            if request is None:
                request = MirrorRequest(request_id, session, route, method, raw_path,
                                        headers, now, size, depth)
                key = payload_key(method, raw_path, body)
            outcome = candidate.buffer.offer(request, key, body)
            if outcome == "queued":
                queued = True
                self.metrics.mirror_queued.labels(candidate.name).inc()
                self.joiner.expect(request_id, candidate.name, session, route, now,
                                   prompt_bytes=size, turn_depth=depth,
                                   requested_choices=requested_choices(route, payload),
                                   json_requested=json_requested(route, payload))
            else:
                self._count_drop(candidate.name, "shutdown" if outcome == "closed" else outcome,
                                 size)
        return queued

    def _decoded(self, coding: str, body: bytes) -> tuple[bytes, dict[str, object] | None]:
        """Rule 7: the decoded body and its JSON object; the body as sent and None when it
        cannot be decoded (counted) or is not a JSON object."""
        decoded = decode(coding, body)
        if decoded.body is None:
            assert decoded.reason is not None
            self.metrics.mirror_undecoded.labels(decoded.reason).inc()
            return body, None
        try:
            payload = orjson.loads(decoded.body)
        except orjson.JSONDecodeError:
            return decoded.body, None
        return decoded.body, payload if isinstance(payload, dict) else None

    def skip(self, reason: MirrorDropReason) -> None:
        """Count a request that no candidate gets, for every candidate."""
        for name in self.candidates:
            self._count_drop(name, reason)

    def primary_done(self, observation: Observation) -> None:
        self.joiner.primary(observation)

    # -- lifecycle ------------------------------------------------------------------

    async def start(self) -> None:
        if self.recorder is not None:
            await self.recorder.start()
        for candidate in self.candidates.values():
            await self._start_candidate(candidate)
        self._sweeper = asyncio.create_task(self._sweep(), name="mirror-join-sweeper")

    async def _start_candidate(self, candidate: Candidate) -> None:
        candidate.upstream.open()
        self.metrics.buffer_items.labels(candidate.name).set_function(
            lambda: len(candidate.buffer))
        self.metrics.buffer_bytes.labels(candidate.name).set_function(
            lambda: candidate.buffer.queued_bytes)
        self._resize_workers(candidate)

    def _resize_workers(self, candidate: Candidate) -> None:
        """Match the worker count to ``max_concurrency``: spawn, or retire idle ones.

        Busy workers beyond the target retire when their current replay ends.
        """
        target = candidate.config.max_concurrency
        while len(candidate.workers) < target:
            task = asyncio.create_task(self._work(candidate),
                                       name=f"mirror-{candidate.name}-worker")
            candidate.workers.add(task)
        for task in list(candidate.idle)[: max(0, len(candidate.workers) - target)]:
            candidate.idle.discard(task)
            candidate.workers.discard(task)
            task.cancel()

    async def add_candidate(self, config: CandidateConfig) -> Candidate:
        if config.name in self.candidates:
            raise ValueError(f"candidate {config.name!r} exists")
        candidate = Candidate(config, self.budget, self.config)
        await self._start_candidate(candidate)
        self.candidates[config.name] = candidate
        return candidate

    def update_candidate(self, name: str, config: CandidateConfig) -> Candidate:
        candidate = self.candidates[name]
        candidate.reconfigure(config)
        self._resize_workers(candidate)
        return candidate

    async def remove_candidate(self, name: str) -> None:
        """Stop mirroring to ``name``; its buffer is released and its bytes return."""
        candidate = self.candidates.pop(name)
        removal = asyncio.create_task(self._remove(candidate))
        self._removals.add(removal)  # rule 5: a stop meanwhile waits for it
        removal.add_done_callback(self._removals.discard)
        await asyncio.shield(removal)

    async def _remove(self, candidate: Candidate) -> None:
        """The removal itself, whole even when the caller is cancelled (a DELETE whose
        client left): its buffer gauges go with it, their functions holding the buffer."""
        try:
            await self._stop_candidate(candidate, self.config.drain_timeout_s,
                                       reason="removed")
        finally:
            if candidate.name not in self.candidates:  # not added again meanwhile
                for gauge in (self.metrics.buffer_items, self.metrics.buffer_bytes):
                    gauge.remove(candidate.name)

    async def stop(self) -> None:
        # Rule 5: a routing adopted meanwhile may remove a candidate (``_app.serve_routing``)
        # while one drains; each is stopped once, by its removal or here.
        stopped: set[str] = set()
        while pending := [c for name, c in self.candidates.items() if name not in stopped]:
            for candidate in pending:
                stopped.add(candidate.name)
                if self.candidates.get(candidate.name) is candidate:
                    await self._stop_candidate(candidate, self.config.drain_timeout_s,
                                               reason="shutdown")
        await asyncio.gather(*self._removals, return_exceptions=True)
        if self._sweeper is not None:
            self._sweeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._sweeper
        self.joiner.close()
        if self.recorder is not None:
            await self.recorder.stop()
        for name, dropped in sorted(self._shutdown_drops.items()):
            log.warning("candidate %r: %d mirrored requests dropped at shutdown (queued or "
                        "not replayed within [mirror] drain_timeout_s; a larger concurrency "
                        "replays more of them)", name, dropped)

    async def _stop_candidate(self, candidate: Candidate, drain_timeout_s: float,
                              reason: MirrorDropReason) -> None:
        candidate.stop_reason = reason
        for item_request_id in self._close_buffer(candidate):
            self.joiner.abandon(item_request_id, candidate.name, reason)
        workers = list(candidate.workers)
        if workers:
            _, still_running = await asyncio.wait(workers, timeout=drain_timeout_s)
            for task in still_running:
                task.cancel()
            await asyncio.gather(*workers, return_exceptions=True)
        candidate.workers.clear()
        candidate.idle.clear()
        await candidate.upstream.close()

    @staticmethod
    def _close_buffer(candidate: Candidate) -> list[str]:
        queued = [item.request.request_id for item in candidate.buffer.pending()]
        candidate.buffer.close()
        return queued

    async def _sweep(self) -> None:
        interval = min(JOIN_SWEEP_INTERVAL_S, self.config.join_timeout_s / 4)
        while True:
            await asyncio.sleep(interval)
            self.joiner.expire(time.monotonic())

    # -- workers --------------------------------------------------------------------

    async def _work(self, candidate: Candidate) -> None:
        me = asyncio.current_task()
        assert me is not None
        while len(candidate.workers) <= candidate.config.max_concurrency:
            candidate.idle.add(me)
            try:
                item = await candidate.buffer.get()
            except BufferClosed:
                return
            finally:
                candidate.idle.discard(me)
            candidate.in_flight += 1
            try:
                observation = await self._replay(candidate, item)
            except asyncio.CancelledError:
                self.joiner.abandon(item.request.request_id, candidate.name,
                                    candidate.stop_reason)
                raise
            except Exception:  # a bug here must not kill the worker or leak the join
                log.exception("replay on candidate %s failed", candidate.name)
                self.metrics.mirror_failed.labels(candidate.name, "internal").inc()
                self.joiner.abandon(item.request.request_id, candidate.name, "internal")
                continue
            finally:
                candidate.in_flight -= 1
                self.budget.release_payload(item.payload)
            self._count_outcome(candidate.name, observation)
            self.joiner.candidate(candidate.name, observation)
        candidate.workers.discard(me)  # retired by a lower max_concurrency

    async def _replay(self, candidate: Candidate, item: MirrorItem) -> Observation:
        config = candidate.config
        request = item.request
        loop = asyncio.get_running_loop()
        capture = Capture(started=loop.time(), max_bytes=self._capture.max_bytes,
                          max_chunk_times=self._capture.max_chunk_times,
                          concurrency=candidate.in_flight,  # this replay included
                          backend_running=(None if self.backend_load is None
                                           else self.backend_load.running(candidate.name)))
        wall_started = time.time()
        upstream = candidate.upstream
        try:
            async with asyncio.timeout(config.request_timeout_s), \
                    upstream.call(request.method, request.raw_path,
                                  upstream.credentials(request.headers),
                                  _candidate_body(item.payload.body, config,
                                                  request.headers.get("Content-Encoding")),
                                  capture) as answer:
                await upstream.read(answer, capture)
        except UpstreamError as exc:
            capture.error = exc.kind
        except TimeoutError:
            capture.error = "request_timeout"
        capture.ended = loop.time()
        return observe(capture, request_id=request.request_id, backend=candidate.name,
                       route=request.route, wall_started=wall_started)

    # -- accounting -----------------------------------------------------------------

    def _count_drop(self, candidate: str, reason: MirrorDropReason,
                    prompt_bytes: int | None = None) -> None:
        self.metrics.mirror_dropped.labels(candidate, reason).inc()
        if reason == "shutdown":
            self._shutdown_drops[candidate] += 1
        if prompt_bytes is not None:
            self.traffic.dropped(candidate, reason, prompt_bytes)

    def _count_join(self, exchange: Exchange) -> None:
        self.metrics.mirror_joined.labels(exchange.candidate).inc()
        # Why this exchange's quality goes unscored, where an answer outgrew the capture.
        if exchange.candidate_observation.truncated:
            self.metrics.mirror_truncated.labels(exchange.candidate, "candidate").inc()
        if exchange.primary.truncated:
            self.metrics.mirror_truncated.labels(exchange.candidate, "primary").inc()

    def _count_outcome(self, candidate: str, observation: Observation) -> None:
        if observation.ok:
            self.metrics.mirror_completed.labels(candidate).inc()
            if observation.ttft_s is not None:
                self.metrics.candidate_ttft.labels(candidate).observe(observation.ttft_s)
            if observation.e2e_s is not None:
                self.metrics.candidate_e2e.labels(candidate).observe(observation.e2e_s)
        else:
            kind = observation.error or f"http_{observation.status // 100}xx"
            self.metrics.mirror_failed.labels(candidate, kind).inc()


def _candidate_body(body: bytes, config: CandidateConfig, coding: str | None = None) -> bytes:
    """The body as this candidate receives it: model rewrite and overrides applied, coded
    again as the client coded it (rule 7)."""
    if (config.model is None and not config.overrides) or not body:
        return body
    fields = dict(config.overrides)
    if config.model is not None:
        fields["model"] = config.model
    return with_fields(body, fields, coding)
