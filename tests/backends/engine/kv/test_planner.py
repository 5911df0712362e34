"""The planner's dynamic program against brute force, its table and cache, and the cost model's
verdicts on synthetic rates."""

from __future__ import annotations

import itertools
from pathlib import Path

import numpy as np
import pytest

from backends.engine.kv._costmodel import CostCalibration, estimate_step
from backends.engine.kv._paged_codec import PagedCodec
from backends.engine.kv._plan import KVPlan
from backends.engine.kv._planner import (
    SensitivityTable,
    calibration_digest,
    choose,
    heavy_bytes_per_token,
    heavy_row_bytes,
    plan_bytes_per_token,
    plan_for_budget,
    split_budget,
    window_bytes_per_token,
)


def _brute_force(weights: list[list[int]], losses: list[list[float]], budget: int) -> float | None:
    best = None
    for combo in itertools.product(*(range(len(row)) for row in weights)):
        if sum(weights[i][c] for i, c in enumerate(combo)) > budget:
            continue
        loss = sum(losses[i][c] for i, c in enumerate(combo))
        best = loss if best is None else min(best, loss)
    return best


@pytest.mark.parametrize("seed", range(12))
def test_choose_is_brute_force_on_small_tables(seed: int) -> None:
    rng = np.random.default_rng(seed)
    items, options = int(rng.integers(1, 6)), int(rng.integers(1, 5))
    # Byte-like weights with a common divisor, losses falling with the bytes (like codecs) or not.
    weights = [[int(w) * 6 for w in rng.integers(1, 40, options)] for _ in range(items)]
    losses = [[float(x) for x in rng.random(options)] for _ in range(items)]
    for budget in (0, *rng.integers(0, 6 * 40 * items, 8), 10**6):
        chosen = choose(weights, losses, int(budget))
        expected = _brute_force(weights, losses, int(budget))
        if expected is None:
            assert chosen is None
            continue
        assert chosen is not None
        assert sum(weights[i][c] for i, c in enumerate(chosen)) <= budget
        assert sum(losses[i][c] for i, c in enumerate(chosen)) == pytest.approx(expected)


def test_the_budget_goes_where_the_loss_is() -> None:
    # Per cell: 4 units at no loss, 2 at a small loss, 1 at a large one; layer 1 suffers most.
    layers = 3
    loss = np.zeros((layers, 2, 3))
    loss[:, :, 1], loss[:, :, 2] = 0.01, 0.1
    loss[1, :, 2] = 1.0
    weights = [[400, 200, 100]] * (2 * layers)
    losses = [[float(x) for x in loss[layer, role]] for layer in range(layers) for role in (0, 1)]
    chosen = choose(weights, losses, 4 * 100 + 2 * 200)  # two cells above the cheapest
    assert chosen == [2, 2, 1, 1, 2, 2]
    assert choose(weights, losses, 6 * 100 - 1) is None


def test_plan_for_budget_on_served_codecs(tmp_path: Path) -> None:
    loss = np.zeros((2, 2, 2))
    loss[:, :, 1] = [[0.5, 0.1], [0.2, 0.3]]
    sizes = np.array([[6144, 2304], [6144, 1920]], dtype=np.int64)
    table = SensitivityTable(("fp16", "kivi-4"), loss, sizes, block_size=16, settings={"x": 1})
    budget = (6144 + 1920 + 2304 + 1920) / 16
    plan = plan_for_budget(table, budget)
    assert plan == KVPlan.of(["fp16", "kivi-4"], ["kivi-4", "kivi-4"])
    assert table.bytes_per_token(plan) == budget
    assert table.predicted_loss(plan) == pytest.approx(0.1 + 0.2 + 0.3)
    assert plan_for_budget(table, 4 * 1900 / 16) is None
    path = tmp_path / "table.json"
    table.save(path)
    again = SensitivityTable.cached(path, {"x": 1})
    assert again is not None and np.array_equal(again.loss, table.loss)
    assert SensitivityTable.cached(path, {"x": 2}) is None
    assert SensitivityTable.cached(tmp_path / "missing.json", {"x": 1}) is None


