"""The router: the OpenAI front of prefill and decode nodes (``understudy engine --role router``).

Rules
-----
1. The router parses and checks a request as any engine would (same errors, same prompt token
   ids: it holds the model's tokenizer), hashes the prompt's full blocks, and looks the
   conversation up in its ``ConversationIndex``.
2. The policy picks a prefill node and a decode node (``kv._routing``).  The prefill node
   computes the prompt's full blocks -- reading the conversation's earlier blocks back from the
   decode node that retains them, when read-back is on -- and answers their
   ``kv_transfer_params``; the router forwards the client's body to the decode node with those
   parameters attached, and relays the answer.
3. The decode node's ``kv_transfer_params`` (the retained prompt + answer of this turn) never
   reach the client: the router takes them off the finishing chunk (or the whole body, where
   they become null as on vLLM) and files them for the conversation's next turn.
4. Failures degrade, never corrupt: a prefill node that fails or times out, or answers 200 with
   a body that is not its answer (not JSON, not an object, a field not a number), is counted
   and the decode node computes the prompt itself; a decode node's error status is relayed as
   is; one that fails before its headers is a 502 OpenAI-style error, after them an error
   event and ``[DONE]``.  So is a decode node's 200 whose body is not a JSON object, or whose
   finishing event (the one the router parses, rule 3) is not JSON: never a 500.  A client
   that leaves ends the decode request (the upstream connection closes and the decode node
   aborts).
5. The router hashes prompts with the nodes' hash-chain seed: the model's fingerprint, which a
   KV codec makes its own (``BlockPool``: ``H(fingerprint, codec fingerprint)``), so the router
   takes the seed a decode node reports beside its ``kv_transfer_params`` (``hash_seed``) and
   matches later turns with it.
6. The router refuses what its nodes would refuse for length, at once and in the nodes' words:
   its ``max_model_len`` is the smallest of its own (the model's, capped by ``--max-model-len``)
   and every node's, read from the node's ``/v1/models`` (a small KV pool makes it smaller than
   the model's).  It asks every node at start; a node it could not ask (not up yet), or that
   has since failed a request (it may have restarted with another pool), is asked again in the
   background, at most every ``NODE_LIMIT_RETRY_S``, when a request arrives.  Until a node
   answers, its last known limit stands -- or, never asked, the node refuses for itself.
7. The router never waits on a silent node without bound.  Whenever a node has sent nothing
   (no headers, no next line of a stream, not the rest of a body) for ``node_read_timeout_s``,
   the router asks its ``/health`` on a connection of its own, within the same time: a node
   that answers 200 is busy (a long prefill, a long answer that is not streamed), and the wait
   goes on; one that does not (stopped, wedged, its engine dead) is given up, logged and
   counted (``understudy_router_node_timeouts_total{role,node}``).  A prefill node given up is
   a failed prefill (rule 4: the decode node computes).  A decode node given up before its
   headers is a 504 OpenAI-style error; after them an error event and ``[DONE]`` (rule 4).
   Either way the upstream connection is closed, which ends the request on the node once it
   runs again, and the node's stream is no longer counted.
8. A node that fails at the transport -- refuses the connection (or does not take it within
   its connect timeout), hangs up, or is given up silent (rule 7) -- is marked down in the
   ``Cluster`` (``kv._routing`` rule 4): the policies leave it out for ``NODE_DOWN_S`` while
   another node of its kind is up, and a conversation whose record names a down decode node
   is routed without it (its read-back would wait on that node).  A prefill that outlasts
   ``PREFILL_TIMEOUT_S`` is not a transport failure: its node answered every health check
   (rule 7 decides busy or dead), it is only slow, so the prefill fails (rule 4) and the node
   stays up.  A decode node's failures are counted
   (``understudy_router_decode_failures_total{node}``): a transport failure, a node given up
   silent, or a 200 answer that is not one (``NodeAnswerError``: a body not typed
   ``application/json``, not JSON, not a JSON object, a finishing event not JSON); each is a
   502 or 504 to its client (or mid-stream an error event).  A bad answer does not mark its
   node down: the node answered at the transport, as one that answers an error status does
   (relayed, not counted); its ``max_model_len`` is asked again (rule 6).
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

import aiohttp
import orjson
from aiohttp import hdrs, web
from prometheus_client import CollectorRegistry, Counter

from backends.openai_wire import (
    DONE_EVENT,
    SSE_CONTENT_TYPE,
    RequestError,
    RequestKind,
    ServedModel,
    client_left,
    decode_body,
    encode_body,
    error_body,
    install_openai_app,
    json_response,
    metrics_response,
    sse_event,
)

from ..kv._blockpool import hash_blocks
from ..kv._routing import (
    POLICIES,
    Cluster,
    ConversationIndex,
    KVRecord,
    NodeRole,
    RouteJob,
)
from ..kv._store import DEFAULT_BLOCK_SIZE
from ..kv._transfer import KVSource
from ..model._model import LlamaModel
from ._kv_node import PREFILL_ROUTE
from ._openai import ENGINE_VERSION, parse_generation_request
from ._server_config import RouterServerConfig

__all__ = [
    "NODE_LIMIT_RETRY_S",
    "PREFILL_TIMEOUT_S",
    "ROUTER",
    "NodeAnswerError",
    "NodeSilentError",
    "Router",
    "RouterMetrics",
    "build_router_app",
]

log = logging.getLogger(__name__)

# A prefill of 8k tokens takes tens of seconds on two cores; beyond this, decode recomputes.
PREFILL_TIMEOUT_S = 300.0
# The decode node must send its headers within this; then its stream runs as long as it needs.
DECODE_CONNECT_TIMEOUT_S = 10.0
MAX_REQUEST_BODY_BYTES = 16 * 1024 * 1024
# Rule 6: a node's /v1/models must answer within this; one not asked is asked again this often.
NODE_LIMIT_TIMEOUT_S = 2.0
NODE_LIMIT_RETRY_S = 10.0
_KV_MARKER = b'"kv_transfer_params"'

ReadbackOutcome = Literal["attached", "new", "off"]
# A node that raised one of these failed at the transport (rule 8): OSError includes a reset;
# a status or a bad body is not, nor a whole call's timeout (``_failed_at_transport``).
_TRANSPORT_ERRORS = (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError, OSError)
_T = TypeVar("_T")


def _failed_at_transport(exc: BaseException) -> bool:
    """Whether ``exc`` marks its node down (rule 8).  A plain ``TimeoutError`` is a call's
    ``total`` timeout (``PREFILL_TIMEOUT_S``) on a node that answered its health checks:
    slow, not down.  aiohttp's connect and socket-read timeouts are ``ClientConnectionError``s."""
    if isinstance(exc, TimeoutError) and not isinstance(exc, aiohttp.ClientConnectionError):
        return False
    return isinstance(exc, _TRANSPORT_ERRORS)


