"""The understudy gateway: forwards to the primary, mirrors to candidates.

The exported names load on first use (PEP 562): importing ``gateway.cli`` (every
``understudy`` command) must not import the app stack (evaluators, SQLAlchemy, scipy,
seconds of imports) before a command that needs it runs, nor for ``--help``.
"""

import typing

from gateway.lazy_exports import lazy_exports as _lazy_exports

if typing.TYPE_CHECKING:
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

_EXPORTED_FROM = {
    "STATE": "gateway._app",
    "GatewayConfig": "gateway._config",
    "build_app": "gateway._app",
    "load_config": "gateway._config",
    "make_admin_runner": "gateway._app",
    "make_runner": "gateway._app",
    "run": "gateway._app",
    "serve": "gateway._app",
}


__getattr__, __dir__ = _lazy_exports(__name__, _EXPORTED_FROM)
