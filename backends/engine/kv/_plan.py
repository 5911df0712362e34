"""A KV plan: which codec stores each layer's keys and each layer's values.

    {"layers": [{"k": "kivi-4", "v": "kivi-2"}, {"k": "fp8", "v": "fp8"}, ...]}

Rules
-----
1. A plan names one served codec (``ENGINE_CODECS``) per layer for K and one for V; it is
   plain data, validated when built: every layer names both roles, every name is served.
2. A uniform plan IS its codec: same name, same fingerprint, same bytes, same tokens as
   ``--kv-codec NAME``.  A plan of fp32 everywhere is the cache without a codec.
3. ``name`` is the codec's for a uniform plan and ``mixed-<digest>`` otherwise, the digest
   taken over the layers' names, so two nodes print the same name for the same plan; the
   fingerprint that decides whether nodes exchange blocks is ``PagedCodec``'s, over the whole
   plan and its calibration (``_paged_codec`` rule 7).
4. The file may carry a ``"meta"`` object (what the planner measured and assumed); it is kept
   for the reader and takes no part in the plan's identity.
5. ``window_tokens`` (default 0) is the recent window kept at full precision for every layer
   and role (``_paged_codec`` rule 9): part of the plan's identity, its name and its bytes.  A
   windowed codec (``WINDOWED_CODECS``: ``e8-2w``, ``kivi-4w``, ``kivi-2w``) IS the uniform plan
   of its base codec with KIVI's 128-token window.
6. ``heavy_tokens`` (default 0) is how many rows of each complete block, per layer and KV head,
   are kept at float16 beside the block's codes: the heavy hitters, the block's highest-attention
   tokens (``_heavy``).  Like the window it is part of the plan's identity (its name, ``+h<n>``
   on a uniform plan), and it is paid in the block's bytes.  It is less than the block size; the
   engine checks that when it builds the plan's codec (the plan does not know the block size);
   ``check_engine`` asks the same of a plan before an engine is built, for a command to refuse it.
7. A plan file is written whole or not at all (``dump``: a temporary file beside it, renamed over
   it), so an interrupted or concurrent ``plan-kv`` never leaves half a plan for an engine to read.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = [
    "ENGINE_CODECS",
    "SERVED_CODECS",
    "WINDOWED_CODECS",
    "WINDOW_TOKENS",
    "KVPlan",
    "LayerCodecs",
    "write_whole",
]

ENGINE_CODECS: tuple[str, ...] = ("fp32", "fp16", "fp8", "kivi-8", "kivi-4", "kivi-2", "e8-2")
"""Codecs a plan may name for one layer's keys or values."""
WINDOW_TOKENS = 128
"""KIVI's full-precision window of recent tokens, the windowed codecs' (rule 5)."""
WINDOWED_CODECS: Mapping[str, str] = {"kivi-4w": "kivi-4", "kivi-2w": "kivi-2", "e8-2w": "e8-2"}
"""Each windowed codec's base codec: the uniform plan of it with a ``WINDOW_TOKENS`` window."""
SERVED_CODECS: tuple[str, ...] = (*ENGINE_CODECS, *WINDOWED_CODECS)
"""What ``--kv-codec`` takes."""


def _served(name: object) -> str:
    if not isinstance(name, str) or name not in ENGINE_CODECS:
        raise ValueError(
            f"the engine does not serve KV codec {name!r} for one layer (served: "
            f"{', '.join(ENGINE_CODECS)}; a window is the plan's, window_tokens)"
        )
    return name


@dataclass(frozen=True, slots=True)
class LayerCodecs:
    """The codecs of one layer: ``key`` stores its keys, ``value`` its values."""

    key: str
    value: str

    def __post_init__(self) -> None:
        _served(self.key)
        _served(self.value)