def test_a_table_is_keyed_by_the_calibration_it_was_measured_under() -> None:
    rng = np.random.default_rng(0)
    means = [rng.standard_normal((3, 64)).astype(np.float32) for _ in range(2)]
    scales = [rng.standard_normal((3, 64, 64)).astype(np.float32) for _ in range(2)]
    digest = calibration_digest((means, scales))
    assert digest == calibration_digest(([m.copy() for m in means], [s.copy() for s in scales]))
    nudged = [m.copy() for m in means]
    nudged[1][2, 5] = np.nextafter(nudged[1][2, 5], np.float32(np.inf))
    assert calibration_digest((nudged, scales)) != digest


def _costs(dequant: float = 0.0) -> CostCalibration:
    return CostCalibration(
        weight_bytes=500 << 20,
        parameters=125 << 20,
        weight_bytes_per_s=20e9,
        flops_per_s=100e9,
        kv_bytes_per_s=20e9,
        dequant_s_per_token_layer={"fp32": 0.0, "kivi-2": dequant},
        num_layers=30,
        num_heads=9,
        kv_heads=3,
        head_dim=64,
    )


def test_the_cost_model_names_each_bound() -> None:
    costs = _costs()
    fp32_bytes = 30 * 2 * 3 * 64 * 4
    assert estimate_step(costs, "fp32", fp32_bytes, 1, 256).bound == "weights"
    assert estimate_step(costs, "fp32", fp32_bytes, 64, 32768).bound == "kv"
    assert estimate_step(costs, "fp32", fp32_bytes, 4096, 16).bound == "compute"
    # A smaller KV moves a KV-bound step off KV reads; a costly dequant makes it compute-bound.
    assert estimate_step(costs, "kivi-2", fp32_bytes / 16, 64, 32768).bound != "kv"
    slow = estimate_step(_costs(dequant=1e-6), "kivi-2", fp32_bytes / 16, 64, 32768)
    assert slow.bound == "compute" and slow.dequant_s > slow.kv_s
    mixed = KVPlan.of(["fp32"] * 30, ["kivi-2"] * 30)
    half = estimate_step(_costs(dequant=1e-6), mixed, fp32_bytes / 2, 1, 1000)
    assert half.dequant_s == pytest.approx(1000 * 30 * 1e-6 / 2)


def _kivi4(
    layers: int, heads: int, dim: int, bs: int, *, window: int = 0, heavy: int = 0
) -> PagedCodec:
    """kivi-4 on every layer of a small layout, with a raw window and heavy hitters."""
    plan = KVPlan.uniform("kivi-4", layers, window_tokens=window, heavy_tokens=heavy)
    return PagedCodec(plan, num_layers=layers, kv_heads=heads, head_dim=dim, block_size=bs)


