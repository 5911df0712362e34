"""The admin REST API: its own listener, versioned under /admin/v1, behind a bearer token.

Rules:
1. With a token configured every route needs ``Authorization: Bearer <token>``, compared
   in constant time; missing, empty or wrong → 401. An empty or blank configured token is
   no token, and one shorter than ``MIN_ADMIN_TOKEN_LENGTH`` is refused when the config is
   read. With no token the API refuses to listen on a non-loopback address (checked at
   start). With ``tls_cert_file`` and ``tls_key_file`` it serves HTTPS only (TLS 1.2 at
   least), so the token never crosses the network in clear; a non-loopback listener
   without them is allowed (a TLS proxy in front is common) and warned of at start. With
   ``tls_client_ca_file`` as well, a client must show a certificate one of those
   authorities signed (mutual TLS) before any route answers, the token still asked for
   after it: a leaked token alone opens nothing. The
   scorecard page's static files (``_scorecard.py``) hold no data and are
   served without it; the data they fetch is behind it like every other route.
2. Bodies are validated with pydantic, strictly: a string or a boolean where a number
   belongs, or NaN/Infinity, is a 422, never coerced. Every error is an OpenAI-style JSON
   body with the right 4xx, never a 500 or a traceback. The token never reaches a log.
3. A browser's request from another site is a 403 whatever the token: a ``Sec-Fetch-Site``
   other than ``same-origin`` or ``none``, or (a browser without it) an ``Origin`` whose
   host and port are not the ``Host``'s. Without a token a form or a no-cors fetch on any
   page the operator opened could otherwise POST a change (a candidate at its own address
   with the clients' credentials forwarded). Without a token the ``Host`` must also be a
   loopback name or address, or a DNS-rebound name would make that page same-origin.
   The scorecard page's files are exempt from the site check (a link elsewhere opens it).
4. Every answer carries ``Cache-Control: no-store``, ``X-Content-Type-Options: nosniff``
   and a Content-Security-Policy with ``frame-ancestors 'none'`` (the page's own is
   stricter); the data is the operator's, read with the token.
5. Changes take effect without a restart: the handlers hand them to the ``Promoter``,
   which stores each before it applies it to the live gateway, wholly or not at all.
   When the store cannot take a change in time the answer is 503 (``ChangeNotStored``,
   OpenAI-style JSON with the reason) and nothing was applied.
"""

from __future__ import annotations

import hmac
import ipaddress
import logging
import ssl
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime, timedelta
from typing import Annotated, Any, Final, TypeVar

import orjson
from aiohttp import web
from aiohttp.typedefs import Middleware
from aiohttp.web_protocol import RequestPayloadError
from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
)
from yarl import URL

from gateway._config import MAX_WINDOW_S, MIN_ADMIN_TOKEN_LENGTH, AdminConfig, CandidateConfig
from gateway._destinations import RefusedDestination, check_candidate_url, masked_url
from gateway._environment import ADMIN_TOKEN_ENV
from gateway._exceptions import (
    Forbidden,
    GatewayError,
    InvalidBody,
    MalformedBody,
    NotFound,
    RequestError,
    Unauthorized,
    error_response,
)
from gateway._mirror import Candidate
from gateway._openapi import Operation, openapi_document
from gateway._promotion import Promoter, RoutingChange, body_problems
from gateway._routing import Backend, Routing
from gateway._scorecard import (
    Distributions,
    TrafficSeries,
    distributions,
    judged_report,
    scorecard_files,
    traffic_series,
)
from gateway._state import GatewayState

__all__ = ["ADMIN_STATE", "admin_openapi", "build_admin_app", "check_admin_binding"]

log = logging.getLogger("understudy.admin")

ADMIN_STATE = web.AppKey("admin_state", GatewayState)
PREFIX = "/admin/v1"
MAX_ADMIN_BODY_BYTES = 64 * 1024
MIN_CANARY_INTERVAL_S = 1.0
"""Each canary interval ends in a judgement (store reads, a verdict): a shorter one had the
judge run back to back, a CPU core spent for as long as the canary ran."""

SAME_ORIGIN_FETCH_SITES: Final = frozenset({"same-origin", "none"})
"""Rule 3: the ``Sec-Fetch-Site`` values a browser sends for the page's own fetches and for
an address typed or bookmarked; ``same-site`` is another port or subdomain, not us."""
ANSWER_HEADERS: Final = {"Cache-Control": "no-store", "X-Content-Type-Options": "nosniff",
                         "Content-Security-Policy": "default-src 'none'; "
                                                    "frame-ancestors 'none'",
                         "X-Frame-Options": "DENY"}
