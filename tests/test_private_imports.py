"""No module imports another package's private modules or names.

A name that starts with one underscore (``_store``, ``_fields``) is private to the package it
lives in.  The packages here are ``gateway``, ``evaluators``, ``bench`` and each package directly
under ``backends`` (``backends.engine``, ``backends.sim``, ...): the subpackages of one of them
(``backends.engine.kv``, ``backends.engine.model``) are its internals, split for reading, and
may use each other's private modules.  Tests may reach into the privates of the package they
mirror (``tests/backends/engine`` into ``backends.engine``), nothing else.

Every module's imports are read with ``ast`` (relative imports resolved), so a new violation
anywhere is found; ``backends``, ``gateway``, ``evaluators`` and ``migrations`` are asserted
clean (the evaluators' store is the public ``evaluators.store``).
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
ROOTS = ("backends", "gateway", "evaluators", "workload", "demo", "bench", "tests",
         "migrations")
# Packages whose modules must import no one else's privates (see the module comment).
ASSERTED = ("backends.", "gateway.", "evaluators.", "workload.", "migrations.")


def package_of(module: str) -> str:
    """The package that owns ``module``'s private parts (see the module comment)."""
    parts = module.split(".")
    if parts[0] == "tests":
        parts = parts[1:]  # a test belongs with what it mirrors
    if parts[0] == "backends" and len(parts) > 1:
        return ".".join(parts[:2])
    return parts[0]


def module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imported(path: Path) -> Iterator[tuple[int, str]]:
    """Each dotted name ``path`` imports (a module, or a module's member), with its line."""
    module = module_name(path)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join([*anchor, base]) if base else ".".join(anchor)
            for alias in node.names:
                yield node.lineno, f"{base}.{alias.name}"


def is_private(part: str) -> bool:
    return part.startswith("_") and not part.startswith("__")


def violations() -> list[str]:
    """``file:line: imported`` for each import of another package's private part."""
    found: list[str] = []
    for root in ROOTS:
        for path in sorted((REPO / root).rglob("*.py")):
            importer = module_name(path)
            for line, name in imported(path):
                parts = name.split(".")
                if parts[0] not in ROOTS or not any(is_private(p) for p in parts):
                    continue
                first = next(i for i, p in enumerate(parts) if is_private(p))
                owner = package_of(".".join(parts[: first + 1]))
                if package_of(importer) != owner:
                    found.append(f"{path.relative_to(REPO)}:{line}: {name}")
    return found


def test_the_walk_sees_a_private_import() -> None:
    assert package_of("backends.sim._fields") == "backends.sim"
    assert package_of("backends.engine.kv._store") == "backends.engine"
    assert package_of("tests.backends.engine.kv.test_store") == "backends.engine"
    assert package_of("evaluators._store._routing") == "evaluators"


def test_packages_import_no_other_package_private_modules() -> None:
    asserted = [v for v in violations() if v.replace("/", ".").startswith(ASSERTED)]
    assert asserted == []
