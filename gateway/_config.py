"""Typed configuration: one model per concern, read from TOML, overridden by env and flags.

Precedence, highest first: command-line flags, ``UNDERSTUDY_*`` environment variables
(nested with ``__``, e.g. ``UNDERSTUDY_PRIMARY__URL``), the TOML file, the defaults below.
Building a config has no side effects; starting the gateway does.

An ``UNDERSTUDY_*`` variable that names no setting is refused by ``load_config``, as an
unknown TOML key is: a typo (a letter missing from ``UNDERSTUDY_ADMIN_TOKEN``) would
otherwise leave the setting unset without a word. The variables other parts of understudy
read are known names too (``OTHER_ENVIRONMENT``).
"""

from __future__ import annotations

import difflib
import errno
import os
import re
import types
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Annotated, Any, Literal, Union, get_args, get_origin

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    FilePath,
    JsonValue,
    SecretStr,
    ValidationError,
    ValidationInfo,
    WithJsonSchema,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError
from pydantic_settings import (
    BaseSettings,
    InitSettingsSource,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    TomlConfigSettingsSource,
)
from yarl import URL

from evaluators import DEFAULT_SCORERS, Gates, ScorerConfig
from evaluators.store import StoreConfig, masked_url
from gateway._environment import (
    ADMIN_CLIENT_CERT_ENV,
    ADMIN_CLIENT_KEY_ENV,
    ADMIN_TOKEN_ENV,
    ADMIN_URL_ENV,
)

__all__ = [
    "MAX_CANDIDATES",
    "MIN_ADMIN_TOKEN_LENGTH",
    "OTHER_ENVIRONMENT",
    "AdminConfig",
    "CandidateConfig",
    "CaptureConfig",
    "EvaluationConfig",
    "GatewayConfig",
    "MirrorConfig",
    "RecordConfig",
    "ServerConfig",
    "UpstreamConfig",
    "check_environment",
    "load_config",
    "parse_candidate_flag",
]

KiB = 1024
MiB = 1024 * KiB