"""Rule 4: set on every answer that does not set its own."""

Model = TypeVar("Model", bound=BaseModel)
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


# -- bodies and views -------------------------------------------------------------------

class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


def _no_control_characters(actor: str) -> str:
    # The audit log's actor column is text: PostgreSQL refuses NUL in it, which answered a
    # 503 'the store refused it' for a name (an operator retries a 503; this never passes).
    if any(ord(c) < 0x20 or 0x7F <= ord(c) < 0xA0 for c in actor):
        raise ValueError("holds a control character (NUL, a line break, ...)")
    return actor


Actor = Annotated[str, Field(min_length=1, max_length=100),
                  AfterValidator(_no_control_characters)]
"""Who asks for a routing change: a name for the audit log."""


class CandidateUpdate(_Body):
    """Fields of a candidate that may change at runtime (omitted fields stay)."""

    sample_rate: float | None = Field(None, ge=0.0, le=1.0)
    sampling_unit: str | None = Field(None, pattern="^(request|session)$")
    max_concurrency: int | None = Field(None, gt=0, le=1024)
    buffer_items: int | None = Field(None, gt=0)
    buffer_bytes: int | None = Field(None, gt=0)
    request_timeout_s: float | None = Field(None, gt=0)
    forward_credentials: bool | None = None


class CandidateView(BaseModel):
    name: str
    url: str
    role: str
    sample_rate: float
    sampling_unit: str
    max_concurrency: int
    buffer_items: int
    buffer_bytes: int
    forward_credentials: bool
    model: str | None
    paused: bool
    queued: int
    queued_bytes: int
    in_flight: int

    @classmethod
    def of(cls, candidate: Candidate) -> CandidateView:
        c = candidate.config
        return cls(name=c.name, url=masked_url(c.url), role=c.role, sample_rate=c.sample_rate,
                   sampling_unit=c.sampling_unit, max_concurrency=c.max_concurrency,
                   buffer_items=c.buffer_items, buffer_bytes=c.buffer_bytes,
                   forward_credentials=c.forward_credentials, model=c.model,
                   paused=candidate.paused, queued=len(candidate.buffer),
                   queued_bytes=candidate.buffer.queued_bytes, in_flight=candidate.in_flight)


class CandidateList(BaseModel):
    candidates: list[CandidateView]


class Deleted(BaseModel):
    deleted: str


ROUTING_VERSION_FIELD = Field(
    None, ge=1, description="The routing version (GET /routing) this change was decided on: "
    "a 409 if the routing has changed since, so a change retried or made twice at once "
    "applies once (Promoter rule 6). Omitted: the change applies to the routing it finds.")


class PromoteBody(_Body):
    force: bool = False
    reason: str | None = Field(None, max_length=1000)
    actor: Actor = "admin"
    routing_version: int | None = ROUTING_VERSION_FIELD


class RollbackBody(_Body):
    reason: str | None = Field(None, max_length=1000)
    actor: Actor = "admin"
    routing_version: int | None = ROUTING_VERSION_FIELD


class CanaryBody(_Body):
    steps: list[float] = Field(default_factory=lambda: [1.0, 5.0, 25.0, 50.0, 100.0],
                               min_length=1, max_length=20)
    interval_s: float = Field(60.0, ge=MIN_CANARY_INTERVAL_S, le=86400)
    actor: Actor = "admin"

    @field_validator("steps")
    @classmethod
    def _increasing_to_100(cls, steps: list[float]) -> list[float]:
        if any(not 0 < s <= 100 for s in steps) or steps != sorted(set(steps)):
            raise ValueError("steps must be increasing percentages in (0, 100]")
        if steps[-1] != 100:
            raise ValueError("the last step must be 100 (then the candidate is promoted)")
        return steps


class BackendView(BaseModel):
    name: str
    url: str
    model: str | None = None  # the model its live requests are rewritten to, if any

    @field_validator("url")
    @classmethod
    def _masked(cls, url: str) -> str:
        """An answer never holds a URL's password (the routing itself keeps the real URL)."""
        return masked_url(url)

    @classmethod
    def of(cls, backend: Backend) -> BackendView:
        return cls(name=backend.name, url=backend.url, model=backend.model)