class NodeSilentError(Exception):
    """A node that sent nothing for ``node_read_timeout_s`` and did not answer its health check
    within it either (rule 7)."""


class NodeAnswerError(Exception):
    """A decode node's 200 that is no answer: its body not a JSON object, or its finishing
    event not JSON (rule 8).  Not a transport failure: the node stays up."""


class RouterMetrics:
    """The router's own series (bounded: node indexes, a few outcomes)."""

    def __init__(self, num_prefill: int, num_decode: int) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        routed = Counter(
            "understudy_router_requests", "Requests by the nodes they were routed to.",
            ("prefill", "decode"), registry=self.registry,
        )  # fmt: skip
        self.routed = [
            [routed.labels(prefill=str(p), decode=str(d)) for d in range(num_decode)]
            for p in range(num_prefill)
        ]
        readback = Counter(
            "understudy_router_readback", "Requests by whether a previous turn's KV was attached.",
            ("outcome",), registry=self.registry,
        )  # fmt: skip
        self.readback = {o: readback.labels(outcome=o) for o in ("attached", "new", "off")}
        self.prefill_failed = Counter(
            "understudy_router_prefill_failures",
            "Prefill calls that failed; the decode node computed the prompt.",
            registry=self.registry,
        )
        timeouts = Counter(
            "understudy_router_node_timeouts",
            "Requests given up because their node went silent and failed its health check.",
            ("role", "node"), registry=self.registry,
        )  # fmt: skip
        self.node_timeouts: dict[NodeRole, list[Counter]] = {
            "prefill": [timeouts.labels(role="prefill", node=str(p)) for p in range(num_prefill)],
            "decode": [timeouts.labels(role="decode", node=str(d)) for d in range(num_decode)],
        }
        decode_failures = Counter(
            "understudy_router_decode_failures",
            "Requests that failed on their decode node: it refused the connection, hung up, "
            "was given up silent, or answered 200 with no answer: a body that is not a JSON "
            "object, or a finishing event that is not JSON (each a 502 or 504, or mid-stream an "
            "error event). An error status the node answered is relayed, not counted.",
            ("node",), registry=self.registry,
        )  # fmt: skip
        self.decode_failures = [decode_failures.labels(node=str(d)) for d in range(num_decode)]


