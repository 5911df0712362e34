"""How this process multiplies: which path keeps rows independent, and a fingerprint of its bits.

Theory of operation -- the promise is checked at load, not assumed
------------------------------------------------------------------
The engine promises that a token's K/V and logits have the same bits whether it is computed in a
one-shot prefill, after a cached prefix, in a chunk, by decode, or beside any other requests of
a batch (``_attention`` rules 1-4).  Rules 1 and 3 ask every product to keep a row's bits
independent of the rows beside it, which OpenBLAS's kernels do or do not do by kernel type.

1. At load every product kind is checked on the model's own weights and on the attention shapes
   (``_lanes.rows_are_independent``).  Where the kernel's own paths pass, they are kept (the
   fast path).  Where any fails, every product is lane-mapped (``_lanes``), which keeps the
   promise on any kernel at the cost of padding lanes, and this process's OpenBLAS is set to
   one thread (the engine's own threads share each product by columns).  The paths chosen
   are checked again, so ``exact`` is measured, not assumed.
2. The choice is logged in one line: the kernel, its threads, each product kind's path, and
   whether the promise holds.
3. Bits are the same across processes only with the same kernel, thread count, numpy and
   OpenBLAS.  ``fingerprint`` hashes the bits of probe products through the chosen paths and of
   numpy's elementwise functions; nodes exchange KV blocks only when their fingerprints agree
   (the KV transfer refuses others and the puller recomputes, counted).
"""

from __future__ import annotations

import functools
import hashlib
import logging
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
from threadpoolctl import threadpool_info, threadpool_limits

from .._arrays import Float32Array
from ..kv._store import DEFAULT_BLOCK_SIZE
from ._attention import KEY_CHUNK, QUERY_TILE, attend
from ._lanes import Product, RowLanes, rows_are_independent
from ._linear import LinearPlan, TileWorkers, blas_threads

__all__ = ["Numerics", "attention_rows_independent", "blas_kernel"]

log = logging.getLogger(__name__)


_PROBE_COLS = 8192  # columns of a wide weight (the logits) that the row check multiplies
_FINGERPRINT_SEED = 20261203


def blas_kernel() -> str:
    """The OpenBLAS kernel type numpy runs with (``OPENBLAS_CORETYPE`` forces another)."""
    kernels = sorted(  # numpy and scipy each load an OpenBLAS; both pick the same kernel
        {
            str(info.get("architecture"))
            for info in threadpool_info()
            if info.get("internal_api") == "openblas"
        }
    )
    return "+".join(kernels) or "unknown"


@dataclass(frozen=True, slots=True)
class Numerics:
    """The product paths a model runs with and what they promise (see the module notes)."""

    kernel: str
    threads: int
    """Threads the engine computes with (OpenBLAS's own count at load)."""
    plans: Mapping[str, LinearPlan]
    """One plan per weight kind."""
    attention_lanes: RowLanes | None
    """Lane-mapped attention products, or None where the kernel's own keep rows independent."""
    exact: bool
    """Whether every path keeps a row's bits independent of its batch (checked)."""
    fingerprint: bytes
    """SHA-256 of the bits these paths produce on fixed probes (rule 3)."""

    @classmethod
    def choose(
        cls,
        weights: Mapping[str, Float32Array],
        head_dim: int,
        workers: TileWorkers,
    ) -> Numerics:
        """Pick and check the product paths for ``weights`` (one layer's, by kind)."""
        threads = blas_threads()
        plans = {kind: LinearPlan.for_weight(weight) for kind, weight in weights.items()}
        lanes: RowLanes | None = None
        if not _independent(plans, weights, None, head_dim, workers):
            # Rule 1: one path for every product.  Rule 5 of ``_lanes``: the engine's threads
            # share a product by columns while OpenBLAS runs each call on one thread.
            threadpool_limits(limits=1, user_api="blas")
            lanes = RowLanes(workers)
            plans = {kind: plan.with_lanes(lanes) for kind, plan in plans.items()}
        numerics = cls(
            kernel=blas_kernel(),
            threads=threads,
            plans=plans,
            attention_lanes=lanes,
            exact=_independent(plans, weights, lanes, head_dim, workers),
            fingerprint=_fingerprint(plans, weights, lanes, head_dim, workers),
        )
        level = logging.INFO if numerics.exact else logging.WARNING
        log.log(level, "%s", numerics.describe())
        return numerics

    def describe(self) -> str:
        """One line: kernel, threads, each product's path, whether the promise holds."""
        paths = ", ".join(f"{kind} {plan.path}" for kind, plan in self.plans.items())
        attention = "lanes" if self.attention_lanes is not None else "native"
        promise = "kept" if self.exact else "NOT kept (rows depend on their batch)"
        return (
            f"engine numerics: OpenBLAS {self.kernel} kernel, {self.threads} threads; "
            f"linear {paths}; attention {attention}; bitwise batch and prefix-reuse "
            f"promise {promise}; fingerprint {self.fingerprint[:6].hex()}"
        )


