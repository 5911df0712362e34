"""The demo's gateway: ``understudy serve`` in its own process, and how the demo reads it.

Rules:
1. The config is a TOML file the demo writes into its work folder (``gateway_config``): the
   embedded store (SQLite in that folder), the admin API on loopback with a generated
   token, every candidate mirrored whole sessions at rate 1.0, so the noise-floor replica
   runs at the candidates' load and latency is compared at matched load.
2. Prices are one GPU-hour price for every backend: cost follows measured throughput.
   The gates are the defaults but two: ``min_samples`` (the demo's option) and the rates'
   ``max_error_rate_increase``, ``RATE_WORSENING_LIMIT``. A rate passes only where its
   interval rules out a worsening beyond the limit (the judge's rule 1), and a demo's few
   exchanges rule out no less than about 17 points (0 errors in 27 a side; 21 points in
   20): at the default 1 point every rate would be INCONCLUSIVE until ~540 a side.
3. The gateway is read as an operator would: ``/metrics`` (Prometheus text) and the admin
   REST API, never its internals.
"""

from __future__ import annotations

import json
import secrets
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from prometheus_client.parser import text_string_to_metric_families

__all__ = ["GatewayClient", "Samples", "gateway_config", "new_token", "scrape", "total"]

GPU_USD_PER_HOUR: Final = 2.0
"""Rule 2: one price for every backend (an accelerator-hour), so cost is speed."""
RATE_WORSENING_LIMIT: Final = 0.25
"""Rule 2: the most a rate (errors, complete choices, valid JSON) may worsen, absolute: as
close to the default 0.01 as the demo's sample rules out (0.21 at its 20 values a side)."""
HTTP_TIMEOUT_S: Final = 300.0
"""A report judges thousands of values: seconds on a busy machine."""

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]
"""Prometheus samples: (name, sorted labels) -> value."""


def _toml_string(value: str) -> str:
    return json.dumps(value)  # a JSON string is a valid TOML basic string


def gateway_config(*, port: int, admin_port: int, token: str, store_path: Path,
                   primary: tuple[str, str], candidates: Sequence[tuple[str, str, str]],
                   min_samples: int) -> str:
    """Rule 1: the TOML; ``candidates`` are (name, url, role)."""
    lines = [
        "[server]", 'host = "127.0.0.1"', f"port = {port}", "",
        "[primary]", f"name = {_toml_string(primary[0])}", f"url = {_toml_string(primary[1])}",
        "first_byte_timeout_s = 600", "idle_timeout_s = 300", "",
        "[mirror]", "join_timeout_s = 900", "drain_timeout_s = 5", "",
    ]
    for name, url, role in candidates:
        lines += ["[[candidates]]", f"name = {_toml_string(name)}", f"url = {_toml_string(url)}",
                  f"role = {_toml_string(role)}", "sample_rate = 1.0",
                  'sampling_unit = "session"', "max_concurrency = 8",
                  "first_byte_timeout_s = 600", "idle_timeout_s = 300",
                  "request_timeout_s = 900", ""]
    lines += [
        "[evaluation]", "enabled = true", "auto_migrate = true", "",
        "[evaluation.store]",
        f"url = {_toml_string('sqlite+aiosqlite:///' + str(store_path))}", "",
        "[evaluation.gates]", f"min_samples = {min_samples}",
        f"max_error_rate_increase = {RATE_WORSENING_LIMIT}", "",
    ]
    for name in (primary[0], *(c[0] for c in candidates)):
        lines += [f"[evaluation.scoring.prices.{_toml_string(name)}]", 'mode = "gpu_hour"',
                  f"gpu_usd_per_hour = {GPU_USD_PER_HOUR}", ""]
    lines += ["[admin]", 'host = "127.0.0.1"', f"port = {admin_port}",
              f"token = {_toml_string(token)}", ""]
    return "\n".join(lines)


def new_token() -> str:
    return secrets.token_urlsafe(24)


def scrape(url: str) -> Samples:
    """Rule 3: one ``/metrics`` page as samples."""
    with urllib.request.urlopen(url, timeout=10) as answer:
        text = answer.read().decode()
    out: Samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return out


def total(samples: Samples, name: str, **labels: str) -> float:
    """The sum of ``name``'s samples whose labels include ``labels``."""
    want = set(labels.items())
    return sum(v for (n, ls), v in samples.items() if n == name and want <= set(ls))


@dataclass(frozen=True, slots=True)
class GatewayClient:
    """Rule 3: the gateway's root URL and admin API as the operator uses them."""

    url: str
    admin_url: str
    token: str

    def metrics(self) -> Samples:
        return scrape(self.url + "/metrics")

    def admin(self, method: str, path: str, body: Mapping[str, Any] | None = None) -> Any:
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(
            self.admin_url + "/admin/v1" + path, data=data, method=method,
            headers={"Authorization": f"Bearer {self.token}",
                     "Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=HTTP_TIMEOUT_S) as answer:
                return json.load(answer)
        except urllib.error.HTTPError as exc:  # the admin API answers errors in JSON
            try:
                return {"status": exc.code, **json.load(exc)}
            except ValueError:
                return {"status": exc.code, "error": {"message": exc.reason}}
