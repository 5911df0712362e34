"""An engine server's config: one model per role, an option of another role refused."""

from __future__ import annotations

import pytest
from click.testing import CliRunner
from pydantic import ValidationError

from backends.engine import (
    DecodeServerConfig,
    PrefillServerConfig,
    RouterServerConfig,
    UnifiedServerConfig,
    engine_command,
    engine_server_config,
)

NODES = {"prefill_urls": ("http://a",), "decode_urls": ("http://b",)}


def test_the_role_picks_the_model_and_unified_is_the_default() -> None:
    assert isinstance(engine_server_config(), UnifiedServerConfig)
    assert isinstance(engine_server_config(role="prefill"), PrefillServerConfig)
    assert isinstance(engine_server_config(role="decode"), DecodeServerConfig)
    router = engine_server_config(role="router", **NODES)
    assert isinstance(router, RouterServerConfig) and router.decode_urls == ("http://b",)
    with pytest.raises(ValidationError, match="does not match any of the expected tags"):
        engine_server_config(role="encode")


def test_each_kv_node_keeps_blocks_for_its_own_default_time() -> None:
    assert PrefillServerConfig().retain_s == 30.0
    assert DecodeServerConfig().retain_s == 300.0
    assert DecodeServerConfig(kv_retain_s=2.5).retain_s == 2.5


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"prefill_urls": ("http://a",)}, "only the router takes prefill_urls; a unified server"),
        ({"role": "decode", "routing_policy": "affinity"}, "only the router takes routing_policy"),
        ({"role": "router", "kv_codec": "fp8", **NODES},
         "only unified servers, prefill and decode nodes take kv_codec; the router does not"),
        ({"role": "router", "kv_limit_bytes": 1 << 30, **NODES}, "take kv_limit_bytes; the router"),
        ({"kv_port": 1}, "only prefill and decode nodes take kv_port; a unified server does not"),
        ({"role": "decode", "kv_readback_min_tokens": 8},
         "only prefill nodes take kv_readback_min_tokens; a decode node does not"),
        ({"role": "router", "prefill_urls": ("http://a",)}, "at least one prefill and one decode"),
        ({"role": "prefill", "enable_prefix_caching": False}, "through its prefix cache"),
        ({"role": "router", "colour": "red", **NODES}, "Extra inputs are not permitted"),
        ({"role": "router", "kv_peers": ("10.0.0.1",), **NODES},
         "only prefill and decode nodes take kv_peers; the router does not"),
        ({"role": "decode", "node_read_timeout_s": 1.0},
         "only the router takes node_read_timeout_s"),
        ({"role": "decode", "kv_peers": ("http://10.0.0.1",)}, "not an IP address, an IP network"),
        ({"role": "prefill", "kv_peers": ()}, "at least 1 item"),
        ({"role": "prefill", "kv_max_serves": 0}, "greater than or equal to 1"),
        ({"role": "router", "node_read_timeout_s": 0, **NODES}, "greater than 0"),
    ],
)
def test_an_option_the_role_does_not_take_is_refused_by_name(
    options: dict[str, object], message: str
) -> None:
    with pytest.raises(ValidationError, match=message):
        engine_server_config(**options)


def test_the_cli_hands_a_role_only_the_options_given() -> None:
    runner = CliRunner()
    # Defaults of the engine's flags do not reach the router (which would refuse them) ...
    result = runner.invoke(engine_command, ["--role", "router", "--prefill", "http://a"])
    assert result.exit_code == 2 and "prefill and one decode node" in result.output
    # ... but a flag given for another role is refused, not ignored.
    result = runner.invoke(engine_command, ["--role", "unified", "--kv-port", "9"])
    assert result.exit_code == 2 and "only prefill and decode nodes take kv_port" in result.output
    result = runner.invoke(
        engine_command,
        ["--role", "router", "--prefill", "http://a", "--decode", "http://b", "--kv-gib", "2"],
    )
    assert result.exit_code == 2 and "kv_limit_bytes; the router does not" in result.output


def test_kv_nodes_pull_from_this_host_unless_given_peers() -> None:
    assert DecodeServerConfig().kv_peers == ("127.0.0.0/8", "::1", "0.0.0.0", "::", "localhost")
    assert PrefillServerConfig(kv_peers=("kv-decode",)).kv_peers == ("kv-decode",)
    runner = CliRunner()
    result = runner.invoke(
        engine_command, ["--role", "router", "--prefill", "http://a", "--decode", "http://b",
                         "--kv-peer", "10.0.0.1"],
    )  # fmt: skip
    assert result.exit_code == 2 and "only prefill and decode nodes take kv_peers" in result.output
    result = runner.invoke(engine_command, ["--role", "decode", "--kv-peer", "no such host"])
    assert result.exit_code == 2 and "'no such host' is not an IP address" in result.output