def test_a_window_is_priced_as_the_engine_holds_it_and_split_from_one_budget() -> None:
    """The window's bytes per token at a context are the engine's own count (the difference
    between a windowed and a plain plan's bits at that context: its float16 rows less the codes
    its complete blocks do not hold, heavy hitters or not), and each window's plan gets what
    the window leaves of one budget over the tokens whose codes are held."""
    layers, heads, dim, bs = 2, 3, 64, 16
    raw_block = layers * 2 * heads * dim * bs * 2  # float16 rows
    elements = layers * 2 * heads * dim
    for context in (20, 40, 48, 417, 1536):
        for window, heavy in ((32, 0), (128, 0), (64, 2)):
            plain = _kivi4(layers, heads, dim, bs, heavy=heavy)
            windowed = _kivi4(layers, heads, dim, bs, window=window, heavy=heavy)
            extra_bits = windowed.context_bits_per_element(
                context
            ) - plain.context_bits_per_element(context)
            priced = window_bytes_per_token(
                window,
                context,
                bs,
                raw_block,
                code_block_bytes=plain.block_bytes,
                choice_bytes=windowed.choice_bytes,
            )
            assert priced == pytest.approx(extra_bits * elements / 8)
    assert window_bytes_per_token(0, 417, bs, raw_block, code_block_bytes=4224) == 0.0
    # 2 blocks held raw at float16 and not as codes, less the half of a plain codec's float32
    # block being filled
    assert (
        window_bytes_per_token(128, 40, bs, raw_block, code_block_bytes=4224)
        == (raw_block - 2 * 4224) / 40
    )
    loss = np.zeros((layers, 2, 2))
    loss[:, :, 1] = 0.1
    sizes = np.array([[6144, 2304], [6144, 1920]], dtype=np.int64)
    table = SensitivityTable(("fp16", "kivi-4"), loss, sizes, block_size=bs)
    budget = 2 * (6144 + 6144) / bs + 512
    plans = split_budget(table, budget, context_tokens=48, raw_block_bytes=raw_block)
    # At 48 tokens a 32-token window holds one of the three complete blocks as rows (no codes),
    # and 64 or 128 all three: fp16 everywhere fits each.
    assert [plan.window_tokens for plan in plans] == [0, 32, 64, 128]
    assert all(plan.layers == KVPlan.uniform("fp16", layers).layers for plan in plans)
    kivi = KVPlan.uniform("kivi-4", layers)
    budget = table.bytes_per_token(kivi)  # 528: kivi-4 exactly
    tight = split_budget(table, budget, context_tokens=417, raw_block_bytes=raw_block)
    # 32 tokens: one block's codes not held pays for its rows and leaves kivi-4 room (one fp16
    # cell more costs 240); 64 and 128 hold 3 and 7 blocks of rows, more than they save.
    assert [plan.window_tokens for plan in tight] == [0, 32]
    assert all(plan.layers == kivi.layers for plan in tight)
    for plan in tight:
        assert plan_bytes_per_token(table, plan, 417, raw_block, 0, 0) <= budget
    wide = KVPlan.uniform("kivi-4", layers, window_tokens=64)
    assert plan_bytes_per_token(table, wide, 417, raw_block, 0, 0) > budget


def test_heavy_hitters_are_priced_as_the_engine_holds_them_and_split_from_one_budget() -> None:
    """A heavy-hitter count costs what ``PagedCodec`` adds to a block, and each (count, window)
    pair's plan gets what they leave of one budget; a pair that leaves too little is dropped."""
    layers, heads, dim, bs = 2, 3, 64, 16
    row = heavy_row_bytes(layers, heads, dim)
    for heavy in (1, 2, 5):
        plain = PagedCodec("kivi-4", num_layers=layers, kv_heads=heads, head_dim=dim, block_size=bs)
        kept = _kivi4(layers, heads, dim, bs, heavy=heavy)
        extra = kept.bytes_per_token() - plain.bytes_per_token()
        assert heavy_bytes_per_token(heavy, bs, row) == extra
    raw_block = layers * 2 * heads * dim * bs * 2
    loss = np.zeros((layers, 2, 2))
    loss[:, :, 1] = 0.1
    sizes = np.array([[6144, 2304], [6144, 1920]], dtype=np.int64)
    table = SensitivityTable(("fp16", "kivi-4"), loss, sizes, block_size=bs)
    budget = 2 * (2304 + 1920) / bs + 2 * row / bs  # kivi-4 and two heavy rows, exactly
    plans = split_budget(
        table,
        budget,
        context_tokens=48,
        raw_block_bytes=raw_block,
        windows=(0, 32, 64),
        heavies=(0, 2, 3),
        row_bytes=row,
    )
    pairs = [(plan.heavy_tokens, plan.window_tokens) for plan in plans]
    # 64 tokens hold all three complete blocks as two float16 blocks more than a plain codec,
    # more than the whole budget; 3 rows cost one row more than it has without a window.  A
    # 32-token window holds one of the three blocks as rows, not codes (rule 6): its room is
    # 3/2 of the budget, which pays for 3 rows too.
    assert pairs == [(0, 0), (0, 32), (2, 0), (2, 32), (3, 32)]
    for plan in plans:
        assert plan_bytes_per_token(table, plan, 48, raw_block, row, 0) <= budget
        if plan.window_tokens == 0:
            assert plan.layers == KVPlan.uniform("kivi-4", layers).layers
    with pytest.raises(ValueError, match="heavy row"):
        split_budget(table, budget, context_tokens=48, raw_block_bytes=raw_block, heavies=(1,))