ENV_PREFIX = "UNDERSTUDY_"
ENV_NESTED_DELIMITER = "__"
OTHER_ENVIRONMENT: frozenset[str] = frozenset({
    ADMIN_TOKEN_ENV,               # the admin token, read below besides UNDERSTUDY_ADMIN__TOKEN
    ADMIN_URL_ENV,                 # the admin commands' API root (gateway/_cli_admin.py)
    ADMIN_CLIENT_CERT_ENV,         # their client certificate, for mutual TLS
    ADMIN_CLIENT_KEY_ENV,          # and its key where it has a file of its own
    "UNDERSTUDY_HOME",             # models, vLLM, static embeddings (backends/vllm, evaluators)
    "UNDERSTUDY_CACHE_DIR",        # the KV codecs' calibration cache (backends/engine)
    "UNDERSTUDY_VLLM_PYTHON",      # scripts/setup-vllm.sh
    "UNDERSTUDY_TEST_PG",          # the tests' PostgreSQL (tests/fixtures_db.py)
    "UNDERSTUDY_BENCH_PG_ADMIN",   # bench/store.py
    "UNDERSTUDY_STORE__URL",       # Alembic's database URL (migrations/env.py)
})  # fmt: skip
"""``UNDERSTUDY_*`` variables that are no gateway setting but are read elsewhere in understudy
(``tests/gateway/test_config.py`` finds every one the tree reads)."""
MIN_ADMIN_TOKEN_LENGTH = 16
"""Characters an admin token needs at least; an empty or blank token counts as none."""
DEFAULT_ADMIN_STORE_TIMEOUT_S = 5.0
"""How long an admin change waits on each store call before it answers 503, unapplied."""
MAX_WINDOW_S = 10 * 365 * 86400
"""The longest window a report may be asked for (``understudy report --window-s``, the
admin API's ``window_s``): ten years, past which its start is no date a store holds."""
DEFAULT_PORT = 8080
DEFAULT_MAX_BODY_BYTES = 8 * MiB
DEFAULT_SHUTDOWN_TIMEOUT_S = 30.0
DEFAULT_HEADER_TIMEOUT_S = 10.0
"""How long a client has to send a request's headers, from its first byte (slowloris)."""
DEFAULT_BODY_TIMEOUT_S = 60.0
"""How long a client has to send a request's whole body, from the end of its headers (a
body that stalls would otherwise hold its connection and a relay task for ever; 8 MiB in
60 s is ~1.1 Mbit/s)."""
DEFAULT_KEEPALIVE_TIMEOUT_S = 75.0
"""Idle keep-alive connections are closed after this; above the 60 s of common load
balancers, so the balancer, not the gateway, ends an idle pooled connection."""
DEFAULT_MAX_CLIENT_CONNECTIONS = 4096
DEFAULT_MAX_CONNECTIONS_PER_IP = 1024
"""High enough for a load balancer or a load generator on one address; a flood from one
host still leaves room for the others."""
DEFAULT_MAX_HEADER_BYTES = 32 * KiB
"""All of a request's header names and values together (nginx's 4 x 8 KiB buffers)."""
DEFAULT_MAX_HEADER_FIELD_BYTES = 8 * KiB
DEFAULT_MAX_HEADER_COUNT = 100
DEFAULT_CONNECT_TIMEOUT_S = 5.0
DEFAULT_FIRST_BYTE_TIMEOUT_S = 120.0
DEFAULT_IDLE_TIMEOUT_S = 60.0
DEFAULT_MAX_CONNECTIONS = 1024
DEFAULT_CAPTURE_BYTES = 256 * KiB
DEFAULT_CAPTURE_CHUNK_TIMES = 8192
DEFAULT_RECENT_OBSERVATIONS = 256
DEFAULT_MEMORY_BUDGET = 256 * MiB
DEFAULT_CANDIDATE_CONCURRENCY = 4
MAX_CANDIDATES = 64
"""Candidates (and secondaries) at once, configured or added at runtime: each holds up to
``max_concurrency`` (<= 1024) worker tasks and its own connection pool."""
DEFAULT_BUFFER_ITEMS = 256
DEFAULT_BUFFER_BYTES = 32 * MiB
DEFAULT_CANDIDATE_REQUEST_TIMEOUT_S = 300.0
DEFAULT_JOIN_TIMEOUT_S = 600.0
DEFAULT_MIRROR_DRAIN_TIMEOUT_S = 5.0
DEFAULT_SINK_CAPACITY = 10_000
MirroredRoute = Literal["chat_completions", "completions", "embeddings", "models", "other"]
DEFAULT_ROUTING_POLL_S = 1.0
DEFAULT_EVALUATION_PENDING = 10_000
DEFAULT_EVALUATION_DRAIN_S = 10.0
DEFAULT_RECORD_MAX_BYTES = 256 * MiB
DEFAULT_RECORD_QUEUE_ITEMS = 1024
DEFAULT_RECORD_QUEUE_BYTES = 16 * MiB
DEFAULT_RECORD_DRAIN_TIMEOUT_S = 5.0
DEFAULT_MIRRORED_ROUTES: tuple[MirroredRoute, ...] = (
    "chat_completions", "completions", "embeddings",
)