@dataclass(frozen=True, slots=True)
class _Routed:
    job: RouteJob
    prefill_node: int
    decode_node: int


class Router:
    """State of one router app: its nodes, its conversations, its policy."""

    def __init__(self, config: RouterServerConfig, model: LlamaModel) -> None:
        self.config = config
        self.model = model
        self.prefill_urls = [url.rstrip("/") for url in config.prefill_urls]
        self.decode_urls = [url.rstrip("/") for url in config.decode_urls]
        self.block_size = DEFAULT_BLOCK_SIZE  # every node's (the engine's default)
        self.cluster = Cluster(len(self.prefill_urls), len(self.decode_urls), self.block_size)
        self.conversations = ConversationIndex()
        self.hash_seed: bytes = model.fingerprint  # rule 5: until a node reports its own
        self.policy = POLICIES[config.routing_policy]()
        self.metrics = RouterMetrics(len(self.prefill_urls), len(self.decode_urls))
        # The router's own bound; ``max_model_len`` adds its nodes' (rule 6).
        self.own_max_model_len = min(
            config.max_model_len or model.max_model_len, model.max_model_len
        )
        self.node_limits: dict[str, int] = {}
        # Nodes to ask for their limit (rule 6): all at first, then the unasked and the failed.
        self._unsure: set[str] = {*self.prefill_urls, *self.decode_urls}
        self._asked_at = -NODE_LIMIT_RETRY_S
        self._asking: asyncio.Task[None] | None = None
        self.created = int(time.time())
        self._session: aiohttp.ClientSession | None = None

    @property
    def max_model_len(self) -> int:
        """The longest context every node takes: what a request is checked against (rule 6)."""
        return min([self.own_max_model_len, *self.node_limits.values()])

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None:
            raise RuntimeError("the router is not running")
        return self._session

    async def start(self) -> None:
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0), auto_decompress=False
        )

    async def close(self) -> None:
        if self._asking is not None:
            self._asking.cancel()
            await asyncio.gather(self._asking, return_exceptions=True)
        if self._session is not None:
            await self._session.close()

    async def learn_node_limits(self) -> None:
        """Ask every node not known for sure for its ``max_model_len`` (rule 6)."""
        self._asked_at = time.monotonic()
        urls = sorted(self._unsure)
        limits = await asyncio.gather(*(self._node_limit(url) for url in urls))
        for url, limit in zip(urls, limits, strict=True):
            if limit is not None:
                self.node_limits[url] = limit
                self._unsure.discard(url)

    def recheck_node_limits(self) -> None:
        """Ask the nodes not known for sure again, in the background, if it is time (rule 6)."""
        if not self._unsure or time.monotonic() - self._asked_at < NODE_LIMIT_RETRY_S:
            return
        if self._asking is None or self._asking.done():
            self._asking = asyncio.get_running_loop().create_task(self.learn_node_limits())

    def node_failed(self, url: str) -> None:
        """A node failed a request: it may have restarted with another limit (rule 6)."""
        self._unsure.add(url)

    def decode_failed(self, node: int, exc: BaseException) -> None:
        """Decode node ``node`` failed a request (rule 8)."""
        self.metrics.decode_failures[node].inc()
        self.node_failed(self.decode_urls[node])
        if _failed_at_transport(exc):
            self.cluster.node_down("decode", node)

    def node_url(self, role: NodeRole, node: int) -> str:
        return (self.prefill_urls if role == "prefill" else self.decode_urls)[node]

    async def from_node(self, role: NodeRole, node: int, awaitable: Awaitable[_T]) -> _T:
        """What ``awaitable`` (a read from ``node``) gives, however long a live node takes;
        ``NodeSilentError`` once the node is silent and fails its health check (rule 7)."""
        idle_s = self.config.node_read_timeout_s
        task = asyncio.ensure_future(awaitable)
        try:
            while True:
                done, _ = await asyncio.wait((task,), timeout=idle_s)
                if done:
                    return task.result()
                alive = await self._alive(self.node_url(role, node))
                if task.done():
                    return task.result()
                if alive:
                    continue  # busy, not gone: wait on
                self.metrics.node_timeouts[role][node].inc()
                self.node_failed(self.node_url(role, node))
                self.cluster.node_down(role, node)
                raise NodeSilentError(
                    f"{role} node {node} sent nothing for {idle_s:g} s and did not answer its "
                    f"health check within {idle_s:g} s"
                )
        finally:
            if not task.done():
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)

    async def _alive(self, url: str) -> bool:
        """Whether the node answers ``/health`` with 200 within ``node_read_timeout_s``."""
        timeout = aiohttp.ClientTimeout(total=self.config.node_read_timeout_s)
        try:
            async with self.session.get(url + "/health", timeout=timeout) as response:
                return response.status == 200
        except (aiohttp.ClientError, TimeoutError) as exc:
            log.info("node %s failed its health check: %s", url, exc)
            return False

    async def _node_limit(self, url: str) -> int | None:
        try:
            async with self.session.get(
                url + "/v1/models", timeout=aiohttp.ClientTimeout(total=NODE_LIMIT_TIMEOUT_S)
            ) as response:
                answer = await response.json() if response.status == 200 else None
        except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
            log.info("node %s could not tell its max_model_len: %s", url, exc)
            return None
        cards = answer.get("data") if isinstance(answer, dict) else None
        limits: list[int] = []
        for card in cards if isinstance(cards, list) else ():
            limit = card.get("max_model_len") if isinstance(card, dict) else None
            if isinstance(limit, int) and not isinstance(limit, bool) and limit >= 2:
                limits.append(limit)
        if not limits:
            log.warning("node %s lists no max_model_len in its /v1/models", url)
            return None
        return min(limits)

    def route(self, prompt: tuple[int, ...]) -> _Routed:
        hashes = tuple(hash_blocks(self.hash_seed, prompt, self.block_size))
        record = self.conversations.match(hashes)
        if record is not None and record.decode_node not in self.cluster.available("decode"):
            record = None  # rule 8: its KV is on a down node
        job = RouteJob(len(prompt), hashes, record, readback=self.config.kv_readback)
        outcome: ReadbackOutcome = "off" if not self.config.kv_readback else "new"
        if job.readable_blocks:
            outcome = "attached"
        self.metrics.readback[outcome].inc()
        prefill_node, decode_node = self.policy.choose(job, self.cluster)
        self.metrics.routed[prefill_node][decode_node].inc()
        return _Routed(job, prefill_node, decode_node)

    async def prefill(self, routed: _Routed, prompt: tuple[int, ...]) -> dict[str, Any] | None:
        """Have the prefill node compute the prompt's blocks; their ``kv_transfer_params``, or
        None (nothing to ship, or the node failed: the decode node computes it all)."""
        job, node = routed.job, routed.prefill_node
        if not job.hashes:
            return None
        source = job.record.source.to_params() if job.readable_blocks and job.record else None
        tokens = self.cluster.to_compute(node, job)
        self.cluster.prefill_started(node, tokens)
        try:
            response = await self.from_node(
                "prefill",
                node,
                self.session.post(
                    self.prefill_urls[node] + PREFILL_ROUTE,
                    json={"prompt_token_ids": list(prompt), "kv_source": source},
                    timeout=aiohttp.ClientTimeout(total=PREFILL_TIMEOUT_S),
                ),
            )
            async with response:
                answer = None
                if response.status == 200:
                    answer = await self.from_node("prefill", node, response.json())
                else:
                    log.warning("prefill node %d answered %d", node, response.status)
        except (aiohttp.ClientError, TimeoutError, ValueError, NodeSilentError) as exc:
            log.warning("prefill node %d failed: %s", node, exc)
            if _failed_at_transport(exc):
                self.cluster.node_down("prefill", node)  # rule 8
            answer = None
        finally:
            self.cluster.prefill_finished(node, tokens, job.hashes)
        report = _prefill_report(answer)
        if report is None:
            if answer is not None:
                log.warning("prefill node %d answered 200 with no prefill report", node)
            self.metrics.prefill_failed.inc()
            self.node_failed(self.prefill_urls[node])
            return None
        self.cluster.learn(*report)
        params = answer.get("kv_transfer_params") if isinstance(answer, dict) else None
        return params if isinstance(params, dict) else None

    def file(self, routed: _Routed, params: object) -> None:
        """Keep a decode node's ``kv_transfer_params`` for the conversation's next turn."""
        if params is None:
            return  # the turn retained nothing (shorter than a block): no warning
        try:
            source = KVSource.from_params(params)
        except ValueError as exc:
            log.warning("decode node %d sent bad kv_transfer_params: %s", routed.decode_node, exc)
            return
        ttl = params.get("expires_in_s", 0.0) if isinstance(params, dict) else 0.0
        if not isinstance(ttl, int | float) or ttl <= 0:
            return
        seed = params.get("hash_seed") if isinstance(params, dict) else None
        if isinstance(seed, str) and len(seed) == 2 * len(self.hash_seed):
            try:
                self.hash_seed = bytes.fromhex(seed)
            except ValueError:
                log.warning("decode node %d sent a bad hash_seed", routed.decode_node)
        self.conversations.add(
            KVRecord(
                source=source,
                prefill_node=routed.prefill_node,
                decode_node=routed.decode_node,
                expires_at=time.monotonic() + float(ttl),
            )
        )