class CanaryView(BaseModel):
    backend: BackendView
    steps: list[float]
    step: int
    percent: float
    interval_s: float
    step_started_at: float
    actor: str


class RoutingView(BaseModel):
    version: int
    primary: BackendView
    previous: BackendView | None
    canary: CanaryView | None

    @classmethod
    def of(cls, routing: Routing) -> RoutingView:
        # Built from the backends, not the stored form: that keeps their models apart
        # (``_routing`` rule 6), a view shows each backend's with it.
        canary, previous = routing.canary, routing.previous
        return cls(version=routing.version, primary=BackendView.of(routing.primary),
                   previous=None if previous is None else BackendView.of(previous),
                   canary=None if canary is None else CanaryView.model_validate(
                       {**canary.to_dict(), "backend": BackendView.of(canary.backend)}))


class ActionResult(BaseModel):
    routing: RoutingView
    verdict: str | None = None
    reasons: list[str] = Field(default_factory=list)

    @classmethod
    def of(cls, change: RoutingChange) -> ActionResult:
        judgement = change.judgement
        return cls(routing=RoutingView.of(change.routing),
                   verdict=judgement.label if judgement is not None else None,
                   reasons=list(judgement.reasons) if judgement is not None else [])


class ReportBody(BaseModel):
    """The judge's verdict on a candidate with every statistic (see evaluators' Report)."""

    model_config = ConfigDict(extra="allow")

    candidate: str
    verdict: str
    reasons: list[str]
    samples: dict[str, int]
    metrics: list[dict[str, Any]]
    more_samples_needed: int | None = None
    """About how many more values per side the INCONCLUSIVE metrics need to decide."""
    conditions: dict[str, Any] = {}
    """Each backend's latency-vs-concurrency curve; TTFT within cache strata; hit rates."""
    sample_bias: dict[str, Any] | None = None
    """The evaluated requests against all traffic seen: skew, drops by reason and size."""


# -- plumbing ---------------------------------------------------------------------------

def _loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def check_admin_binding(config: AdminConfig) -> None:
    """Refuse to expose an admin API without a token beyond loopback, or with TLS files
    that do not load (rule 1)."""
    admin_tls(config)
    if config.token is None and not _loopback(config.host):
        raise ValueError(f"admin API on {config.host} needs a token of at least "
                         f"{MIN_ADMIN_TOKEN_LENGTH} characters (admin.token or "
                         f"{ADMIN_TOKEN_ENV}; an empty one is none); without one it only "
                         "listens on a loopback address")


def admin_tls(config: AdminConfig) -> ssl.SSLContext | None:
    """The admin listener's TLS context from its PEM files (rule 1); ``None``: plain HTTP.
    Files that do not load (missing, unreadable, not PEM, a key not the certificate's)
    are a ``ValueError`` naming them."""
    if config.tls_cert_file is None or config.tls_key_file is None:
        return None
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        context.load_cert_chain(config.tls_cert_file, config.tls_key_file)
    except (OSError, ssl.SSLError) as exc:
        raise ValueError(f"admin TLS: cannot load the certificate {config.tls_cert_file} "
                         f"with the key {config.tls_key_file}: "
                         f"{getattr(exc, 'reason', None) or exc}") from None
    if config.tls_client_ca_file is not None:
        try:
            context.load_verify_locations(cafile=config.tls_client_ca_file)
        except (OSError, ssl.SSLError) as exc:
            raise ValueError(f"admin TLS: cannot load the client authorities "
                             f"{config.tls_client_ca_file}: "
                             f"{getattr(exc, 'reason', None) or exc}") from None
        context.verify_mode = ssl.CERT_REQUIRED
    return context


def warn_if_in_clear(config: AdminConfig) -> None:
    """Rule 1: a token sent to a non-loopback listener without TLS is readable on the way."""
    if config.tls_cert_file is None and not _loopback(config.host):
        log.warning("the admin API on %s serves plain HTTP: its bearer token crosses the "
                    "network in clear unless a TLS proxy is in front; set [admin] "
                    "tls_cert_file and tls_key_file to serve HTTPS", config.host)


def _json(model: BaseModel, status: int = 200) -> web.Response:
    return web.Response(status=status, body=model.model_dump_json().encode(),
                        content_type="application/json")


