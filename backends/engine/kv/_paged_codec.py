"""A KV codec applied to the paged cache: complete blocks encoded, read back decoded.

Rules
-----
1. ``fp32`` is today's cache and takes no part here: the engine holds no ``PagedCodec`` for it,
   so its code path is exactly the one without codecs.
2. A block is encoded, layer by layer, the moment its last position is written (``seal``): the
   forward pass that completes it encodes it before attention reads it, so every query after it
   -- in the same prefill call or any later one -- reads the same decoded block.  The encoded
   bytes are the block's content from then on: what the prefix cache reuses, retention holds,
   ``export`` packs for another node and ``load`` decodes from one.
3. The attention-sink token (position 0, the first row of a sequence's first block) is kept raw
   beside its block's codes and written back over the decoded row.
4. The codes are all the pool keeps of a complete block; the float32 rows attention reads come
   from ``_coded_store``'s bounded cache of decoded blocks (a miss decodes again, to the same
   bits).  A query's own block, still being filled, is read raw (KIVI's full-precision residual
   group); ``_attention`` keeps the rows of one prefill tile independent of which blocks their
   neighbours see.
5. Sizes are measured from the encoded arrays (``kv.codecs`` rule 3): ``block_bytes`` is one
   complete block, all layers, K and V; a first block adds ``sink_bytes``.
6. Every array a codec returns for a block has a shape and dtype fixed by the block's shape (the
   codec tests hold every codec to it), so a packed block is a plain concatenation, unpacked by
   the schema measured when the codec is built.
7. ``fingerprint`` names the codec -- for a mixed plan (``_plan``) every layer's key and value
   codec -- and the calibration constants: nodes exchange blocks only when theirs agree, and the
   prefix-cache hash chain of a codec starts from it.  A uniform plan has its codec's.
8. A plan gives each layer and role its own codec, so each layer has its own schema and size;
   a packed block is the layers' blobs in order, each its K arrays then its V arrays.
9. A plan's recent window (``window_tokens``, a multiple of the block size; the windowed codecs
   ``e8-2w``, ``kivi-4w``, ``kivi-2w`` have KIVI's 128) is read raw: a query in block ``b``
   reads blocks ``b - window_blocks + 1 .. b`` raw, the rest decoded, so the most recent
   ``window_tokens - block_size + 1`` to ``window_tokens`` tokens are at full precision and a
   block is quantized as it leaves the window.  Without a window ``window_blocks`` is 1: the own
   block.  The window, the block being filled among it, is held at float16 (``_coded_store``
   rule 8: rows are rounded to float16 when written, so what a block encodes and what a window
   reads are the same however the work was split).  A sealed block keeps those rows
   (``window_bytes``, float16, all layers, K and V) while it is in a window, and only them: its
   codes are a function of those rows (encoding is deterministic, ``kv.codecs`` rule 2), so
   ``seal(keep=False)`` returns the decoded rows without keeping the codes, ``encode_rows``
   makes them again from the rows -- kept when the rows are dropped (the block left every
   window), or for one read of the decoded block, or for an export -- and every way gives the
   same bytes.  A packed block carries its rows when it holds them (with its codes, made for
   the export), so a node pulling a conversation gets its window as it was held, and
   ``release_codes`` drops the codes of such a block again where the rows are kept.
10. A plan's heavy hitters (``heavy_tokens`` = ``h``, ``_plan`` rule 6): when a block is sealed
   each layer keeps, per KV head, the ``h`` rows ``_heavy`` chooses from the query of the
   block's last position (``seal``'s ``query``) and the block's raw keys, at float16, beside
   its codes; decoding writes them over the decoded rows (the sink after them).  They are part
   of the layer's blob -- codes, then the K rows [kv_heads, h, head_dim], the V rows and the
   positions (uint8 [kv_heads, h]) -- so ``layer_bytes``, ``block_bytes``, the packed block, the
   transfer's size checks and every count of bytes include them, and the choice, made from what
   the block's hash covers, is the block's content as much as its codes are.  A block held as
   window rows only (rule 9) keeps its choice (``choice_bytes``, the positions of every layer)
   until its codes are made: ``encode_rows`` takes the rows from the choice, not a new query.
11. ``seal`` is two steps: ``encode_layer`` computes a layer's codes, heavy-hitter choice and
   decoded rows from its arguments alone (it reads the codecs and the schema, writes nothing),
   and ``keep_sealed`` does the bookkeeping (codes or choice kept, sink row held).  So the
   blocks one forward pass completes at a layer -- one per running sequence at a decode step
   -- are encoded on the model's decode threads at once (``_coded_store.seal``), and the
   bytes do not depend on which thread encoded which block.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from ._heavy import MAX_BLOCK_ROWS, heavy_hitters
from ._plan import ENGINE_CODECS, SERVED_CODECS, KVPlan
from .codecs import EncodedBlock, KVCodec, Role, codec_by_name

__all__ = ["ENGINE_CODECS", "SERVED_CODECS", "PagedCodec", "SealedLayer"]

Float32Array = npt.NDArray[np.float32]
UInt8Array = npt.NDArray[np.uint8]

_ROLES: tuple[Role, Role] = ("key", "value")
_PROBE_SEED = 14
_HALF_MAX = float(np.finfo(np.float16).max)


@dataclass(frozen=True, slots=True)
class SealedLayer:
    """One layer of a complete block, encoded and read back (``PagedCodec.encode_layer``)."""

    blob: bytes
    """The layer's codes and heavy-hitter rows, as kept (rule 10)."""
    chosen: bytes
    """The heavy-hitter choice (uint8 [kv_heads, h]; empty without heavy hitters)."""
    sink: Float32Array | None
    """A first block's raw sink rows, K and V [2, kv_heads, head_dim] (rule 3)."""
    keys_t: Float32Array
    values: Float32Array


