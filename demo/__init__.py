"""``understudy demo``: the real-model story on one machine (see ``demo._run``).

The exported names load on first use (PEP 562): ``understudy demo --help`` (gateway/cli.py)
imports only the command's module.
"""

import typing

from gateway.lazy_exports import lazy_exports as _lazy_exports

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


__getattr__, __dir__ = _lazy_exports(__name__, _EXPORTED_FROM)
