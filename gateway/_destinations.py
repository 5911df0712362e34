"""Where the admin API may point a candidate (SSRF), and URLs with their passwords masked.

Rules (DESIGN.md, security defaults; issue 12 item 9):
1. A candidate added through the admin API is refused (422) when its host is, or
   resolves to, a link-local address (169.254.0.0/16, fe80::/10: cloud metadata lives
   there), a known metadata address or name (``METADATA_HOSTS``), or the unspecified
   address; when it is one of the gateway's own listeners (the proxy's and the admin
   API's ports on a loopback, unspecified or the listening address); or when its port is
   a well-known service port (``SERVICE_PORTS``: databases, brokers, caches, ssh), on
   any host: no inference server listens there, and a gateway that posts to one is being
   used to reach it.
2. Any other loopback or private address is allowed: candidates on the same host on an
   ordinary port (the simulator, a local vLLM) are the common case, and a deny list of
   what is dangerous keeps them working without configuration.
3. ``[admin] allowed_candidate_hosts`` lists ``host`` or ``host:port`` entries that rule
   1 does not apply to (an operator who really runs a candidate on port 8500).
4. Candidates from the config file and the command line are the operator's own and are
   not checked.
5. A URL's password never reaches a log, the ``backends`` rows or an admin answer:
   ``masked_url`` replaces it with ``***``.
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket
from collections.abc import Collection

from yarl import URL

__all__ = [
    "METADATA_HOSTS", "SERVICE_PORTS", "RefusedDestination", "check_candidate_url", "masked_url",
]

METADATA_HOSTS = frozenset({
    "metadata.google.internal", "metadata.goog", "metadata", "100.100.100.200",
    "fd00:ec2::254", "169.254.169.254", "169.254.170.2",
})
SERVICE_PORTS = frozenset({
    22, 23, 25, 53, 111, 135, 139, 445, 1883, 2049, 2375, 2376, 2379, 2380, 3306, 4222,
    5432, 5672, 5984, 6379, 6443, 8500, 9000, 9042, 9092, 9200, 9300, 10250, 11211, 15672,
    27017,
})
"""Ports of databases, brokers, caches, orchestrators and remote shells."""
RESOLVE_TIMEOUT_S = 2.0
"""How long the check waits for a name to resolve; a name that does not is let through
(it may be a service not up yet): the mirror then counts its connect failures."""


class RefusedDestination(ValueError):
    """A candidate URL that rule 1 refuses; the message says why."""


def masked_url(url: str) -> str:
    """``url`` with its password, if any, replaced by ``***``."""
    try:
        parsed = URL(url)
    except (ValueError, TypeError):
        return "<invalid url>"
    return str(parsed.with_password("***")) if parsed.password else url


async def check_candidate_url(url: str, *, own_ports: Collection[int],
                              listen_host: str, allowed: Collection[str]) -> None:
    """Raise ``RefusedDestination`` when rule 1 refuses ``url`` (see the module's rules)."""
    parsed = URL(url)
    host = (parsed.host or "").lower().rstrip(".")
    port = parsed.explicit_port or parsed.port or (443 if parsed.scheme == "https" else 80)
    if host in allowed or f"{host}:{port}" in allowed:
        return
    if host in METADATA_HOSTS:
        raise RefusedDestination(f"candidate host {host} is a cloud metadata service")
    if port in SERVICE_PORTS:
        raise RefusedDestination(f"candidate port {port} is a well-known service port, not "
                                 "an inference server's (allow it in [admin] "
                                 "allowed_candidate_hosts)")
    for address in map(_unmapped, await _addresses(host)):
        if address.is_link_local or str(address) in METADATA_HOSTS:
            raise RefusedDestination(f"candidate host {host} is (or resolves to) a "
                                     "link-local or metadata address")
        if address.is_unspecified:
            raise RefusedDestination(f"candidate host {host} is the unspecified address")
        own = address.is_loopback or str(address) == listen_host
        if own and port in own_ports:
            raise RefusedDestination(f"candidate {host}:{port} is the gateway's own listener")


async def _addresses(host: str) -> list[ipaddress.IPv4Address | ipaddress.IPv6Address]:
    try:
        return [ipaddress.ip_address(host.strip("[]"))]
    except ValueError:
        pass
    try:
        async with asyncio.timeout(RESOLVE_TIMEOUT_S):
            infos = await asyncio.get_running_loop().getaddrinfo(host, None,
                                                                 type=socket.SOCK_STREAM)
    except (OSError, TimeoutError):
        return []
    out = []
    for *_, sockaddr in infos:
        try:
            out.append(ipaddress.ip_address(str(sockaddr[0]).split("%")[0]))
        except ValueError:
            continue
    return out


def _unmapped(address: ipaddress.IPv4Address | ipaddress.IPv6Address,
              ) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    """``::ffff:169.254.169.254`` is 169.254.169.254."""
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped
    return address