@dataclass(frozen=True, slots=True)
class _Part:
    """One array of an encoded layer and role: its shape, dtype and, counted once (a block's
    decode reads six of them), its element count and bytes."""

    shape: tuple[int, ...]
    dtype: np.dtype[Any]
    count: int
    nbytes: int


def _part(array: npt.NDArray[Any]) -> _Part:
    count = math.prod(array.shape)
    return _Part(array.shape, array.dtype, count, count * array.dtype.itemsize)


def _parts(block: EncodedBlock) -> tuple[_Part, _Part, _Part]:
    return _part(block.codes), _part(block.scales), _part(block.zeros)


class PagedCodec:
    """A codec per layer and role over blocks of ``block_size`` tokens, and the encoded blocks."""

    __slots__ = (
        "_choices",
        "_encoded",
        "_schema",
        "_sinks",
        "block_bytes",
        "block_size",
        "choice_bytes",
        "codecs",
        "fingerprint",
        "head_dim",
        "heavy_tokens",
        "kv_heads",
        "layer_bytes",
        "name",
        "plan",
        "sink_bytes",
        "window_blocks",
        "window_bytes",
    )

    def __init__(
        self,
        codec: str | KVPlan,
        *,
        num_layers: int,
        kv_heads: int,
        head_dim: int,
        block_size: int,
        key_means: Sequence[Float32Array] | None = None,
        key_scales: Sequence[Float32Array] | None = None,
    ) -> None:
        """``codec``: one served codec for every layer and role, or a plan (rule 8)."""
        if isinstance(codec, str):
            if codec not in SERVED_CODECS:
                raise ValueError(
                    f"the engine does not serve KV codec {codec!r} (served: "
                    f"{', '.join(SERVED_CODECS)})"
                )
            codec = KVPlan.uniform(codec, num_layers)
        if codec.window_tokens % block_size:
            raise ValueError(
                f"a KV window of {codec.window_tokens} tokens is not a multiple of the "
                f"{block_size}-token block"
            )
        if codec.heavy_tokens and not codec.heavy_tokens < block_size <= MAX_BLOCK_ROWS:
            raise ValueError(
                f"{codec.heavy_tokens} heavy-hitter tokens of a {block_size}-token block (fewer "
                f"than the block, blocks of at most {MAX_BLOCK_ROWS})"
            )
        if codec.num_layers != num_layers:
            raise ValueError(
                f"a KV plan of {codec.num_layers} layers for a {num_layers}-layer model"
            )
        if set(codec.keys) | set(codec.values) == {"fp32"}:
            raise ValueError("fp32 is the cache without a codec (no PagedCodec)")
        self.plan = codec
        self.name = codec.name
        self.block_size = block_size
        self.kv_heads = kv_heads
        self.head_dim = head_dim
        built: dict[tuple[int, str], KVCodec] = {}
        for layer, names in enumerate(codec.layers):
            for name in (names.key, names.value):
                built[layer, name] = codec_by_name(
                    name,
                    layer=layer,
                    key_mean=None if key_means is None else key_means[layer],
                    key_scale=None if key_scales is None else key_scales[layer],
                    windowed=codec.window_tokens > 0,
                )
        self.codecs: list[tuple[KVCodec, KVCodec]] = [
            (built[layer, names.key], built[layer, names.value])
            for layer, names in enumerate(codec.layers)
        ]
        uniform = codec.uniform_codec
        if uniform is not None:
            digest = hashlib.sha256(b"understudy.kv-codec.v1\x00" + uniform.encode() + b"\x00")
        else:
            digest = hashlib.sha256(b"understudy.kv-plan.v1\x00")
            for names in codec.layers:
                digest.update(f"{names.key},{names.value};".encode())
            if codec.window_tokens or codec.heavy_tokens:
                digest.update(f"window={codec.window_tokens};heavy={codec.heavy_tokens};".encode())
            digest.update(b"\x00")
        for constants in (key_means, key_scales):
            for array in constants or ():
                digest.update(np.ascontiguousarray(array, dtype="<f4").tobytes())
            digest.update(b"\x01")
        self.fingerprint = digest.digest()
        probe = np.random.default_rng(_PROBE_SEED).standard_normal(
            (block_size, kv_heads, head_dim), dtype=np.float32
        )
        schemas: dict[tuple[str, Role], tuple[_Part, _Part, _Part]] = {}
        self._schema: list[list[tuple[_Part, _Part, _Part]]] = []
        for pair in self.codecs:
            layer_schema = []
            for role, role_codec in zip(_ROLES, pair, strict=True):
                if (role_codec.name, role) not in schemas:
                    schemas[role_codec.name, role] = _parts(role_codec.encode(probe, role))
                layer_schema.append(schemas[role_codec.name, role])
            self._schema.append(layer_schema)
        self.heavy_tokens = codec.heavy_tokens
        heavy_bytes = kv_heads * self.heavy_tokens * (2 * head_dim * 2 + 1)  # rule 10
        self.layer_bytes = [
            sum(part.nbytes for parts in layer_schema for part in parts) + heavy_bytes
            for layer_schema in self._schema
        ]
        self.block_bytes = sum(self.layer_bytes)
        self.sink_bytes = num_layers * 2 * kv_heads * head_dim * 4
        self.window_blocks = max(1, codec.window_tokens // block_size)
        self.window_bytes = self.sink_bytes * block_size // 2 if codec.window_tokens else 0
        self.choice_bytes = num_layers * kv_heads * self.heavy_tokens  # rule 10, all layers
        self._encoded: dict[int, list[bytes]] = {}
        self._choices: dict[int, list[bytes]] = {}
        self._sinks: dict[int, Float32Array] = {}

    @property
    def num_layers(self) -> int:
        return len(self.codecs)

    def bytes_per_token(self) -> float:
        """True bytes of a complete block per token, all layers, K and V."""
        return self.block_bytes / self.block_size

    def context_bits_per_element(self, tokens: int) -> float:
        """True bits per element the cache holds for one sequence of ``tokens`` tokens: the codes
        of its complete blocks out of its window, its sink row, and the raw rows of the block
        being filled and of the complete blocks in its window (rule 9: float16 under a window,
        else float32; a window's complete blocks hold their heavy-hitter choice, not codes),
        over every layer's K and V."""
        complete = tokens // self.block_size
        windowed = min(complete, self.window_blocks - 1)
        row_bytes = self.window_bytes or self.sink_bytes * self.block_size
        held = (
            (complete - windowed) * self.block_bytes
            + windowed * self.choice_bytes
            + self.sink_bytes
            + (1 + windowed) * row_bytes
        )
        return 8.0 * held / (tokens * self.sink_bytes // 4)

    def packed_bytes(self, first: bool, window: bool = False) -> int:
        """Bytes of a packed block (``export``): a first block carries its raw sink row, a block
        in a window its raw rows (rule 9)."""
        return self.block_bytes + (self.sink_bytes if first else 0) + (self.window_bytes * window)

    @property
    def packed_sizes(self) -> tuple[int, ...]:
        """Every size a packed block of this codec may have."""
        both = (False, True)
        return tuple(sorted({self.packed_bytes(f, w) for w in both for f in both}))

    # -- one layer of one block ------------------------------------------------------------

    def seal(
        self,
        layer: int,
        block: int,
        keys_t: Float32Array,
        values: Float32Array,
        first: bool,
        query: Float32Array | None = None,
        *,
        keep: bool = True,
    ) -> tuple[Float32Array, Float32Array]:
        """Encode one layer of a complete block (``keys_t`` [kv_heads, head_dim, block_size],
        ``values`` [kv_heads, block_size, head_dim], as stored); its decoded K^T and V.
        ``query``: [heads, head_dim], the query of the block's last position, which chooses the
        heavy hitters (rule 10; needed only when the plan keeps some).  ``keep=False``: the
        block is held as window rows (rule 9): the codes are not kept, the heavy-hitter choice
        is, for ``encode_rows``.  ``encode_layer`` then ``keep_sealed``, in one call."""
        sealed = self.encode_layer(layer, keys_t, values, first, query)
        return self.keep_sealed(layer, block, sealed, keep=keep)

    def encode_layer(
        self,
        layer: int,
        keys_t: Float32Array,
        values: Float32Array,
        first: bool,
        query: Float32Array | None = None,
    ) -> SealedLayer:
        """``seal``'s work without its bookkeeping (rule 11): the layer's codes, heavy-hitter
        choice and decoded rows, computed from the arguments alone."""
        k = np.ascontiguousarray(keys_t.transpose(2, 0, 1))
        chosen = b""
        if self.heavy_tokens:
            if query is None:
                raise ValueError("sealing a block with heavy hitters needs its last query")
            chosen = heavy_hitters(query, k, self.heavy_tokens, skip_sink=first).tobytes()
        blob = self._blob(layer, k, values, chosen)
        sink = np.stack([k[0], values[:, 0]]) if first else None
        keys_read, values_read = self._decode_layer(layer, blob, sink)
        return SealedLayer(blob, chosen, sink, keys_read, values_read)

    def keep_sealed(
        self, layer: int, block: int, sealed: SealedLayer, *, keep: bool = True
    ) -> tuple[Float32Array, Float32Array]:
        """Hold what ``encode_layer`` made as ``block``'s layer (``seal``'s ``keep``); its
        decoded K^T and V."""
        if keep:
            self._store(layer, block, sealed.blob)
        else:
            choices = self._choices.get(block)
            if choices is None or len(choices) != self.num_layers:
                choices = self._choices[block] = [b""] * self.num_layers
            choices[layer] = sealed.chosen
        if sealed.sink is not None:
            sink = self._sinks.setdefault(
                block, np.zeros((self.num_layers, 2, self.kv_heads, self.head_dim), np.float32)
            )
            sink[layer] = sealed.sink
        elif layer == 0:
            self._sinks.pop(block, None)
        return sealed.keys_t, sealed.values

    def _blob(self, layer: int, k: Float32Array, values: Float32Array, chosen: bytes) -> bytes:
        """One layer's codes of a block (``k`` [block_size, kv_heads, head_dim], ``values`` as
        stored), with the heavy hitters ``chosen`` (uint8 [kv_heads, h] bytes, rule 10)."""
        v = np.ascontiguousarray(values.transpose(1, 0, 2))
        blobs = []
        for x, role, codec in zip((k, v), _ROLES, self.codecs[layer], strict=True):
            encoded = codec.encode(x, role)
            blobs += [encoded.codes.tobytes(), encoded.scales.tobytes(), encoded.zeros.tobytes()]
        if self.heavy_tokens:
            positions = np.frombuffer(chosen, dtype=np.uint8).reshape(self.kv_heads, -1)
            heads = np.arange(self.kv_heads)[:, None]
            for x in (k, v):
                rows = np.clip(x[positions, heads], -_HALF_MAX, _HALF_MAX)
                blobs.append(rows.astype("<f2").tobytes())
            blobs.append(chosen)
        return b"".join(blobs)

    def _store(self, layer: int, block: int, blob: bytes) -> None:
        layers = self._encoded.get(block)
        if layers is None or len(layers) != self.num_layers:
            layers = self._encoded[block] = [b""] * self.num_layers
        layers[layer] = blob

    def encode_rows(
        self, layer: int, block: int, keys_t: Float32Array, values: Float32Array, *, store: bool
    ) -> bytes:
        """The codes of one layer of a block sealed with ``keep=False`` (rule 9), from its window
        rows (as ``seal`` takes them) and the heavy-hitter choice made at seal: the bytes
        ``seal`` would have kept.  ``store``: keep them (the rows are being dropped)."""
        chosen = b""
        if self.heavy_tokens:
            choices = self._choices.get(block)
            chosen = choices[layer] if choices else b""
            if not chosen:  # kept meanwhile (an export off the engine thread): the same bytes
                return self.export_layer(layer, block)
        k = np.ascontiguousarray(keys_t.transpose(2, 0, 1))
        blob = self._blob(layer, k, values, chosen)
        if store:
            self._store(layer, block, blob)
            choices = self._choices.get(block)
            if choices is not None:  # the kept codes hold the choice now
                choices[layer] = b""
                if not any(choices):
                    del self._choices[block]
        return blob

    def decode_blob(self, layer: int, block: int, blob: bytes) -> tuple[Float32Array, Float32Array]:
        """One layer of ``block`` decoded from codes ``encode_rows`` made (its sink written
        over), as ``decode_block_layer`` decodes kept codes."""
        return self._decode_layer(layer, blob, self._layer_sink(layer, block))

    def release_codes(self, block: int) -> None:
        """Drop a loaded block's codes, keeping its heavy-hitter choice: its window rows are
        held instead (rule 9)."""
        layers = self._encoded.pop(block, None)
        if layers is not None and self.heavy_tokens:
            size = self.kv_heads * self.heavy_tokens
            self._choices[block] = [blob[len(blob) - size :] for blob in layers]

    def _layer_sink(self, layer: int, block: int) -> Float32Array | None:
        """``block``'s raw sink row at ``layer`` [2, kv_heads, head_dim], if it holds one."""
        sink = self._sinks.get(block)
        return None if sink is None else sink[layer]

    def _decode_layer(
        self, layer: int, blob: bytes, sink: Float32Array | None
    ) -> tuple[Float32Array, Float32Array]:
        """One layer's codes decoded, its heavy hitters and ``sink`` (K and V rows, [2,
        kv_heads, head_dim]) written over; reads nothing else of the codec's state."""
        shape = (self.block_size, self.kv_heads, self.head_dim)
        offset = 0
        out = []
        for role, parts, codec in zip(_ROLES, self._schema[layer], self.codecs[layer], strict=True):
            arrays = []
            for part in parts:
                array = np.frombuffer(blob, dtype=part.dtype, count=part.count, offset=offset)
                arrays.append(array.reshape(part.shape))
                offset += part.nbytes
            encoded = EncodedBlock(codec.name, role, shape, arrays[0], arrays[1], arrays[2])
            decoded = np.ascontiguousarray(codec.decode(encoded), dtype=np.float32)
            # fp32 in a plan decodes to a view of the stored bytes; the sink is written over it.
            out.append(decoded if decoded.flags.writeable else decoded.copy())
        k, v = out
        if self.heavy_tokens:  # rule 10
            h, heads = self.heavy_tokens, np.arange(self.kv_heads)[:, None]
            size = self.kv_heads * h * self.head_dim
            rows = np.frombuffer(blob, dtype="<f2", count=2 * size, offset=offset)
            chosen = np.frombuffer(
                blob, dtype=np.uint8, count=self.kv_heads * h, offset=offset + 4 * size
            ).reshape(self.kv_heads, h)
            if int(chosen.max()) >= self.block_size:
                raise ValueError(f"a heavy-hitter position beyond the {self.block_size}-row block")
            k[chosen, heads] = rows[:size].reshape(self.kv_heads, h, self.head_dim)
            v[chosen, heads] = rows[size:].reshape(self.kv_heads, h, self.head_dim)
        if sink is not None:
            k[0] = sink[0]
            v[0] = sink[1]
        keys_t = np.ascontiguousarray(k.transpose(1, 2, 0))
        return keys_t, np.ascontiguousarray(v.transpose(1, 0, 2))

    def has_layer(self, layer: int, block: int) -> bool:
        """Whether ``block`` holds codes for ``layer``."""
        layers = self._encoded.get(block)
        return layers is not None and len(layers) > layer and bool(layers[layer])

    def export_layer(self, layer: int, block: int) -> bytes:
        """One layer's kept codes of ``block`` (``KeyError`` if it has none)."""
        blob = self._encoded[block][layer]
        if not blob:
            raise KeyError(f"block {block} layer {layer} has not been encoded")
        return blob

    def decode_block_layer(self, layer: int, block: int) -> tuple[Float32Array, Float32Array]:
        """One layer of a sealed block decoded again: the bits ``seal`` returned (decoding is
        deterministic), as K^T [kv_heads, head_dim, block_size] and V."""
        layers = self._encoded[block]
        return self._decode_layer(layer, layers[layer], self._layer_sink(layer, block))

    def forget(self, block: int) -> None:
        """Drop ``block``'s codes, heavy-hitter choice and sink row (it is handed out again)."""
        self._encoded.pop(block, None)
        self._choices.pop(block, None)
        self._sinks.pop(block, None)

    def sink_blocks(self) -> list[int]:
        """The first blocks holding a raw sink row now."""
        return list(self._sinks)

    @property
    def resident_bytes(self) -> int:
        """Bytes of codes, held heavy-hitter choices and sink rows now."""
        codes = sum(len(blob) for layers in self._encoded.values() for blob in layers)
        choices = sum(len(chosen) for layers in self._choices.values() for chosen in layers)
        return codes + choices + len(self._sinks) * self.sink_bytes

    # -- whole blocks (prefix cache, retention, transfer) ----------------------------------

    def export(
        self, block: int, window_rows: bytes = b"", codes: Sequence[bytes] | None = None
    ) -> UInt8Array:
        """The packed block: every layer's K and V arrays, then the raw sink row if first, then
        ``window_rows`` (``window_bytes`` of raw rows, rule 9, or none).  ``codes``: every
        layer's, made by ``encode_rows`` for a block held as rows (None: the kept ones)."""
        if window_rows and len(window_rows) != self.window_bytes:
            raise ValueError(f"window rows of {len(window_rows)} bytes, not {self.window_bytes}")
        layers = self._encoded.get(block) if codes is None else list(codes)
        if layers is None or len(layers) != self.num_layers or not all(layers):
            raise KeyError(f"block {block} has not been encoded")
        parts = [*layers]
        sink = self._sinks.get(block)
        if sink is not None:
            parts.append(sink.astype("<f4").tobytes())
        return np.frombuffer(b"".join([*parts, window_rows]), dtype=np.uint8)

    def load(
        self, block: int, packed: UInt8Array, first: bool
    ) -> list[tuple[Float32Array, Float32Array]]:
        """Take a packed block as ``block``'s content; every layer's decoded K^T and V.

        ``ValueError`` if its size is not this codec's (for a first block or not) or it decodes
        to non-finite values.  The raw window rows a packed block may carry after its codes and
        sink (rule 9) are the caller's (``_coded_store``): they are not looked at here."""
        data = np.ascontiguousarray(packed, dtype=np.uint8).tobytes()
        sizes = sorted({self.packed_bytes(first), self.packed_bytes(first, True)})
        if len(data) not in sizes:
            raise ValueError(
                f"a packed {self.name} block of {len(data)} bytes, expected "
                f"{' or '.join(map(str, sizes))}"
            )
        ends = np.cumsum(self.layer_bytes).tolist()
        layers = [data[end - size : end] for end, size in zip(ends, self.layer_bytes, strict=True)]
        self._encoded[block] = layers
        if first:
            count = self.sink_bytes // 4
            sink = np.frombuffer(data, dtype="<f4", count=count, offset=self.block_bytes)
            self._sinks[block] = sink.reshape(
                self.num_layers, 2, self.kv_heads, self.head_dim
            ).astype(np.float32)
        else:
            self._sinks.pop(block, None)
        decoded = [
            self._decode_layer(layer, blob, self._layer_sink(layer, block))
            for layer, blob in enumerate(layers)
        ]
        for k, v in decoded:
            if not (np.isfinite(k).all() and np.isfinite(v).all()):
                raise ValueError(f"a packed {self.name} block decodes to non-finite values")
        return decoded