@dataclass(frozen=True, slots=True)
class KVPlan:
    """A codec per layer and role (see the module comment)."""

    layers: tuple[LayerCodecs, ...]
    meta: Mapping[str, Any] = field(default_factory=dict, compare=False, hash=False)
    window_tokens: int = 0
    heavy_tokens: int = 0

    def __post_init__(self) -> None:
        if not self.layers:
            raise ValueError("a KV plan names at least one layer")
        if not all(isinstance(layer, LayerCodecs) for layer in self.layers):
            raise ValueError("a KV plan's layers are LayerCodecs")
        window = self.window_tokens
        if isinstance(window, bool) or not isinstance(window, int) or window < 0:
            raise ValueError(f"a KV plan's window_tokens is an int >= 0, got {window!r}")
        heavy = self.heavy_tokens
        if isinstance(heavy, bool) or not isinstance(heavy, int) or heavy < 0:
            raise ValueError(f"a KV plan's heavy_tokens is an int >= 0, got {heavy!r}")

    @classmethod
    def uniform(
        cls, name: str, num_layers: int, *, window_tokens: int = 0, heavy_tokens: int = 0
    ) -> KVPlan:
        """``name`` for every layer's keys and values (rule 2); a windowed codec's name gives
        its base codec with ``WINDOW_TOKENS`` (rule 5)."""
        if name in WINDOWED_CODECS:
            name, window_tokens = WINDOWED_CODECS[name], WINDOW_TOKENS
        layers = tuple(LayerCodecs(name, name) for _ in range(num_layers))
        return cls(layers, window_tokens=window_tokens, heavy_tokens=heavy_tokens)

    @classmethod
    def of(cls, keys: Sequence[str], values: Sequence[str]) -> KVPlan:
        if len(keys) != len(values):
            raise ValueError("a KV plan needs a key codec and a value codec per layer")
        return cls(tuple(LayerCodecs(k, v) for k, v in zip(keys, values, strict=True)))

    @classmethod
    def from_dict(cls, data: object) -> KVPlan:
        if not isinstance(data, Mapping) or not isinstance(data.get("layers"), list):
            raise ValueError('a KV plan is an object {"layers": [{"k": NAME, "v": NAME}, ...]}')
        unknown = set(data) - {"layers", "meta", "window_tokens", "heavy_tokens"}
        if unknown:
            raise ValueError(f"unknown KV plan keys: {', '.join(sorted(unknown))}")
        layers = []
        for index, layer in enumerate(data["layers"]):
            if not isinstance(layer, Mapping) or set(layer) != {"k", "v"}:
                raise ValueError(f'layer {index} of the KV plan must be {{"k": NAME, "v": NAME}}')
            layers.append(LayerCodecs(layer["k"], layer["v"]))
        meta = data.get("meta", {})
        if not isinstance(meta, Mapping):
            raise ValueError("a KV plan's meta is an object")
        return cls(
            tuple(layers),
            dict(meta),
            window_tokens=data.get("window_tokens", 0),
            heavy_tokens=data.get("heavy_tokens", 0),
        )

    @classmethod
    def load(cls, path: Path) -> KVPlan:
        """Read a plan file; ``ValueError`` naming the file if it is not one.  Only a regular
        file: a pipe (or ``/dev/stdin``) blocks the read until a writer comes (forever, for an
        engine started with no writer in sight)."""
        try:
            if not path.is_file():
                raise ValueError("not a regular file")
            return cls.from_dict(json.loads(path.read_text()))
        except RecursionError as exc:  # json's parser recurses once per level of nesting
            raise ValueError(f"{path}: not a KV plan: nested too deeply") from exc
        except (OSError, json.JSONDecodeError, ValueError) as exc:
            raise ValueError(f"{path}: not a KV plan: {exc}") from exc

    def check_engine(self, *, num_layers: int, block_size: int) -> None:
        """``ValueError`` unless an engine of ``num_layers`` layers and ``block_size``-token
        blocks can serve this plan: one entry per layer, a window of whole blocks, fewer heavy
        hitters than a block's rows (rules 5 and 6; ``PagedCodec`` asks the same)."""
        if self.num_layers != num_layers:
            raise ValueError(
                f"a KV plan of {self.num_layers} layers for a {num_layers}-layer model"
            )
        if self.window_tokens % block_size:
            raise ValueError(
                f"window_tokens {self.window_tokens} is not a multiple of the engine's "
                f"{block_size}-token block"
            )
        if self.heavy_tokens >= block_size:
            raise ValueError(
                f"heavy_tokens {self.heavy_tokens} is not below the engine's {block_size}-token "
                "block"
            )

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"layers": [{"k": c.key, "v": c.value} for c in self.layers]}
        if self.window_tokens:
            out["window_tokens"] = self.window_tokens
        if self.heavy_tokens:
            out["heavy_tokens"] = self.heavy_tokens
        if self.meta:
            out["meta"] = dict(self.meta)
        return out

    def dump(self, path: Path) -> None:
        """Write the plan to ``path`` whole or not at all (rule 7)."""
        write_whole(path, json.dumps(self.to_dict(), indent=1) + "\n")

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def keys(self) -> tuple[str, ...]:
        return tuple(layer.key for layer in self.layers)

    @property
    def values(self) -> tuple[str, ...]:
        return tuple(layer.value for layer in self.layers)

    @property
    def uniform_codec(self) -> str | None:
        """The one codec of a uniform plan -- a windowed codec's name for its base codec with
        ``WINDOW_TOKENS`` -- None for a mixed one (rules 2, 5 and 6)."""
        names = set(self.keys) | set(self.values)
        if len(names) != 1:
            return None
        name = names.pop()
        heavy = f"+h{self.heavy_tokens}" if self.heavy_tokens else ""
        if not self.window_tokens:
            return name + heavy
        for windowed, base in WINDOWED_CODECS.items():
            if base == name and self.window_tokens == WINDOW_TOKENS:
                return windowed + heavy
        return f"{name}+w{self.window_tokens}{heavy}"

    @property
    def name(self) -> str:
        """The codec's name for a uniform plan, ``mixed-<digest>`` otherwise (rule 3)."""
        uniform = self.uniform_codec
        if uniform is not None:
            return uniform
        text = ";".join(f"{c.key},{c.value}" for c in self.layers)
        if self.window_tokens:
            text += f";window={self.window_tokens}"
        if self.heavy_tokens:
            text += f";heavy={self.heavy_tokens}"
        return "mixed-" + hashlib.sha256(text.encode()).hexdigest()[:8]

    def describe(self) -> str:
        """A short summary: how many layers' keys and values use each codec."""
        counts: dict[str, list[int]] = {}
        for layer in self.layers:
            counts.setdefault(layer.key, [0, 0])[0] += 1
            counts.setdefault(layer.value, [0, 0])[1] += 1
        parts = [f"{name} K{k}/V{v}" for name, (k, v) in sorted(counts.items())]
        return f"{self.name} ({', '.join(parts)})"


def write_whole(path: Path, text: str) -> None:
    """``text`` into ``path`` whole or not at all: written to a temporary file in the same
    directory, flushed to disk and renamed over ``path`` (a rename within a file system is
    atomic), so a reader sees the old file or the new one, and an interrupted writer (Ctrl-C, a
    full disk) leaves the old file as it was and no temporary file behind.  A symbolic link is
    followed: the file it names is replaced, not the link."""
    path = Path(os.path.realpath(path))
    fd, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as file:
            file.write(text)
            file.flush()
            os.fsync(file.fileno())
        try:  # mkstemp's file is its owner's alone; keep the mode of the file it replaces
            mode = os.stat(path).st_mode & 0o777
        except FileNotFoundError:
            mode = 0o644
        os.chmod(temporary, mode)
        os.replace(temporary, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temporary)
        raise
