"""Routing: which backend answers a request, switched atomically by promotion and rollback.

Rules (DESIGN.md invariant 8):
1. :class:`Routing` is an immutable snapshot with a version. The relay reads the current
   snapshot once, when a request starts, and the whole request goes to the backend it
   names; a promotion replaces the snapshot for requests that start afterwards, so
   requests in flight finish on the backend they started on.
2. A progressive canary sends a share of sessions to the canary backend, decided by the
   same keyed hash as sampling (salt ``"canary"``; candidates' mirror samples hash in their
   own namespace, ``_sampler`` rule 4), so a session stays on one side as the share grows.
   A candidate that takes live traffic (the canary, a promoted candidate) keeps its
   ``model`` rewrite in its :class:`Backend`: its live requests name the model it serves,
   as its mirrored ones did when it was judged (without it, a backend serving another
   model name answers every live request 404).
3. Every backend that was ever primary keeps its pool (``Upstreams``) until shutdown: a
   rollback needs no reconnect and cuts no request in flight.
4. Replicas converge through the database (``RoutingSync``): the snapshot with the
   highest version wins.
5. A backend's ``api_key`` and connection settings are never part of the routing (it is
   stored, shared by every replica, and shown by the admin API): a :class:`Backend` is a
   name, a URL and a model. The URL is kept whole, so a password written inside it
   (``http://user:pw@host``) is stored in the routing (every replica connects with it);
   it is masked wherever the routing is shown: the admin API's answers and the copies in
   promote and rollback audit entries. Each replica's ``Upstreams`` looks a live backend's
   settings up in its own configuration, by name *and* URL: the configured primary's (its
   ``api_key``, timeouts and limits; the client's credentials forwarded when it has no
   key), or a candidate's, configured or added at runtime (its own ``api_key``, timeouts,
   limits and ``forward_credentials``), kept after it is promoted, so the canary, a
   promoted candidate and a rolled-back primary each get their own key. A candidate added
   at runtime is in this process's memory only: after a restart this replica has no
   settings for it, even where it is the promoted primary. A backend this replica has no
   settings for (that case, or a routing adopted from a replica that has that candidate)
   gets no key and none of the client's credentials, with the primary's timeouts and
   limits, a warning once and ``understudy_live_backend_without_settings_total{backend}``
   counted: never another backend's key. A live backend receives the client's other
   headers as the primary does (the mirror's allow-list is for replays); "the client's
   credentials" are every header ``_headers`` counts as one (``Authorization``, the
   OpenAI, Anthropic, Azure and Google key and account headers, ``[mirror]
   .credential_headers``), not ``Authorization`` alone.
6. The stored form is read by every replica, including ones still running an older
   release during a rolling upgrade (and a build downgraded to): a backend's dict holds
   ``name`` and ``url`` only, as it always did (an older reader builds its ``Backend``
   from exactly those), and the live backends' ``model`` rewrites go in a top-level
   ``models`` map by role (``primary``, ``previous``, ``canary``, ``origin``), which an
   older reader ignores (it serves the client's model name, as it always did).
   ``from_dict`` ignores keys it does not know, inside backend dicts and at the top, so a
   newer release's additions never stop this one; it still reads a ``model`` inside a
   backend dict (stored so by the release of 2c2d01a).
7. An older replica writes back what it read, less what it does not know: a routing it
   stores (a canary step, a promotion, a rollback) has no ``models`` map, and reading it
   as it stands takes every live backend's model rewrite away. So the map is always
   stored, ``{}`` where no backend has a model, and a routing stored without one (by a
   release before 974d832) is read with the models this replica knows (``from_dict``'s
   ``known``), by name and URL whatever the role (the canary promoted keeps its model):
   first the routing it served (a backend's model never changes while it stays live: a
   PATCH changes the candidate's settings, not the routing), then the candidates it has
   settings for (``Upstreams.models``), so a replica that starts while such a routing is
   the latest still sends the canary its model.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from gateway._config import CandidateConfig, UpstreamConfig
from gateway._metrics import GatewayMetrics
from gateway._sampler import sampled
from gateway._upstream import Upstream

__all__ = ["Backend", "Canary", "Routing", "Upstreams"]

log = logging.getLogger("understudy.routing")

CANARY_SAMPLING_KEY = "canary"


@dataclass(frozen=True, slots=True)
class Backend:
    """A backend that can take live traffic: its name, root URL and the ``model`` its
    requests are rewritten to (rule 2; ``None``: as the client sent it)."""

    name: str
    url: str
    model: str | None = None

    def to_dict(self) -> dict[str, str]:
        """The stored form (rule 6): name and URL only; the routing keeps ``model``."""
        return {"name": self.name, "url": self.url}

    @classmethod
    def from_dict(cls, data: dict[str, Any], model: str | None = None) -> Backend:
        """Rule 6: unknown keys are ignored; ``model`` where the backend dict has none."""
        stored = data.get("model", model)
        return cls(str(data["name"]), str(data["url"]),
                   None if stored is None else str(stored))


@dataclass(frozen=True, slots=True)
class Canary:
    backend: Backend
    steps: tuple[float, ...]  # percent of sessions at each step, increasing, ending at 100
    step: int
    interval_s: float
    step_started_at: float  # wall clock (time.time()) when the current step began
    # When the last step below 100 % began: at 100 % every session is served live by the
    # canary and nothing is mirrored to compare, so that step is judged on the scores since
    # then (None: the canary started at 100 %).
    measured_since: float | None = None
    actor: str = "admin"  # who started it: the actor of its steps' audit entries

    @property
    def percent(self) -> float:
        return self.steps[self.step]

    @property
    def judged_since(self) -> float | None:
        """The start of the scores this step is judged on (``_promotion`` rule 3)."""
        return self.step_started_at if self.percent < 100 else self.measured_since

    def look(self, now: float) -> int:
        """Which judgement of this step's window one at ``now`` is, from 1 (``_promotion``
        rule 3c): one an interval since its scores began, the same on every replica."""
        since = self.judged_since
        start = self.step_started_at if since is None else since
        return max(1, round((now - start) / self.interval_s))

    def next_step(self, now: float) -> Canary:
        measured = self.step_started_at if self.percent < 100 else self.measured_since
        return Canary(self.backend, self.steps, self.step + 1, self.interval_s, now, measured,
                      self.actor)

    def previous_step(self, now: float) -> Canary:
        """The step below this one, begun afresh at ``now`` (``_promotion`` rule 3: the
        100 % step goes back to the last mirrored step to measure more)."""
        if self.step == 0:
            raise ValueError("the first step has no step below it")
        return Canary(self.backend, self.steps, self.step - 1, self.interval_s, now, None,
                      self.actor)

    def to_dict(self) -> dict[str, Any]:
        return {"backend": self.backend.to_dict(), "steps": list(self.steps),
                "step": self.step, "percent": self.percent, "interval_s": self.interval_s,
                "step_started_at": self.step_started_at, "measured_since": self.measured_since,
                "actor": self.actor}

    @classmethod
    def from_dict(cls, data: dict[str, Any], model: str | None = None) -> Canary:
        measured = data.get("measured_since")
        return cls(Backend.from_dict(data["backend"], model), tuple(data["steps"]),
                   int(data["step"]), float(data["interval_s"]), float(data["step_started_at"]),
                   None if measured is None else float(measured), str(data.get("actor", "admin")))


@dataclass(frozen=True, slots=True)
class Routing:
    version: int
    primary: Backend
    previous: Backend | None = None  # the rollback target
    canary: Canary | None = None
    # The configured primary this history started from: a replica whose configuration
    # names another primary starts a new history instead of adopting this one.
    origin: Backend | None = None

    @classmethod
    def configured(cls, primary: Backend, version: int = 1) -> Routing:
        return cls(version, primary, origin=primary)

    def chooses_canary(self, session_key: str) -> bool:
        canary = self.canary
        return canary is not None and sampled(CANARY_SAMPLING_KEY, session_key,
                                              canary.percent / 100.0)

    def promoted(self, backend: Backend) -> Routing:
        return Routing(self.version + 1, primary=backend, previous=self.primary,
                       origin=self.origin)

    def rolled_back(self) -> Routing:
        if self.previous is None:
            raise ValueError("there is no previous primary to roll back to")
        return Routing(self.version + 1, primary=self.previous, previous=self.primary,
                       origin=self.origin)

    def with_canary(self, canary: Canary | None) -> Routing:
        return replace(self, version=self.version + 1, canary=canary)

    def live_backends(self) -> tuple[Backend, ...]:
        """The backends this routing may send live traffic to: the primary, the rollback
        target and the canary's."""
        canary = self.canary.backend if self.canary else None
        return tuple(b for b in (self.primary, self.previous, canary) if b is not None)

    def models(self) -> dict[str, str]:
        """The ``model`` rewrite of each backend that has one, by its role (rule 6)."""
        backends = {"primary": self.primary, "previous": self.previous,
                    "canary": self.canary.backend if self.canary else None,
                    "origin": self.origin}
        return {role: backend.model for role, backend in backends.items()
                if backend is not None and backend.model is not None}

    def to_dict(self) -> dict[str, Any]:
        """The stored form (rule 6): backend dicts an older release reads, models apart."""
        out = {"version": self.version, "primary": self.primary.to_dict(),
               "previous": self.previous.to_dict() if self.previous else None,
               "canary": self.canary.to_dict() if self.canary else None,
               "origin": self.origin.to_dict() if self.origin else None}
        return {**out, "models": self.models()}  # even empty: rule 7

    def models_by_address(self) -> dict[tuple[str, str], str]:
        """The ``model`` rewrite of each backend here that has one, by name and URL."""
        return {(b.name, b.url): b.model for b in (*self.live_backends(), self.origin)
                if b is not None and b.model is not None}

    @classmethod
    def from_dict(cls, data: dict[str, Any],
                  known: Mapping[tuple[str, str], str] | None = None) -> Routing:
        """Rules 6 and 7: ``known`` is each backend's model as this replica knows it, by
        name and URL, for a routing stored without the ``models`` map."""
        previous, canary, origin = data.get("previous"), data.get("canary"), data.get("origin")
        if "models" in data or known is None:
            models = data.get("models") or {}
            return cls(int(data["version"]),
                       Backend.from_dict(data["primary"], models.get("primary")),
                       Backend.from_dict(previous, models.get("previous")) if previous else None,
                       Canary.from_dict(canary, models.get("canary")) if canary else None,
                       Backend.from_dict(origin, models.get("origin")) if origin else None)

        def model(backend: dict[str, Any]) -> str | None:
            return known.get((str(backend["name"]), str(backend["url"])))

        return cls(int(data["version"]),
                   Backend.from_dict(data["primary"], model(data["primary"])),
                   Backend.from_dict(previous, model(previous)) if previous else None,
                   Canary.from_dict(canary, model(canary["backend"])) if canary else None,
                   Backend.from_dict(origin, model(origin)) if origin else None)


