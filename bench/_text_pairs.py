"""bench/score.py's agreement pairs: real English prose made into primary/candidate answers.

The prose is the docstrings of the running interpreter's standard library (long ones, at
least ``MIN_WORDS`` words, joined within a module up to ``LONG_WORDS``), so the pairs
are the same on every machine with the same Python and nothing is downloaded. Each pair
is one of ``KINDS`` at one of three lengths: a sentence, three sentences, a passage.
The fixed 60 pairs of tests/evaluators/data/real_text_pairs.json are added as they are.
"""

from __future__ import annotations

import ast
import json
import random
import re
import sysconfig
from pathlib import Path
from typing import Any

MIN_WORDS = 40
LONG_WORDS = 180
SEED = 15
KINDS = ("tail", "reorder", "drop", "edit10", "edit30", "paraphrase", "same_source",
         "unrelated")
CLOSE_KINDS = frozenset({"tail", "reorder", "drop", "edit10", "edit30", "paraphrase"})
"""Where a judge's decisions fall: the candidate says mostly what the primary said."""
LENGTHS = {"sentence": 1, "three sentences": 3, "passage": 0}  # 0: the whole passage
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+")
# Words of technical prose and a synonym each: a paraphrase that keeps the meaning.
_SYNONYMS = {
    "function": "routine", "returns": "gives back", "return": "give back",
    "create": "make", "object": "instance", "file": "document", "list": "sequence",
    "value": "quantity", "values": "quantities", "error": "failure", "used": "employed",
    "default": "standard", "specified": "given", "string": "text", "argument": "parameter",
    "arguments": "parameters", "method": "procedure", "new": "fresh", "first": "initial",
    "data": "information", "name": "label", "called": "invoked", "number": "count",
    "raise": "throw", "raised": "thrown", "if": "when", "must": "has to", "can": "may",
    "contains": "holds", "get": "obtain", "read": "load", "write": "store", "all": "every",
    "only": "solely", "also": "too", "type": "kind", "result": "outcome", "remove": "delete",
    "add": "append", "check": "verify", "empty": "blank", "current": "present",
    "next": "following", "given": "supplied", "path": "location", "directory": "folder",
    "output": "result", "character": "symbol", "line": "row", "lines": "rows",
}


def _passages() -> dict[str, list[str]]:
    """Each stdlib module's long docstrings, whitespace collapsed."""
    found: dict[str, list[str]] = {}
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py")):
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError):
            continue
        texts = [" ".join(doc.split()) for node in ast.walk(tree)
                 if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef
                               | ast.AsyncFunctionDef)
                 and (doc := ast.get_docstring(node)) and len(doc.split()) >= MIN_WORDS]
        if len(texts) >= 3:
            found[path.stem] = texts
    return found


def _sentences(text: str) -> list[str]:
    return [s for s in _SENTENCE_END.split(text) if s]


def _paraphrase(text: str) -> str:
    words = text.split()
    for i, word in enumerate(words):
        bare = word.lower().strip(".,;:()")
        if bare in _SYNONYMS:
            words[i] = word.lower().replace(bare, _SYNONYMS[bare])
    return " ".join(words)


def _candidate(kind: str, primary: str, rng: random.Random, module: list[str],
               other: list[str]) -> str | None:
    """The candidate's answer, or None where the kind does not apply (reordering or
    dropping sentences of a one-sentence answer)."""
    words, sentences = primary.split(), _sentences(primary)
    if kind == "tail":
        cut = rng.randint(len(words) // 3, max(len(words) // 3, 2 * len(words) // 3))
        return " ".join(words[:cut] + rng.choice(other).split()[:len(words) - cut])
    if kind in ("reorder", "drop") and len(sentences) < 2:
        return None
    if kind == "reorder":
        rng.shuffle(sentences)
        return " ".join(sentences)
    if kind == "drop":
        sentences.pop(rng.randrange(len(sentences)))
        return " ".join(sentences)
    if kind in ("edit10", "edit30"):
        share = int(kind.removeprefix("edit")) / 100
        vocabulary = " ".join(other).split()
        for i in rng.sample(range(len(words)), max(1, int(len(words) * share))):
            words[i] = rng.choice(vocabulary)
        return " ".join(words)
    if kind == "paraphrase":
        return _paraphrase(primary)
    if kind == "same_source":
        return rng.choice([t for t in module if t != primary] or other)
    return rng.choice(other)  # unrelated


def _cut(text: str, sentences: int) -> str:
    if sentences == 0:
        return " ".join(text.split()[:LONG_WORDS])
    return " ".join(_sentences(text)[:sentences])


def text_pairs(count: int, fixed: Path) -> list[dict[str, Any]]:
    """About ``count`` generated pairs (kinds and lengths in turn; identical pairs and
    kinds that do not apply are left out), then the fixed ones."""
    passages = _passages()
    modules = sorted(passages)
    rng = random.Random(SEED)
    pairs: list[dict[str, Any]] = []
    for n in range(count):
        kind = KINDS[n % len(KINDS)]
        length, sentences = list(LENGTHS.items())[(n // len(KINDS)) % len(LENGTHS)]
        module = passages[rng.choice(modules)]
        primary = rng.choice(module)
        while sentences == 0 and len(primary.split()) < LONG_WORDS:
            primary += " " + rng.choice(module)
        primary = _cut(primary, sentences)
        other = passages[rng.choice(modules)]
        candidate = _candidate(kind, primary, rng, module, other)
        if candidate is not None and (candidate := _cut(candidate, sentences)) != primary:
            pairs.append({"kind": kind, "length": length, "primary": primary,
                          "candidate": candidate})
    for p in json.loads(fixed.read_text())["pairs"]:
        pairs.append({"kind": p["kind"], "length": "fixed", "primary": p["primary"],
                      "candidate": p["candidate"]})
    return pairs
