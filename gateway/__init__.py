"""The understudy gateway: forwards to the primary, mirrors to candidates."""

from gateway._app import STATE, build_app, make_admin_runner, make_runner, run, serve
from gateway._config import GatewayConfig, load_config

__all__ = [
    "STATE",
    "GatewayConfig",
    "build_app",
    "load_config",
    "make_admin_runner",
    "make_runner",
    "run",
    "serve",
]