async def _body(request: web.Request, model: type[Model]) -> Model:
    try:
        raw = await request.read()
    except ConnectionResetError:  # the client left mid-body: its fault, not a traceback
        raise RequestError("the request body was cut short") from None
    except RequestPayloadError:  # aiohttp decodes as it reads: a body that does not decode
        # Read no more of it: aiohttp would read on after the answer, fail again and log it.
        request.content.feed_eof()
        raise MalformedBody("the request body does not decode (its Content-Encoding or "
                            "chunked framing is broken)") from None
    try:
        # Strict (rule 2): "0.5" is no rate and true no interval, as JSON types go.
        return model.model_validate_json(raw or b"{}", strict=True)
    except ValidationError as exc:
        raise InvalidBody(body_problems(exc)) from None


def _candidate(request: web.Request) -> Candidate:
    name = request.match_info["name"]
    candidate = request.app[ADMIN_STATE].mirror.candidates.get(name)
    if candidate is None:
        raise NotFound(f"no candidate named {name!r}")
    return candidate


async def _check_destination(request: web.Request, state: GatewayState, url: str) -> None:
    """Refuse a candidate URL at a metadata, service or own address (_destinations.py)."""
    own = {state.config.server.port, state.config.admin.port or 0}
    own |= {int(a[1]) for r in state.listeners for a in r.addresses if isinstance(a, tuple)}
    sockname = request.transport.get_extra_info("sockname") if request.transport else None
    if isinstance(sockname, tuple):
        own.add(int(sockname[1]))
    try:
        await check_candidate_url(url, own_ports=own - {0}, listen_host=state.config.server.host,
                                  allowed=state.config.admin.allowed_candidate_hosts)
    except RefusedDestination as exc:
        raise InvalidBody(f"url: {exc}") from None


@web.middleware
async def _errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except GatewayError as exc:
        response = error_response(exc)
        if exc.closes_connection:
            response.force_close()
        return response
    except web.HTTPException as exc:  # aiohttp's own 404/405/413, in the same JSON shape
        body = {"error": {"message": exc.reason, "type": RequestError.error_type,
                          "param": None, "code": exc.status}}
        return web.Response(status=exc.status, body=orjson.dumps(body),
                            content_type="application/json")


def _auth(token: str | None, open_paths: frozenset[str] = frozenset()) -> Middleware:
    @web.middleware
    async def auth(request: web.Request, handler: Handler) -> web.StreamResponse:
        if token is not None and request.path not in open_paths:
            scheme, _, provided = request.headers.get("Authorization", "").partition(" ")
            provided = provided.strip()
            # compare_digest even for an empty value, so its timing tells nothing either;
            # surrogatepass: a header's non-UTF-8 bytes are a wrong token, not a 500.
            matches = hmac.compare_digest(provided.encode("utf-8", "surrogatepass"),
                                          token.encode())
            if scheme.lower() != "bearer" or not provided or not matches:
                raise Unauthorized("missing or wrong bearer token")
        return await handler(request)

    return auth


def _same_site(token_set: bool, open_paths: frozenset[str]) -> Middleware:
    """Rule 3: refuse a browser's request from another site, and without a token one
    whose ``Host`` is not loopback (DNS rebinding)."""
    @web.middleware
    async def same_site(request: web.Request, handler: Handler) -> web.StreamResponse:
        host = request.headers.get("Host")
        if not token_set and host is not None and not _loopback_authority(host):
            request.content.feed_eof()  # unread, and not to be read: the connection closes
            raise Forbidden("this admin API has no token, so it answers only to a loopback "
                            "Host (localhost, 127.0.0.1, [::1]); set admin.token to reach "
                            "it by another name")
        if request.path not in open_paths:
            site = request.headers.get("Sec-Fetch-Site")
            origin = request.headers.get("Origin")
            if site is not None:
                cross = site.lower() not in SAME_ORIGIN_FETCH_SITES
            else:
                cross = origin is not None and _authority(origin) != (host or "").lower()
            if cross:
                request.content.feed_eof()
                raise Forbidden("a browser request from another site is refused (its "
                                "Origin or Sec-Fetch-Site is not this admin listener)")
        return await handler(request)

    return same_site


def _authority(origin: str) -> str | None:
    """``Origin``'s host[:port] as a ``Host`` header writes it; None for ``null`` or junk."""
    try:
        url = URL(origin)
    except ValueError:
        return None
    if not url.absolute or url.raw_host is None:
        return None
    return url.raw_authority.lower()


def _loopback_authority(host: str) -> bool:
    name = host.rsplit(":", 1)[0] if not host.endswith("]") else host
    name = name.strip("[]").lower().rstrip(".")
    if name == "localhost" or name.endswith(".localhost"):  # RFC 6761: never resolved out
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


