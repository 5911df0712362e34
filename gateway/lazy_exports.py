"""A package's exports loaded on first use (PEP 562), for the packages whose ``__init__``
must stay cheap to import: ``gateway.cli`` lists every ``understudy`` command, and its
``--help`` must not import the app stack, the openai client or the engine first.

A package calls ``lazy_exports(__name__, {name: module})`` and binds the two functions it
returns as its module ``__getattr__`` and ``__dir__``; its ``TYPE_CHECKING`` imports give the
type checker the same names.  A name is imported from its module on first access and kept
in the package's namespace, so later look-ups do not come back here.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Mapping

__all__ = ["lazy_exports"]


def lazy_exports(
    package: str, exported_from: Mapping[str, str]
) -> tuple[Callable[[str], object], Callable[[], list[str]]]:
    """The module ``__getattr__`` and ``__dir__`` of ``package``, which exports each name of
    ``exported_from`` from the module it maps to."""
    namespace = sys.modules[package].__dict__

    def __getattr__(name: str) -> object:
        module = exported_from.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module), name)
        namespace[name] = value
        return value

    def __dir__() -> list[str]:
        return sorted({*namespace, *exported_from})

    return __getattr__, __dir__
