"""Weight products: the few-rows path gives bitwise the rows of the many-rows path.

Synthetic weights of the model's shapes; no model is loaded.
"""

from __future__ import annotations

import numpy as np
import pytest
from threadpoolctl import threadpool_info

from backends.engine._linear import FEW_ROWS, TILE, LinearPlan, packed_k_blocks

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
        assert plan.few_rows_tiled
    large = rng.standard_normal((100, inner), dtype=np.float32)
    expected = plan(large, weight)
    assert expected.tobytes() == (large @ weight).tobytes()
    for rows in range(4, FEW_ROWS + 1):
        got = plan(np.ascontiguousarray(large[:rows]), weight)
        assert got.tobytes() == expected[:rows].tobytes(), rows


def test_widths_off_the_tile_take_the_plain_product() -> None:
    rng = np.random.default_rng(7)
    weight = rng.standard_normal((576, TILE + 36), dtype=np.float32)
    x = rng.standard_normal((5, 576), dtype=np.float32)
    plan = LinearPlan.for_weight(weight)
    assert not plan.few_rows_tiled
    assert plan(x, weight).tobytes() == (x @ weight).tobytes()