def _prefill_report(answer: object) -> tuple[int, float, int, float] | None:
    """A prefill node's answer as ``Cluster.learn`` takes it (computed tokens, their seconds,
    pulled blocks, their seconds); None when it is no such answer (rule 4): not an object, or
    a field that is not a finite number >= 0 (a count, a whole one)."""
    if not isinstance(answer, dict):
        return None
    values: list[float] = []
    for name, whole in (
        ("computed_tokens", True), ("compute_s", False), ("pulled_blocks", True), ("pull_s", False)
    ):  # fmt: skip
        value = answer.get(name, 0)
        if (
            isinstance(value, bool)
            or not isinstance(value, int | float)
            or not math.isfinite(value)
            or value < 0
            or (whole and not isinstance(value, int))
        ):
            return None
        values.append(value)
    computed, compute_s, pulled, pull_s = values
    return int(computed), float(compute_s), int(pulled), float(pull_s)


async def _decode_answer(router: Router, node: int, upstream: aiohttp.ClientResponse
                         ) -> dict[str, Any]:
    """The decode node's 200 body as a JSON object; ``NodeAnswerError`` when it is not one
    (rule 8).  A body not typed ``application/json`` is aiohttp's ``ContentTypeError``."""
    try:
        answer = await router.from_node("decode", node, upstream.json(loads=orjson.loads))
    except ValueError as exc:  # not JSON, or not UTF-8 (orjson's errors are ValueErrors)
        raise NodeAnswerError(f"its 200 answer is not JSON: {exc}") from exc
    if not isinstance(answer, dict):  # aiohttp reads an empty body as None
        what = "empty" if answer is None else f"a JSON {type(answer).__name__}"
        raise NodeAnswerError(f"its 200 answer is {what}, not a JSON object")
    return answer