async def _answer_headers(_: web.Request, response: web.StreamResponse) -> None:
    for name, value in ANSWER_HEADERS.items():
        response.headers.setdefault(name, value)


# -- handlers ---------------------------------------------------------------------------

async def list_candidates(request: web.Request) -> web.Response:
    mirror = request.app[ADMIN_STATE].mirror
    return _json(CandidateList(candidates=[CandidateView.of(c)
                                           for c in mirror.candidates.values()]))


async def get_candidate(request: web.Request) -> web.Response:
    return _json(CandidateView.of(_candidate(request)))


async def add_candidate(request: web.Request) -> web.Response:
    config = await _body(request, CandidateConfig)
    state = request.app[ADMIN_STATE]
    await _check_destination(request, state, config.url)
    candidate = await state.promoter.add_candidate(config)
    log.info("admin: candidate %s added (%s)", config.name, masked_url(config.url))
    return _json(CandidateView.of(candidate), status=201)


async def update_candidate(request: web.Request) -> web.Response:
    candidate = _candidate(request)
    update = await _body(request, CandidateUpdate)
    changes = update.model_dump(exclude_none=True)
    # Merged with the settings there are when the change is applied, not these: another
    # change may be applied while this one waits (Promoter.update_candidate).
    candidate = await request.app[ADMIN_STATE].promoter.update_candidate(
        candidate.name, changes)
    log.info("admin: candidate %s updated: %s", candidate.name, sorted(changes))
    return _json(CandidateView.of(candidate))


async def pause_candidate(request: web.Request) -> web.Response:
    promoter = request.app[ADMIN_STATE].promoter
    return _json(CandidateView.of(await promoter.pause_candidate(_candidate(request).name,
                                                                 paused=True)))


async def resume_candidate(request: web.Request) -> web.Response:
    promoter = request.app[ADMIN_STATE].promoter
    return _json(CandidateView.of(await promoter.pause_candidate(_candidate(request).name,
                                                                 paused=False)))


async def candidate_report(request: web.Request) -> web.Response:
    candidate = _candidate(request)
    since = _window_start(request.query.get("window_s"))
    report = await judged_report(request.app[ADMIN_STATE], candidate.name, since)
    return web.Response(body=orjson.dumps(report.to_dict()), content_type="application/json")


async def candidate_distributions(request: web.Request) -> web.Response:
    candidate = _candidate(request)
    since = _window_start(request.query.get("window_s"))
    return _json(await distributions(request.app[ADMIN_STATE], candidate.name, since))


async def get_traffic(request: web.Request) -> web.Response:
    since = _window_start(request.query.get("window_s"))
    return _json(await traffic_series(request.app[ADMIN_STATE], since))


def _window_start(window_s: str | None) -> datetime | None:
    if window_s is None:
        return None
    try:
        seconds = float(window_s)
    except ValueError:
        seconds = -1.0
    if not 0 < seconds < MAX_WINDOW_S:
        raise InvalidBody("window_s must be a positive number of seconds")
    return datetime.now(UTC) - timedelta(seconds=seconds)


async def get_routing(request: web.Request) -> web.Response:
    return _json(RoutingView.of(request.app[ADMIN_STATE].routing))


async def promote(request: web.Request) -> web.Response:
    body = await _body(request, PromoteBody)
    name = request.match_info["name"]
    change = await request.app[ADMIN_STATE].promoter.promote(
        name, actor=body.actor, force=body.force, reason=body.reason,
        routing_version=body.routing_version)
    return _json(ActionResult.of(change))


async def _reasoned(request: web.Request,
                    action: Callable[..., Awaitable[RoutingChange]]) -> web.Response:
    """A ``Promoter`` change that takes who asks, why, and the routing version it was
    decided on (``RollbackBody``): a rollback, a canary's stop."""
    body = await _body(request, RollbackBody)
    change = await action(request.app[ADMIN_STATE].promoter, actor=body.actor,
                          reason=body.reason, routing_version=body.routing_version)
    return _json(ActionResult.of(change))


async def rollback(request: web.Request) -> web.Response:
    return await _reasoned(request, Promoter.rollback)


async def start_canary(request: web.Request) -> web.Response:
    body = await _body(request, CanaryBody)
    change = await request.app[ADMIN_STATE].promoter.start_canary(
        request.match_info["name"], actor=body.actor, steps=tuple(body.steps),
        interval_s=body.interval_s)
    return _json(ActionResult.of(change), status=202)


