"""Weight products: the few-rows path gives bitwise the rows of the many-rows path.

Synthetic weights of the model's shapes; no model is loaded.
"""

from __future__ import annotations

import gc
import threading
import time

import numpy as np
import pytest
from threadpoolctl import threadpool_info, threadpool_limits

from backends.engine.model._lanes import RowLanes, rows_are_independent, summed_product
from backends.engine.model._linear import (
    FEW_ROWS,
    TILE,
    LinearPlan,
    TileWorkers,
    blas_threads,
    packed_k_blocks,
)

SHAPES = [(576, 960), (576, 576), (576, 3072), (1536, 576), (576, 49152 // 16)]


def _skylakex() -> bool:
    kernels = {
        info.get("architecture")
        for info in threadpool_info()
        if info.get("internal_api") == "openblas"
    }
    return bool(kernels & {"SkylakeX", "Cooperlake", "SapphireRapids"})


def test_k_blocks_follow_openblas_blocking() -> None:
    assert packed_k_blocks(64) == (0, 64)
    assert packed_k_blocks(448) == (0, 448)
    assert packed_k_blocks(576) == (0, 288, 576)
    assert packed_k_blocks(900) == (0, 448, 688, 900)
    assert packed_k_blocks(1536) == (0, 448, 896, 1216, 1536)


@pytest.mark.parametrize(("inner", "cols"), SHAPES)
def test_few_rows_equal_rows_of_a_large_product(inner: int, cols: int) -> None:
    rng = np.random.default_rng(inner * cols)
    weight = rng.standard_normal((inner, cols), dtype=np.float32) * np.float32(0.05)
    plan = LinearPlan.for_weight(weight)
    if _skylakex():
        assert plan.path == "tiled"
    if not rows_are_independent(plan, weight):  # Haswell: the engine lane-maps every product
        plan = plan.with_lanes(RowLanes())
    large = rng.standard_normal((100, inner), dtype=np.float32)
    expected = plan(large, weight)
    if plan.path != "lanes":
        assert expected.tobytes() == (large @ weight).tobytes()
    np.testing.assert_allclose(expected, large @ weight, rtol=1e-4, atol=1e-4)
    for rows in range(4, FEW_ROWS + 1):
        for start in (0, 100 - rows):  # first rows of the batch and last ones
            got = plan(np.ascontiguousarray(large[start : start + rows]), weight)
            assert got.tobytes() == expected[start : start + rows].tobytes(), (rows, start)


@pytest.mark.parametrize(("inner", "cols"), SHAPES)
def test_lane_mapped_rows_do_not_depend_on_their_batch(inner: int, cols: int) -> None:
    """The path kept for kernels that break row independence keeps it on every kernel."""
    rng = np.random.default_rng(inner + 3 * cols)
    weight = rng.standard_normal((inner, cols), dtype=np.float32)
    x = rng.standard_normal((300, inner), dtype=np.float32)
    workers = TileWorkers(3)
    with threadpool_limits(limits=1, user_api="blas"):  # as the engine runs lane-mapped
        lanes = RowLanes(workers)
        assert rows_are_independent(lanes.matmul, weight)
        whole = lanes.matmul(x, weight)
        np.testing.assert_allclose(whole, x @ weight, rtol=1e-4, atol=1e-3)
        for lo, hi in ((0, 1), (5, 9), (17, 130), (299, 300), (100, 300)):
            assert lanes.matmul(x[lo:hi], weight).tobytes() == whole[lo:hi].tobytes(), (lo, hi)
        workers.close()  # the same parts, on the caller alone: the same bits
        assert lanes.matmul(x[5:9], weight).tobytes() == whole[5:9].tobytes()


@pytest.mark.parametrize(("inner", "cols"), [(64, 16), (16, 64), (144, 64), (64, 144), (1, 8)])
def test_summed_product_rows_do_not_depend_on_their_batch(inner: int, cols: int) -> None:
    """``_lanes`` rule 6: the product of attention's own blocks, BLAS-free, adds its terms by
    halving; a row's bits are the same alone, padded or in any batch, and near ``x @ w``."""
    rng = np.random.default_rng(7 * inner + cols)
    weight = rng.standard_normal((inner, cols), dtype=np.float32)
    x = rng.standard_normal((48, inner), dtype=np.float32)
    whole = summed_product(x, weight)
    assert whole.dtype == np.float32 and whole.shape == (48, cols)
    np.testing.assert_allclose(whole, x @ weight, rtol=1e-4, atol=1e-4)
    assert rows_are_independent(summed_product, weight)
    for lo, hi in ((0, 1), (3, 7), (47, 48), (10, 42)):
        assert summed_product(x[lo:hi], weight).tobytes() == whole[lo:hi].tobytes(), (lo, hi)
    halves = x[:, :, None] * weight[None]  # the order written out for the first row and column
    terms = list(halves[0, :, 0])
    while len(terms) > 1:
        half = len(terms) // 2
        pairs = [np.float32(terms[i] + terms[half + i]) for i in range(half)]
        terms = pairs + terms[2 * half :]
    assert terms[0].tobytes() == whole[0, 0].tobytes()


def test_columns_are_shared_only_with_one_blas_thread() -> None:
    workers = TileWorkers(2)
    try:
        with threadpool_limits(limits=2, user_api="blas"), pytest.raises(ValueError):
            RowLanes(workers)
    finally:
        workers.close()


def test_widths_off_the_tile_take_the_plain_product() -> None:
    rng = np.random.default_rng(7)
    weight = rng.standard_normal((576, TILE + 36), dtype=np.float32)
    x = rng.standard_normal((5, 576), dtype=np.float32)
    plan = LinearPlan.for_weight(weight)
    assert not plan.few_rows_tiled
    assert plan(x, weight).tobytes() == (x @ weight).tobytes()


def _tile_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("understudy-tiles")]


@pytest.mark.parametrize(("inner", "cols"), SHAPES)
def test_tiles_shared_among_threads_give_the_same_bits(inner: int, cols: int) -> None:
    rng = np.random.default_rng(inner + cols)
    weight = rng.standard_normal((inner, cols), dtype=np.float32) * np.float32(0.05)
    plan = LinearPlan.for_weight(weight)
    x = rng.standard_normal((FEW_ROWS, inner), dtype=np.float32)
    for threads in (2, 3, 7):
        workers = TileWorkers(threads)
        try:
            for rows in (4, 5, FEW_ROWS):
                alone = plan(x[:rows], weight)
                shared = plan(x[:rows], weight, workers)
                assert shared.tobytes() == alone.tobytes(), (threads, rows)
        finally:
            workers.close()


def test_more_threads_than_tiles_give_the_same_bits() -> None:
    rng = np.random.default_rng(3)
    weight = rng.standard_normal((64, 2 * TILE), dtype=np.float32)
    x = rng.standard_normal((4, 64), dtype=np.float32)
    workers = TileWorkers(5)
    try:
        plan = LinearPlan.for_weight(weight)
        assert plan(x, weight, workers).tobytes() == plan(x, weight).tobytes()
    finally:
        workers.close()


def test_a_failing_share_is_raised_after_every_share_finished() -> None:
    done: list[tuple[int, int]] = []

    def work(first: int, last: int) -> None:
        if first == 0:
            raise RuntimeError("share failed")
        time.sleep(0.05)
        done.append((first, last))

    workers = TileWorkers(2)
    try:
        with pytest.raises(RuntimeError, match="share failed"):
            workers.run(work, 4)
        assert done == [(2, 4)]
    finally:
        workers.close()


def test_decode_threads_follow_the_blas_threads() -> None:
    with threadpool_limits(limits=1, user_api="blas"):
        assert blas_threads() == 1
    with threadpool_limits(limits=2, user_api="blas"):
        assert blas_threads() == 2
    with pytest.raises(ValueError, match="decode threads"):
        TileWorkers(0)


def test_one_thread_starts_no_pool_and_pools_stop() -> None:
    before = len(_tile_threads())
    TileWorkers(1).run(lambda first, last: None, 8)
    assert len(_tile_threads()) == before
    closed = TileWorkers(3)
    closed.run(lambda first, last: time.sleep(0.01), 9)
    closed.close()
    closed.close()
    dropped = TileWorkers(3)
    dropped.run(lambda first, last: time.sleep(0.01), 9)
    del dropped
    gc.collect()
    deadline = time.monotonic() + 5
    while len(_tile_threads()) > before and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(_tile_threads()) == before
