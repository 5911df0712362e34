"""ARCHITECTURE.md's references stay true: every ``path.py:name``, ``path.py:Class.method``
and ``path.c:name`` names a file that exists and a name defined there (issue #11).

A ``.py`` name is a module-level ``def``/``class`` (or a ``def``/``class`` in that class, for
``Class.method``), found with :mod:`ast`; a ``.c`` name is a function definition (the name,
its parameter list, then a body's ``{``, not a prototype's ``;``). A bare ``path.py`` or
``path.c`` mentioned in the map must exist too.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
MAP = ROOT / "ARCHITECTURE.md"

# A repository path ending in .py or .c, then optionally ":" and a dotted name.
_REFERENCE = re.compile(
    r"(?<![\w/.])((?:[A-Za-z_][\w-]*/)*[A-Za-z_][\w-]*\.(?:py|c))\b(?::([A-Za-z_](?:[\w.]*\w)?))?"
)
# The map's every count of references is well above this; fewer means the parse broke.
MIN_NAMED_REFERENCES = 100


def references(text: str) -> list[tuple[str, str | None]]:
    """Every (path, name or None) in ``text``, in order, without repeats."""
    seen: dict[tuple[str, str | None], None] = {}
    for match in _REFERENCE.finditer(text):
        seen[(match.group(1), match.group(2))] = None
    return list(seen)


def _py_defines(source: str, dotted: str) -> bool:
    body: list[ast.stmt] = ast.parse(source).body
    for part in dotted.split("."):
        found = next((node for node in body
                      if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef)
                      and node.name == part), None)
        if found is None:
            return False
        body = found.body if isinstance(found, ast.ClassDef) else []
    return True


def _c_defines(source: str, name: str) -> bool:
    # The return type before the name, on its line or the one above (this repo's style);
    # parameters may span lines; a definition's body follows, a prototype ends with ";".
    definition = re.compile(
        rf"^(?:[A-Za-z_][\w \t*]*[ \t*])?{re.escape(name)}[ \t]*\([^;{{}}]*\)\s*\{{",
        re.MULTILINE)
    return definition.search(source) is not None


def defines(path: Path, name: str) -> bool:
    """Whether ``path`` defines ``name`` as the map means it."""
    source = path.read_text(encoding="utf-8")
    if path.suffix == ".py":
        return _py_defines(source, name)
    return _c_defines(source, name)


MAP_REFERENCES = references(MAP.read_text(encoding="utf-8")) if MAP.exists() else []


def test_map_exists_and_names_enough() -> None:
    assert MAP.exists(), "ARCHITECTURE.md is missing"
    named = [ref for ref in MAP_REFERENCES if ref[1] is not None]
    assert len(named) >= MIN_NAMED_REFERENCES, f"only {len(named)} file:name references parsed"
    assert any(path.endswith(".c") for path, name in named if name), "no C reference parsed"


@pytest.mark.parametrize(("path", "name"), MAP_REFERENCES,
                         ids=[f"{p}:{n}" if n else p for p, n in MAP_REFERENCES])
def test_reference_is_defined(path: str, name: str | None) -> None:
    file = ROOT / path
    assert file.is_file(), f"{path} does not exist"
    if name is not None:
        assert defines(file, name), f"{path} does not define {name}"


def test_checker_refuses_what_is_not_there(tmp_path: Path) -> None:
    """The checks above can fail: names that are absent, nested wrongly or only declared."""
    module = tmp_path / "m.py"
    module.write_text("class A:\n    def f(self) -> None:\n        def inner() -> None: ...\n"
                      "async def g() -> None: ...\nX = 1\n", encoding="utf-8")
    assert defines(module, "A") and defines(module, "A.f") and defines(module, "g")
    assert not defines(module, "f")  # a method is not module-level
    assert not defines(module, "A.g")
    assert not defines(module, "A.f.inner")  # only classes open a scope here
    assert not defines(module, "X")  # an assignment is not a def or class
    c_file = tmp_path / "m.c"
    c_file.write_text("static int later(int x);\n\nstatic int\nearly(int x,\n      int y)\n"
                      "{\n    return later(x) + y;\n}\n", encoding="utf-8")
    assert defines(c_file, "early")
    assert not defines(c_file, "later")  # declared and called, never defined
    assert references("see `a/b.py:C.m`, `x.c:f` and d/e.py.") == [
        ("a/b.py", "C.m"), ("x.c", "f"), ("d/e.py", None)]