class Upstreams:
    """One pooled session per backend that takes live traffic, opened on first use, with
    that backend's own settings as this replica knows them (rule 5)."""

    __slots__ = ("_credentials", "_known", "_pools", "_unconfigured", "primary")

    def __init__(self, primary: UpstreamConfig,
                 candidates: tuple[CandidateConfig, ...] = (),
                 metrics: GatewayMetrics | None = None, *,
                 credentials: frozenset[str]) -> None:
        self.primary = primary
        self._credentials = credentials  # the headers that carry the client's credentials
        self._unconfigured = None if metrics is None else metrics.live_without_settings
        # (name, url) -> settings: the URL too, so a key never goes to another address.
        self._known: dict[tuple[str, str], UpstreamConfig] = {(primary.name, primary.url): primary}
        self._pools: dict[Backend, Upstream] = {}
        for candidate in candidates:
            self.know(candidate)

    def know(self, config: CandidateConfig) -> None:
        """Remember ``config`` as the settings of the backend it names (added at runtime,
        or changed: a pool already open for it takes them at once)."""
        key = (config.name, config.url)
        self._known[key] = config
        for backend, upstream in self._pools.items():
            if (backend.name, backend.url) == key:
                _configure(upstream, config)

    def models(self) -> dict[tuple[str, str], str]:
        """The ``model`` rewrite of each candidate this replica has settings for, by name
        and URL (rule 7: what a routing stored without its models map is read with)."""
        return {key: config.model for key, config in self._known.items()
                if isinstance(config, CandidateConfig) and config.model is not None}

    def forget(self, name: str, url: str) -> None:
        """Drop a removed candidate's settings (not the configured primary's); an open pool
        keeps what it has until shutdown (rule 3)."""
        if (name, url) != (self.primary.name, self.primary.url):
            self._known.pop((name, url), None)

    def get(self, backend: Backend) -> Upstream:
        upstream = self._pools.get(backend)
        if upstream is None:
            upstream = self._pools[backend] = self._open(backend)
        return upstream

    def _open(self, backend: Backend) -> Upstream:
        config = self._known.get((backend.name, backend.url))
        if config is None:
            # Rule 5: no settings here. No key and no client credentials rather than
            # another backend's; the primary's timeouts and limits (no secret in them).
            log.warning("live backend %s has no settings on this replica (a routing adopted "
                        "from another, or a candidate added at runtime before this replica "
                        "restarted): it is sent no API key and no client credentials",
                        backend.name)
            if self._unconfigured is not None:
                self._unconfigured.labels(backend.name).inc()
            config = self.primary.model_copy(update={"name": backend.name, "url": backend.url,
                                                     "api_key": None})
            upstream = Upstream(config, forward_credentials=False,
                                credentials=self._credentials)
        else:
            upstream = Upstream(config, credentials=self._credentials)
            _configure(upstream, config)
        upstream.open()
        return upstream

    async def close(self) -> None:
        for upstream in self._pools.values():
            await upstream.close()
        self._pools.clear()


def _configure(upstream: Upstream, config: UpstreamConfig) -> None:
    """A live backend's credential policy from its settings (rule 5): a candidate's own
    ``forward_credentials``; the primary forwards the client's (when it has no key)."""
    upstream.config = config
    upstream.forward_credentials = (config.forward_credentials
                                    if isinstance(config, CandidateConfig) else True)