ROUTER = web.AppKey("router", Router)


def build_router_app(config: RouterServerConfig, model: LlamaModel) -> web.Application:
    """The router of ``config.prefill_urls`` and ``config.decode_urls`` (rule 2)."""
    app = web.Application(client_max_size=MAX_REQUEST_BODY_BYTES)
    app[ROUTER] = Router(config, model)
    app.cleanup_ctx.append(_router_session)
    router = app[ROUTER]
    install_openai_app(
        app,
        ServedModel(
            config.served_model_name, lambda: router.max_model_len, created=router.created
        ),
        version=ENGINE_VERSION,
    )
    app.router.add_post("/v1/chat/completions", _chat_completions)
    app.router.add_post("/v1/completions", _completions)
    app.router.add_get("/health", _health)
    app.router.add_get("/metrics", _metrics)
    return app


async def _router_session(app: web.Application) -> AsyncIterator[None]:
    router = app[ROUTER]
    await router.start()
    await router.learn_node_limits()
    try:
        yield
    finally:
        await router.close()


async def _chat_completions(request: web.Request) -> web.StreamResponse:
    return await _generate(request, "chat")


async def _completions(request: web.Request) -> web.StreamResponse:
    return await _generate(request, "completion")


async def _generate(request: web.Request, kind: RequestKind) -> web.StreamResponse:
    router = request.app[ROUTER]
    router.recheck_node_limits()
    try:
        body = decode_body(await request.read())
        generation = parse_generation_request(
            kind,
            body,
            tokenizer=router.model.tokenizer,
            served_model=router.config.served_model_name,
            max_model_len=router.max_model_len,
        )
    except RequestError as exc:
        return json_response(exc.body(), exc.status)
    assert isinstance(body, dict)  # parse_generation_request refuses anything else
    routed = router.route(generation.prompt_ids)
    body["kv_transfer_params"] = await router.prefill(routed, generation.prompt_ids)
    headers: dict[str, str] = {"Content-Type": "application/json"}
    if "X-Request-Id" in request.headers:
        headers["X-Request-Id"] = request.headers["X-Request-Id"]
    node = routed.decode_node
    router.cluster.decode_streams[node] += 1
    try:
        upstream = await router.from_node(
            "decode",
            node,
            router.session.post(
                router.decode_urls[node] + request.path,
                data=encode_body(body),
                headers=headers,
                timeout=aiohttp.ClientTimeout(total=None, sock_connect=DECODE_CONNECT_TIMEOUT_S),
            ),
        )
        async with upstream:
            if upstream.status != 200:
                router.node_failed(router.decode_urls[node])
                return web.Response(
                    body=await router.from_node("decode", node, upstream.read()),
                    status=upstream.status,
                    content_type=upstream.content_type,
                )
            if generation.stream_options.stream:
                return await _relay_stream(request, upstream, router, routed)
            answer = await _decode_answer(router, node, upstream)
            router.file(routed, answer.get("kv_transfer_params"))
            answer["kv_transfer_params"] = None
            return json_response(answer)
    except NodeSilentError as exc:
        router.metrics.decode_failures[node].inc()  # marked down by ``from_node``
        message = str(exc)
        log.warning("gave up: %s", message)
        return json_response(
            error_body(message, status=504, err_type="GatewayTimeoutError"), 504
        )
    except NodeAnswerError as exc:  # rule 8: counted, not marked down
        router.decode_failed(node, exc)
        message = f"decode node {node} failed: {exc}"
        log.warning(message)
        return json_response(error_body(message, status=502, err_type="BadGatewayError"), 502)
    except (aiohttp.ClientError, TimeoutError, ConnectionResetError) as exc:
        if client_left(request):
            return web.Response()  # nobody to answer; leaving the block ended the decode
        router.decode_failed(node, exc)
        message = f"decode node {node} failed: {type(exc).__name__}: {exc}"
        log.warning(message)
        return json_response(error_body(message, status=502, err_type="BadGatewayError"), 502)
    finally:
        router.cluster.decode_streams[node] -= 1


