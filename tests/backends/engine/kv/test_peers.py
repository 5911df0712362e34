"""Which hosts a node pulls KV from (``kv._peers``): its peers, and no host a client names."""

from __future__ import annotations

import pytest

from backends.engine.kv._peers import KVPeers, parse_kv_peers
from backends.engine.serving._server_config import DEFAULT_KV_PEERS


@pytest.mark.parametrize(
    "host", ["127.0.0.1", "127.3.4.5", "::1", "[::1]", "0.0.0.0", "::", "localhost", "LocalHost."]
)
async def test_the_default_admits_this_host(host: str) -> None:
    assert await KVPeers.of(DEFAULT_KV_PEERS).admits(host)


@pytest.mark.parametrize(
    "host",
    [
        "169.254.169.254",  # a cloud's metadata service
        "10.0.0.5",
        "192.168.1.1",
        "203.0.113.7",
        "::ffff:10.0.0.5",
        "metadata.google.internal",
        "127.1",  # resolves to loopback, but a client's name is never resolved to be checked
        "localhost.evil.example",
        "",
    ],
)
async def test_the_default_refuses_every_other_host(host: str) -> None:
    assert not await KVPeers.of(DEFAULT_KV_PEERS).admits(host)


async def test_networks_addresses_and_names() -> None:
    peers = KVPeers.of(["10.0.0.0/24", "192.168.7.9", "kv-prefill"])
    assert await peers.admits("10.0.0.200")
    assert not await peers.admits("10.0.1.1")
    assert await peers.admits("192.168.7.9") and not await peers.admits("192.168.7.10")
    assert await peers.admits("kv-prefill") and not await peers.admits("kv-decode")
    assert not await peers.admits("127.0.0.1")  # a list given replaces the default


async def test_an_address_a_peers_name_resolves_to_is_admitted() -> None:
    # A node advertises the address its KV listener is bound to, not the name it was given.
    peers = KVPeers.of(["localhost"])
    assert await peers.admits("127.0.0.1")
    assert not await peers.admits("10.0.0.1")
    assert not await KVPeers.of(["unresolvable.invalid"]).admits("127.0.0.1")


@pytest.mark.parametrize("peer", ["http://10.0.0.1", "10.0.0.1:8351", "a b", "", "-x-.", "x" * 64])
def test_a_peer_that_is_no_address_network_or_name_is_refused(peer: str) -> None:
    with pytest.raises(ValueError, match="is not an IP address, an IP network or a host name"):
        parse_kv_peers([peer])
