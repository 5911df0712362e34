"""Which hosts a node pulls KV from: its configured peers, and no one else.

Rules
-----
1. A pull opens a connection to the host and port named in ``kv_transfer_params`` (decode) or
   ``kv_source`` (prefill read-back).  Those come in an HTTP body that anyone who reaches the
   node can send, so a node pulls only from its peers (``--kv-peer``), and a request naming
   another host is refused before any connection is opened: a node is never a client's way to
   reach other hosts or ports (server-side request forgery).
2. A peer is an IP address, an IP network (``10.0.0.0/24``) or a host name.  A named host's IP
   literal is admitted if it is in a network, or is an address a peer's name resolves to (the
   router forwards what a node advertises: the address its KV listener is bound to).  A named
   host that is not an IP literal is admitted only if it is literally a peer's name: a client's
   name is never resolved to be checked, so it cannot resolve one way for the check and
   another for the connection.
3. The default is this host only (``DEFAULT_KV_PEERS``): the nodes of one machine, as the
   demo, the tests and the benchmarks run them.  Nodes on several hosts name each other.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import socket
from collections.abc import Iterable
from dataclasses import dataclass

__all__ = ["PEER_RESOLVE_TIMEOUT_S", "KVPeers", "parse_kv_peers"]

log = logging.getLogger(__name__)

# A peer's name that does not resolve within this admits nothing (this time).
PEER_RESOLVE_TIMEOUT_S = 2.0

_Network = ipaddress.IPv4Network | ipaddress.IPv6Network
_Address = ipaddress.IPv4Address | ipaddress.IPv6Address


def _address(host: str) -> _Address | None:
    try:
        return ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return None


def _name(host: str) -> str:
    return host.strip().rstrip(".").lower()


def parse_kv_peers(peers: Iterable[str]) -> tuple[tuple[_Network, ...], frozenset[str]]:
    """The networks and the host names of ``peers``; ``ValueError`` naming one that is
    neither."""
    networks: list[_Network] = []
    names: set[str] = set()
    for peer in peers:
        text = peer.strip()
        try:
            networks.append(ipaddress.ip_network(text.strip("[]"), strict=False))
            continue
        except ValueError:
            pass
        name = _name(text)
        labels = name.split(".")
        if not name or not all(
            0 < len(label) <= 63
            and label.replace("-", "").replace("_", "").isalnum()
            and not label.startswith("-")
            and not label.endswith("-")
            for label in labels
        ):
            raise ValueError(
                f"KV peer {peer!r} is not an IP address, an IP network or a host name"
            )
        names.add(name)
    return tuple(networks), frozenset(names)


@dataclass(frozen=True, slots=True)
class KVPeers:
    """The hosts a node pulls KV from (rule 2)."""

    peers: tuple[str, ...]
    networks: tuple[_Network, ...]
    names: frozenset[str]

    @classmethod
    def of(cls, peers: Iterable[str]) -> KVPeers:
        listed = tuple(peers)
        networks, names = parse_kv_peers(listed)
        return cls(listed, networks, names)

    def describe(self) -> str:
        return ", ".join(self.peers)

    async def admits(self, host: str) -> bool:
        """Whether a pull may connect to ``host`` (rule 2)."""
        address = _address(host)
        if address is None:
            return _name(host) in self.names
        if any(address in network for network in self.networks):
            return True
        for name in self.names:
            if address in await _resolve(name):
                return True
        return False


async def _resolve(name: str) -> set[_Address]:
    """The addresses ``name`` resolves to now (none if it does not, in time)."""
    loop = asyncio.get_running_loop()
    try:
        async with asyncio.timeout(PEER_RESOLVE_TIMEOUT_S):
            infos = await loop.getaddrinfo(name, None, type=socket.SOCK_STREAM)
    except (OSError, TimeoutError) as exc:
        log.info("KV peer %s does not resolve: %s", name, exc)
        return set()
    found: set[_Address] = set()
    for *_, sockaddr in infos:
        address = _address(str(sockaddr[0]).split("%")[0])
        if address is not None:
            found.add(address)
    return found