async def stop_canary(request: web.Request) -> web.Response:
    return await _reasoned(request, Promoter.abort_canary)


async def remove_candidate(request: web.Request) -> web.Response:
    candidate = _candidate(request)
    await request.app[ADMIN_STATE].promoter.remove_candidate(candidate.name)
    log.info("admin: candidate %s removed", candidate.name)
    return _json(Deleted(deleted=candidate.name))


OPERATIONS: list[tuple[Operation, Handler]] = [
    (Operation("GET", "/candidates", "List candidates", response=CandidateList),
     list_candidates),
    (Operation("POST", "/candidates", "Add a candidate", body=CandidateConfig,
               response=CandidateView, status=201), add_candidate),
    (Operation("GET", "/candidates/{name}", "Get a candidate", response=CandidateView),
     get_candidate),
    (Operation("PATCH", "/candidates/{name}", "Change a candidate's sampling, concurrency "
               "or buffer", body=CandidateUpdate, response=CandidateView), update_candidate),
    (Operation("DELETE", "/candidates/{name}", "Remove a candidate and release its buffer",
               response=Deleted), remove_candidate),
    (Operation("POST", "/candidates/{name}/pause", "Stop mirroring to a candidate",
               response=CandidateView), pause_candidate),
    (Operation("POST", "/candidates/{name}/resume", "Resume mirroring to a candidate",
               response=CandidateView), resume_candidate),
    (Operation("GET", "/routing", "The routing this replica serves (primary, rollback "
               "target, canary)", response=RoutingView), get_routing),
    (Operation("POST", "/candidates/{name}/promote", "Promote a candidate if the judge "
               "passes it (or force with a reason)", body=PromoteBody, response=ActionResult),
     promote),
    (Operation("POST", "/rollback", "Switch back to the previous primary", body=RollbackBody,
               response=ActionResult), rollback),
    (Operation("POST", "/candidates/{name}/canary", "Shift live sessions to a candidate "
               "step by step while the judge passes", body=CanaryBody, response=ActionResult,
               status=202), start_canary),
    (Operation("DELETE", "/canary", "Stop the canary; its sessions go back to the primary",
               body=RollbackBody, response=ActionResult), stop_canary),
    (Operation("GET", "/candidates/{name}/report", "Judge a candidate over its stored scores "
               "(optional query window_s)", response=ReportBody), candidate_report),
    (Operation("GET", "/candidates/{name}/distributions", "Latency quantiles (CDF) and "
               "quality histograms of a candidate, the primary and the noise floor, from the "
               "newest stored scores (optional query window_s)", response=Distributions),
     candidate_distributions),
    (Operation("GET", "/traffic", "Requests seen and mirror drops by candidate and reason "
               "per minute (optional query window_s, default an hour, at most a day)",
               response=TrafficSeries), get_traffic),
]


def admin_openapi() -> dict[str, Any]:
    """The admin API's OpenAPI document (served at /admin/v1/openapi.json)."""
    document = openapi_document("understudy admin API", "1", [op for op, _ in OPERATIONS])
    document["servers"] = [{"url": PREFIX}]
    return document


def build_admin_app(state: GatewayState) -> web.Application:
    token = state.config.admin.token  # never empty: AdminConfig makes a blank one None
    page = scorecard_files()
    app = web.Application(
        middlewares=[_errors, _same_site(token is not None, frozenset(page)),
                     _auth(token.get_secret_value() if token is not None else None,
                           frozenset(page))],
        client_max_size=MAX_ADMIN_BODY_BYTES,
    )
    app[ADMIN_STATE] = state
    app.on_response_prepare.append(_answer_headers)
    document = orjson.dumps(admin_openapi())

    async def openapi(_: web.Request) -> web.Response:
        return web.Response(body=document, content_type="application/json")

    app.router.add_get(PREFIX + "/openapi.json", openapi)
    for op, handler in OPERATIONS:
        if op.method == "GET":  # HEAD too (aiohttp answers it with the GET's head)
            app.router.add_get(PREFIX + op.path, handler)
        else:
            app.router.add_route(op.method, PREFIX + op.path, handler)
    for path, (body, headers) in page.items():
        app.router.add_get(path, _static(body, headers))
    return app


def _static(body: bytes, headers: dict[str, str]) -> Handler:
    async def handler(_: web.Request) -> web.Response:
        return web.Response(body=body, headers=headers)

    return handler