async def _relay_stream(
    request: web.Request,
    upstream: aiohttp.ClientResponse,
    router: Router,
    routed: _Routed,
) -> web.StreamResponse:
    """Relay the decode node's events, taking ``kv_transfer_params`` off the finishing one."""
    response = web.StreamResponse(headers={hdrs.CONTENT_TYPE: SSE_CONTENT_TYPE})
    await response.prepare(request)
    event = bytearray()
    node = routed.decode_node
    try:
        while line := await router.from_node("decode", node, upstream.content.readline()):
            event += line
            if line not in (b"\n", b"\r\n"):
                continue
            if _KV_MARKER in event and event.startswith(b"data: {"):
                try:
                    chunk = orjson.loads(bytes(event[len(b"data: ") :]))
                except orjson.JSONDecodeError as exc:  # rule 8; relayed, it would leak rule 3
                    raise NodeAnswerError(f"its finishing event is not JSON: {exc}") from exc
                router.file(routed, chunk.pop("kv_transfer_params", None))
                event = bytearray(sse_event(chunk))
            await response.write(bytes(event))
            event.clear()
    except (
        aiohttp.ClientError, TimeoutError, ConnectionResetError, NodeSilentError, NodeAnswerError
    ) as exc:  # fmt: skip
        if client_left(request):
            return response  # leaving the block closes the decode request
        router.decode_failed(node, exc)
        # After the headers an error is an event, then [DONE], as vLLM ends a failed stream.
        if isinstance(exc, NodeSilentError):
            message = f"{exc} (mid-stream)"
            log.warning("gave up: %s", message)
            body = error_body(message, status=504, err_type="GatewayTimeoutError")
        elif isinstance(exc, NodeAnswerError):
            message = f"decode node {node} failed mid-stream: {exc}"
            log.warning(message)
            body = error_body(message, status=502, err_type="BadGatewayError")
        else:
            message = f"decode node {node} failed mid-stream: {type(exc).__name__}"
            log.warning("%s: %s", message, exc)
            body = error_body(message, status=502, err_type="BadGatewayError")
        event = bytearray(sse_event(body) + DONE_EVENT)
    if event:
        await response.write(bytes(event))
    await response.write_eof()
    return response


async def _health(request: web.Request) -> web.StreamResponse:
    return web.Response(status=200)


async def _metrics(request: web.Request) -> web.StreamResponse:
    return metrics_response(request.app[ROUTER].metrics.registry)