class _Section(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class ServerConfig(_Section):
    host: str = "127.0.0.1"
    port: int = Field(DEFAULT_PORT, ge=0, le=65535)
    max_body_bytes: int = Field(DEFAULT_MAX_BODY_BYTES, gt=0)
    shutdown_timeout_s: float = Field(DEFAULT_SHUTDOWN_TIMEOUT_S, ge=0)
    # Client connection bounds (gateway/_connections.py); each exceeding is counted in
    # understudy_connections_closed{reason} and the connection closed.
    header_timeout_s: float = Field(DEFAULT_HEADER_TIMEOUT_S, gt=0)
    body_timeout_s: float = Field(DEFAULT_BODY_TIMEOUT_S, gt=0)
    keepalive_timeout_s: float = Field(DEFAULT_KEEPALIVE_TIMEOUT_S, gt=0)
    max_connections: int = Field(DEFAULT_MAX_CLIENT_CONNECTIONS, gt=0)
    max_connections_per_ip: int = Field(DEFAULT_MAX_CONNECTIONS_PER_IP, gt=0)
    max_header_bytes: int = Field(DEFAULT_MAX_HEADER_BYTES, gt=0)
    max_header_field_bytes: int = Field(DEFAULT_MAX_HEADER_FIELD_BYTES, gt=0)
    max_header_count: int = Field(DEFAULT_MAX_HEADER_COUNT, gt=0)


HeaderName = Annotated[str, Field(min_length=1, max_length=128,
                                  pattern=r"^[!#$%&'*+.^_`|~0-9A-Za-z-]+$")]
"""An HTTP field name (RFC 9110 token)."""

_CONTROL = re.compile(r"[\x00-\x1f\x7f]")
"""What no URL nor header value may hold (nor may a URL hold a space)."""


class UpstreamConfig(_Section):
    """One backend the gateway talks to. ``url`` is the server root (``/v1`` is stripped)."""

    name: str = "primary"
    url: str = Field("http://127.0.0.1:8000", repr=False)  # may hold a password
    api_key: SecretStr | None = None
    connect_timeout_s: float = Field(DEFAULT_CONNECT_TIMEOUT_S, gt=0)
    first_byte_timeout_s: float = Field(DEFAULT_FIRST_BYTE_TIMEOUT_S, gt=0)
    idle_timeout_s: float = Field(DEFAULT_IDLE_TIMEOUT_S, gt=0)
    max_connections: int = Field(DEFAULT_MAX_CONNECTIONS, gt=0)

    @field_validator("url")
    @classmethod
    def _root_url(cls, url: str) -> str:
        url = url.strip()  # e.g. read from a file with its newline
        if _CONTROL.search(url) or " " in url:
            raise ValueError("upstream url holds a space or a control character")
        if not url.startswith(("http://", "https://")):
            # The URL itself may carry a password: name only its scheme.
            scheme = url.partition("://")[0] if "://" in url else ""
            raise ValueError(
                f"upstream url must start with http:// or https://, got scheme {scheme[:16]!r}"
            )
        # Refused here, where it is a 422 (admin API) or a config error, not later where the
        # upstream's pool is built from it after the change was stored.
        try:
            host = URL(url).host
        except ValueError:  # yarl's words may quote the netloc, password and all
            raise ValueError("upstream url is not a valid URL (its host or port)") from None
        if not host:
            raise ValueError("upstream url names no host")
        url = url.rstrip("/")
        return url.removesuffix("/v1")

    @field_validator("api_key")
    @classmethod
    def _sendable_key(cls, key: SecretStr | None) -> SecretStr | None:
        """Refused here: in a header a line break or NUL fails every request sent with it."""
        if key is not None and _CONTROL.search(key.get_secret_value()):
            raise ValueError("api_key holds a control character (a line break, NUL, ...)")
        return key


class CaptureConfig(_Section):
    """Bounds on what the relay keeps of each answer for its Observation."""

    max_bytes: int = Field(DEFAULT_CAPTURE_BYTES, ge=0)
    max_chunk_times: int = Field(DEFAULT_CAPTURE_CHUNK_TIMES, ge=0)
    recent_observations: int = Field(DEFAULT_RECENT_OBSERVATIONS, ge=0)


class CandidateConfig(UpstreamConfig):
    """A deployment under test: it receives a sample of the primary's traffic."""

    # An infinite timeout is no bound, and NaN no number (the admin API takes this model).
    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)

    name: str = Field(..., min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")
    url: str = Field(..., repr=False)  # may hold a password
    sample_rate: float = Field(1.0, ge=0.0, le=1.0)
    sampling_unit: Literal["request", "session"] = "session"
    max_concurrency: int = Field(DEFAULT_CANDIDATE_CONCURRENCY, gt=0, le=1024)
    buffer_items: int = Field(DEFAULT_BUFFER_ITEMS, gt=0)
    buffer_bytes: int = Field(DEFAULT_BUFFER_BYTES, gt=0)
    request_timeout_s: float = Field(DEFAULT_CANDIDATE_REQUEST_TIMEOUT_S, gt=0)
    forward_credentials: bool = False
    # Client headers this candidate receives besides the allow-list (see _headers.py).
    forward_headers: tuple[HeaderName, ...] = ()
    model: str | None = None  # rewrite the request's "model" for this candidate
    # JSON fields merged into each mirrored request body (e.g. {"temperature": 0.8}).
    overrides: Annotated[dict[str, JsonValue], WithJsonSchema({"type": "object"})] = Field(
        default_factory=dict)
    # "secondary": another replica of the primary, scored the same way to measure the
    # noise floor that candidates' quality differences must exceed.
    role: Literal["candidate", "secondary"] = "candidate"

    @field_validator("name")
    @classmethod
    def _not_a_dot_segment(cls, name: str) -> str:
        """A name is a path segment of the admin API (``/candidates/NAME``): ``.`` or ``..``
        would be resolved away by browsers and most clients before it reached the gateway."""
        if name in (".", ".."):
            raise ValueError("a candidate name cannot be '.' or '..'")
        return name


class MirrorConfig(_Section):
    memory_budget_bytes: int = Field(DEFAULT_MEMORY_BUDGET, ge=0)
    routes: tuple[MirroredRoute, ...] = DEFAULT_MIRRORED_ROUTES
    session_header: HeaderName = "X-Session-Id"
    # Client headers every candidate receives besides content type, accept, request id
    # and the session header; credentials only with a candidate's forward_credentials.
    forward_headers: tuple[HeaderName, ...] = ()
    # Headers a deployment's clients send credentials in besides the well-known ones
    # (_headers.CREDENTIAL_HEADERS): a candidate, mirrored or live, gets them only with
    # forward_credentials, and an upstream with its own api_key never.
    credential_headers: tuple[HeaderName, ...] = ()
    join_timeout_s: float = Field(DEFAULT_JOIN_TIMEOUT_S, gt=0)
    drain_timeout_s: float = Field(DEFAULT_MIRROR_DRAIN_TIMEOUT_S, ge=0)
    sink_capacity: int = Field(DEFAULT_SINK_CAPACITY, gt=0)


class RecordConfig(_Section):
    """A sample of the traffic written to a JSON-lines file that ``understudy load --replay``
    sends again (gateway/_record.py); off unless ``path`` is set. Headers are never
    written; message contents only with ``prompts = true``."""

    path: Path | None = None
    sample_rate: float = Field(1.0, ge=0.0, le=1.0)  # by session: a conversation is whole
    prompts: bool = False
    max_bytes: int = Field(DEFAULT_RECORD_MAX_BYTES, gt=0)  # the file's size bound
    queue_items: int = Field(DEFAULT_RECORD_QUEUE_ITEMS, gt=0)
    queue_bytes: int = Field(DEFAULT_RECORD_QUEUE_BYTES, gt=0)
    drain_timeout_s: float = Field(DEFAULT_RECORD_DRAIN_TIMEOUT_S, ge=0)


class EvaluationConfig(_Section):
    """Scoring of joined exchanges, the store they go to, and the judge's gates."""

    enabled: bool = True
    store: StoreConfig = StoreConfig()
    auto_migrate: bool = True  # run Alembic's upgrade at start (the embedded default)
    scorers: tuple[str, ...] = DEFAULT_SCORERS
    scoring: ScorerConfig = ScorerConfig()
    gates: Gates = Gates()
    max_pending: int = Field(DEFAULT_EVALUATION_PENDING, gt=0)
    drain_timeout_s: float = Field(DEFAULT_EVALUATION_DRAIN_S, ge=0)


class AdminConfig(_Section):
    """The admin REST API's own listener; off unless a port is given."""

    # A token that fails validation must not be echoed into the error message.
    model_config = ConfigDict(frozen=True, extra="forbid", hide_input_in_errors=True)

    host: str = "127.0.0.1"
    port: int | None = Field(None, ge=0, le=65535)
    token: SecretStr | None = None  # also read from UNDERSTUDY_ADMIN_TOKEN
    # How often a replica reads the shared routing state (PostgreSQL also notifies).
    routing_poll_interval_s: float = Field(DEFAULT_ROUTING_POLL_S, gt=0)
    # Each store call of an admin change gets this long; then the change is refused (503).
    store_timeout_s: float = Field(DEFAULT_ADMIN_STORE_TIMEOUT_S, gt=0, le=300)
    # "host" or "host:port" a candidate added through the API may use although it is a
    # refused destination (gateway/_destinations.py: metadata, own ports, service ports).
    allowed_candidate_hosts: tuple[str, ...] = ()
    # PEM files: with both, the admin API serves HTTPS only (gateway/_admin.py rule 1).
    tls_cert_file: FilePath | None = None
    tls_key_file: FilePath | None = None
    # PEM authorities: with one, a client must also show a certificate one of them signed.
    tls_client_ca_file: FilePath | None = None

    @model_validator(mode="after")
    def _tls_files_together(self) -> AdminConfig:
        if (self.tls_cert_file is None) != (self.tls_key_file is None):
            raise ValueError("admin TLS needs both tls_cert_file and tls_key_file")
        if self.tls_client_ca_file is not None and self.tls_cert_file is None:
            raise ValueError("admin tls_client_ca_file needs tls_cert_file and tls_key_file: "
                             "client certificates are asked for over TLS only")
        return self

    @field_validator("token")
    @classmethod
    def _token_or_none(cls, token: SecretStr | None) -> SecretStr | None:
        """An empty or blank token is no token; a short one is refused, never weakened."""
        value = token.get_secret_value().strip() if token is not None else ""
        if not value:
            return None
        if len(value) < MIN_ADMIN_TOKEN_LENGTH:
            raise ValueError(f"admin.token must be at least {MIN_ADMIN_TOKEN_LENGTH} "
                             f"characters, got {len(value)} (an empty token means none)")
        return SecretStr(value)


class GatewayConfig(BaseSettings):
    # Errors name the field and the rule, never the value: it may be a token or a password.
    model_config = SettingsConfigDict(
        env_prefix=ENV_PREFIX, env_nested_delimiter=ENV_NESTED_DELIMITER, frozen=True,
        extra="forbid",
        hide_input_in_errors=True,
    )

    server: ServerConfig = ServerConfig()
    primary: UpstreamConfig = UpstreamConfig()
    capture: CaptureConfig = CaptureConfig()
    mirror: MirrorConfig = MirrorConfig()
    candidates: tuple[CandidateConfig, ...] = Field((), max_length=MAX_CANDIDATES)
    admin: AdminConfig = AdminConfig()
    evaluation: EvaluationConfig = EvaluationConfig()
    record: RecordConfig = RecordConfig()

    @field_validator("candidates")
    @classmethod
    def _unique_names(cls, candidates: tuple[CandidateConfig, ...],
                      info: ValidationInfo) -> tuple[CandidateConfig, ...]:
        names = [c.name for c in candidates]
        if len(names) != len(set(names)):
            raise ValueError(f"candidate names must be unique, got {names}")
        # The store knows a backend by its name: a candidate named as the primary would share
        # its row, and each exchange's two observations would collide (the admin API refuses
        # it with a 409, gateway/_promotion.py). ``primary`` is validated before this field.
        primary = info.data.get("primary")
        if isinstance(primary, UpstreamConfig) and primary.name in names:
            raise ValueError(f"candidate {primary.name!r} has the primary's name; a primary is "
                             "not its own candidate (pick another name)")
        return candidates

    def printable(self) -> dict[str, Any]:
        """The effective settings as JSON values for ``serve --print-config``: every URL
        shown with its password as ``***``, every secret as ``**********``. ``repr`` leaves
        the URLs out, so the primary, the candidates and the store were not shown at all."""
        shown = self.model_dump(mode="json")
        for upstream in (shown["primary"], *shown["candidates"]):
            upstream["url"] = _masked(upstream["url"])
        store = shown["evaluation"]["store"]
        store["url"] = masked_url(store["url"])
        return shown

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        # Highest first; pydantic-settings merges them section by section. The file is the
        # class's ``toml_file`` (none here: load_config binds one); no .env, no secrets dir.
        token = os.environ.get(ADMIN_TOKEN_ENV)
        admin_token = InitSettingsSource(settings_cls, {"admin": {"token": token}} if token else {})
        return (init_settings, admin_token, env_settings, TomlConfigSettingsSource(settings_cls))


def _masked(url: str) -> str:
    """An upstream URL (valid: checked when built) with its password replaced by ``***``."""
    parsed = URL(url)
    return str(parsed.with_password("***")) if parsed.password else url


def load_config(path: Path | None = None, overrides: dict[str, Any] | None = None) -> GatewayConfig:
    """Read ``path`` (TOML), apply the environment, then ``overrides`` (nested dict of flags)."""
    check_environment(os.environ)
    overrides = overrides or {}
    # BaseSettings takes keys such as ``_env_file`` as options of its own, past
    # ``extra="forbid"``: they are unknown keys here like any other.
    options = [key for key in overrides if key.startswith("_")]
    if options:
        raise ValidationError.from_exception_data(
            GatewayConfig.__name__,
            [{"type": "extra_forbidden", "loc": (key,), "input": overrides[key]}
             for key in options],
        )
    if path is None:
        return GatewayConfig(**overrides)
    if not path.is_file():  # the TOML source passes over a missing file; a named one must be
        raise FileNotFoundError(errno.ENOENT, "no such config file", str(path))

    class FileConfig(GatewayConfig):  # pydantic-settings reads the file a class names
        model_config = SettingsConfigDict(toml_file=path, title=GatewayConfig.__name__)

    loaded = FileConfig(**overrides)
    # Validated once, above; handed back as a plain GatewayConfig, so that a config compares,
    # copies and pickles alike whichever file it came from.
    return GatewayConfig.model_construct(loaded.model_fields_set, **dict(loaded))


def check_environment(environ: Mapping[str, str]) -> None:
    """Refuse each ``UNDERSTUDY_*`` variable that names no setting nor ``OTHER_ENVIRONMENT``:
    a ValidationError whose field is the variable, with the known name it is closest to."""
    known = [*_setting_variables(GatewayConfig, ENV_PREFIX), *sorted(OTHER_ENVIRONMENT)]
    # Matched without the prefix, which every name shares and would make anything look close.
    by_suffix = {name.removeprefix(ENV_PREFIX): name for name in known}
    errors: list[Any] = []
    for variable in sorted(environ):
        # pydantic-settings matches names case-insensitively (case_sensitive=False).
        name = variable.upper()
        if not name.startswith(ENV_PREFIX) or name in OTHER_ENVIRONMENT or _names_setting(name):
            continue
        close = difflib.get_close_matches(name.removeprefix(ENV_PREFIX), by_suffix, n=1)
        hint = f"; did you mean {by_suffix[close[0]]}?" if close else ""
        message = PydanticCustomError(
            "unknown_variable", "names no setting{hint}", {"hint": hint})
        errors.append({"type": message, "loc": (variable,), "input": None})
    if errors:
        raise ValidationError.from_exception_data(GatewayConfig.__name__, errors, hide_input=True)


def _names_setting(variable: str) -> bool:
    """Whether pydantic-settings reads ``variable`` (upper case) into GatewayConfig: a section,
    a key of one, or anything below a mapping (its keys are the user's to name)."""
    model: type[BaseModel] | None = GatewayConfig
    for part in variable.removeprefix(ENV_PREFIX).split(ENV_NESTED_DELIMITER):
        if model is None:  # below a value that is not a section
            return False
        fields = {name.upper(): field for name, field in model.model_fields.items()}
        if part not in fields:
            return False
        annotation = fields[part].annotation
        if any(get_origin(kind) in (dict, Mapping) for kind in _kinds(annotation)):
            return True
        model = _section(annotation)
    return True


def _setting_variables(model: type[BaseModel], prefix: str) -> Iterator[str]:
    """Every variable that names a section or a key of ``model``, under ``prefix``."""
    for name, field in model.model_fields.items():
        variable = prefix + name.upper()
        yield variable
        section = _section(field.annotation)
        if section is not None:
            yield from _setting_variables(section, variable + ENV_NESTED_DELIMITER)


def _kinds(annotation: Any) -> tuple[Any, ...]:
    """The members of a union (``X | None``), or the annotation itself."""
    if get_origin(annotation) in (Union, types.UnionType):
        return get_args(annotation)
    return (annotation,)


def _section(annotation: Any) -> type[BaseModel] | None:
    """The model a field holds (its one model, if a union with None), or None for a value."""
    models = [kind for kind in _kinds(annotation)
              if isinstance(kind, type) and issubclass(kind, BaseModel)]
    return models[0] if len(models) == 1 else None


_CANDIDATE_FLAG_KEYS = {
    "rate": "sample_rate", "unit": "sampling_unit", "concurrency": "max_concurrency",
    "model": "model", "credentials": "forward_credentials",
}


def parse_candidate_flag(text: str) -> dict[str, Any]:
    """``NAME=URL[,rate=R][,unit=request|session][,concurrency=N][,model=M]`` as a dict.

    A refusal never quotes the text: its URL may hold a password (``http://user:pw@host``),
    and a ``,`` in the password splits it into what reads as options."""
    head, *options = text.split(",")
    name, sep, url = head.partition("=")
    if not sep or not name or not url:
        raise ValueError("--candidate expects NAME=URL[,rate=R] (a name, '=', then the URL)")
    candidate: dict[str, Any] = {"name": name, "url": url}
    known = ", ".join(_CANDIDATE_FLAG_KEYS)
    for position, option in enumerate(options, start=1):
        key, sep, value = option.partition("=")
        if not sep:
            raise ValueError(f"--candidate option {position} after the URL is not KEY=VALUE "
                             f"(known keys: {known}; a ',' in the URL is written %2C)")
        if key not in _CANDIDATE_FLAG_KEYS:
            raise ValueError(f"unknown --candidate option {position} after the URL (known "
                             f"keys: {known})")
        candidate[_CANDIDATE_FLAG_KEYS[key]] = value
    return candidate

