"""``understudy demo``: the real-model story on one machine (see ``demo._run``).

The exported names load on first use (PEP 562): ``understudy demo --help`` (gateway/cli.py)
imports only the command's module.
"""

import importlib
import typing

if typing.TYPE_CHECKING:
    from demo._cli import demo_command
    from demo._run import run_demo
    from demo._scorecard import CandidateCard, Scorecard
    from demo._spec import DemoSpec

__all__ = ["CandidateCard", "DemoSpec", "Scorecard", "demo_command", "run_demo"]

_EXPORTED_FROM = {
    "CandidateCard": "demo._scorecard",
    "DemoSpec": "demo._spec",
    "Scorecard": "demo._scorecard",
    "demo_command": "demo._cli",
    "run_demo": "demo._run",
}


def __getattr__(name: str) -> object:
    module = _EXPORTED_FROM.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # loaded once: later look-ups do not come here
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