def _independent(
    plans: Mapping[str, LinearPlan],
    weights: Mapping[str, Float32Array],
    lanes: RowLanes | None,
    head_dim: int,
    workers: TileWorkers,
) -> bool:
    """Whether every product, as these paths run it, keeps rows independent."""
    return all(
        rows_are_independent(
            functools.partial(plans[kind], workers=workers), weights[kind][:, :_PROBE_COLS]
        )
        for kind in plans
    ) and attention_rows_independent(head_dim, lanes)


def _attention_probes(head_dim: int) -> list[Float32Array]:
    """Weights of the attention products' shapes: ``q @ K^T`` over a few tiles, ``P @ V``,
    and a KV codec's own-block corrections (scores over one raw block, its ``P @ V``)."""
    rng = np.random.default_rng(_FINGERPRINT_SEED)
    shapes = [
        (head_dim, 3 * QUERY_TILE),
        (KEY_CHUNK, head_dim),
        (QUERY_TILE, head_dim),
        (head_dim, DEFAULT_BLOCK_SIZE),
        (DEFAULT_BLOCK_SIZE, head_dim),
    ]
    return [rng.standard_normal(shape, dtype=np.float32) for shape in shapes]


def attention_rows_independent(head_dim: int, lanes: RowLanes | None = None) -> bool:
    """Whether the attention products keep rows independent: the kernel's own (``lanes``
    None) or lane-mapped ones."""
    product: Product = np.matmul if lanes is None else lanes.matmul
    return all(rows_are_independent(product, weight) for weight in _attention_probes(head_dim))


def _fingerprint(
    plans: Mapping[str, LinearPlan],
    weights: Mapping[str, Float32Array],
    attention_lanes: RowLanes | None,
    head_dim: int,
    workers: TileWorkers,
) -> bytes:
    """The bits of fixed probes through every path, and of numpy's elementwise functions."""
    rng = np.random.default_rng(_FINGERPRINT_SEED)
    digest = hashlib.sha256()
    for kind, plan in plans.items():
        weight = weights[kind][:, :_PROBE_COLS]
        x = rng.standard_normal((5, weight.shape[0]), dtype=np.float32)
        digest.update(kind.encode())
        digest.update(plan(x, np.ascontiguousarray(weight), workers).tobytes())
    keys = QUERY_TILE + 9
    q = rng.standard_normal((keys, 1, 3, head_dim), dtype=np.float32)
    keys_t = rng.standard_normal((1, head_dim, 2 * QUERY_TILE), dtype=np.float32)
    values = rng.standard_normal((1, 2 * QUERY_TILE, head_dim), dtype=np.float32)
    digest.update(attend(q, 0, keys_t, values, attention_lanes).tobytes())
    ramp32 = np.linspace(-30.0, 30.0, 4099, dtype=np.float32)
    ramp64 = np.linspace(-3.0e5, 3.0e5, 4099, dtype=np.float64)
    for values_out in (np.exp(ramp32), np.sqrt(np.abs(ramp32)), np.cos(ramp64), np.sin(ramp64)):
        digest.update(values_out.tobytes())
    return digest.digest()
