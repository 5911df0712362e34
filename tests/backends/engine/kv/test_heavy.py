"""Heavy hitters: the rows of a block its last query attends to most, kept at float16 beside its
codes and read back over the decoded rows."""

from __future__ import annotations

import numpy as np
import pytest

from backends.engine.kv._heavy import heavy_hitters
from backends.engine.kv._paged_codec import PagedCodec
from backends.engine.kv._plan import KVPlan
from backends.engine.kv.codecs._quality import heavy_bits_per_element, keep_heavy_hitters

from .test_paged_codec import BS, DIM, F32, GROUP, HEADS

LAYERS = 2


def _block(seed: int) -> tuple[F32, F32, F32]:
    """A query [HEADS * GROUP, DIM] and a block's keys and values [BS, HEADS, DIM]."""
    rng = np.random.default_rng(seed)
    query = rng.standard_normal((HEADS * GROUP, DIM), dtype=np.float32) * np.float32(0.125)
    keys = rng.standard_normal((BS, HEADS, DIM), dtype=np.float32)
    values = rng.standard_normal((BS, HEADS, DIM), dtype=np.float32)
    return query, keys, values


def test_the_chosen_rows_are_those_the_query_attends_to_most() -> None:
    """Rows made to align with one head's queries win in that head; the choice is the top of
    the group's summed softmax mass, per KV head, computed here in a plain loop."""
    query, keys, _ = _block(1)
    planted = {0: (3, 11), 1: (7, 8), 2: (1, 15)}
    for head, rows in planted.items():
        direction = query.reshape(HEADS, GROUP, DIM)[head].sum(axis=0)
        for scale, row in zip((6.0, 5.0), rows, strict=True):
            keys[row, head] = direction / np.linalg.norm(direction) * np.float32(scale)
    chosen = heavy_hitters(query, keys, 2, skip_sink=False)
    assert {head: tuple(chosen[head]) for head in range(HEADS)} == planted
    for count in (1, 4, 9):
        chosen = heavy_hitters(query, keys, count, skip_sink=False)
        for head in range(HEADS):
            mass = np.zeros(BS)
            for member in range(GROUP):
                q = query[head * GROUP + member].astype(np.float64)
                scores = [float(q @ keys[row, head].astype(np.float64)) for row in range(BS)]
                weights = np.exp(np.array(scores) - max(scores))
                mass += weights / weights.sum()
            best = sorted(range(BS), key=lambda row: (-mass[row], row))[:count]
            assert list(chosen[head]) == sorted(best)


def test_ties_go_to_the_earlier_row_and_the_sink_is_no_candidate() -> None:
    query, _, _ = _block(2)
    keys = np.zeros((BS, HEADS, DIM), dtype=np.float32)  # every row scores the same
    assert heavy_hitters(query, keys, 3, skip_sink=False).tolist() == [[0, 1, 2]] * HEADS
    assert heavy_hitters(query, keys, 3, skip_sink=True).tolist() == [[1, 2, 3]] * HEADS


@pytest.mark.parametrize(("count", "skip_sink"), [(0, False), (BS + 1, False), (BS, True)])
def test_a_count_the_block_cannot_hold_is_refused(count: int, skip_sink: bool) -> None:
    query, keys, _ = _block(3)
    with pytest.raises(ValueError, match="heavy hitters of a 16-row block"):
        heavy_hitters(query, keys, count, skip_sink=skip_sink)


@pytest.mark.parametrize("base", ["kivi-2", "e8-2", "fp8"])
@pytest.mark.parametrize("first", [False, True])
def test_a_heavy_hitter_row_reads_back_at_float16_over_the_decoded_block(
    base: str, first: bool
) -> None:
    """Sealing keeps the chosen rows; decoding writes them over the codec's rows (the sink row
    after them), through seal, decode again and a packed block loaded by another node."""
    query, keys, values = _block(4)
    keys[5, 1] *= 4.0  # a loud row, far off what a 2-bit codec reproduces
    plan = KVPlan.uniform(base, LAYERS, heavy_tokens=3)
    codec = PagedCodec(plan, num_layers=LAYERS, kv_heads=HEADS, head_dim=DIM, block_size=BS)
    plain = PagedCodec(base, num_layers=LAYERS, kv_heads=HEADS, head_dim=DIM, block_size=BS)
    keys_t = np.ascontiguousarray(keys.transpose(1, 2, 0))
    values_hv = np.ascontiguousarray(values.transpose(1, 0, 2))
    chosen = heavy_hitters(query, keys, 3, skip_sink=first)
    assert 5 in chosen[1]
    plain_k, plain_v = plain.seal(LAYERS - 1, 1, keys_t, values_hv, first)  # as checked below
    with pytest.raises(ValueError, match="last query"):
        codec.seal(0, 1, keys_t, values_hv, first)
    for layer in range(LAYERS):
        sealed = codec.seal(layer, 1, keys_t, values_hv, first, query)
        again = codec.decode_block_layer(layer, 1)
        assert all(np.array_equal(a, b) for a, b in zip(sealed, again, strict=True))
    other = PagedCodec(plan, num_layers=LAYERS, kv_heads=HEADS, head_dim=DIM, block_size=BS)
    loaded = other.load(9, codec.export(1), first)
    for k_t, v in [sealed, loaded[-1]]:
        k = k_t.transpose(2, 0, 1)  # [BS, HEADS, DIM]
        v = v.transpose(1, 0, 2)
        for head in range(HEADS):
            for row in range(BS):
                if first and row == 0:
                    expect_k, expect_v = keys[0, head], values[0, head]  # the raw sink
                elif row in chosen[head]:
                    expect_k = keys[row, head].astype(np.float16).astype(np.float32)
                    expect_v = values[row, head].astype(np.float16).astype(np.float32)
                else:  # the codec's own rows
                    expect_k = plain_k[head, :, row]
                    expect_v = plain_v[head, row]
                assert np.array_equal(k[row, head], expect_k)
                assert np.array_equal(v[row, head], expect_v)


def test_a_packed_block_with_a_position_beyond_the_block_is_refused() -> None:
    query, keys, values = _block(5)
    plan = KVPlan.uniform("kivi-4", 1, heavy_tokens=1)
    codec = PagedCodec(plan, num_layers=1, kv_heads=HEADS, head_dim=DIM, block_size=BS)
    codec.seal(
        0,
        1,
        np.ascontiguousarray(keys.transpose(1, 2, 0)),
        np.ascontiguousarray(values.transpose(1, 0, 2)),
        False,
        query,
    )
    packed = codec.export(1).copy()
    packed[codec.block_bytes - 1] = BS  # the last head's position
    with pytest.raises(ValueError, match="beyond the 16-row block"):
        codec.load(2, packed, False)


def test_the_quality_measure_reads_each_complete_blocks_heavy_hitters_at_float16() -> None:
    """``_quality`` rule 8: the rows the engine would keep, chosen by each complete block's last
    query, replace their round trips; the block being filled and the other rows keep theirs."""
    rng = np.random.default_rng(6)
    tokens = 20 * BS + 5  # blocks past position 255 (positions are stored as uint8)
    q = rng.standard_normal((tokens, HEADS * GROUP, DIM), dtype=np.float32)
    k = rng.standard_normal((tokens, HEADS, DIM), dtype=np.float32)
    v = rng.standard_normal((tokens, HEADS, DIM), dtype=np.float32)
    far = (np.zeros_like(k), np.zeros_like(v))  # a codec that keeps nothing
    keep_heavy_hitters(q, k, v, far, 2, BS)
    kept = np.zeros((tokens, HEADS), dtype=bool)
    for block in range(20):
        rows = slice(block * BS, (block + 1) * BS)
        chosen = heavy_hitters(q[(block + 1) * BS - 1], k[rows], 2, skip_sink=block == 0)
        for head in range(HEADS):
            kept[block * BS + chosen[head].astype(np.intp), head] = True
    assert kept.sum() == 20 * 2 * HEADS and not kept[0].any() and not kept[20 * BS :].any()
    for x, back in zip((k, v), far, strict=True):
        assert np.array_equal(back[kept], x[kept].astype(np.float16).astype(np.float32))
        assert not back[~kept].any()
    assert heavy_bits_per_element(2, DIM, BS) == pytest.approx(
        8 * 2 * HEADS * (2 * DIM * 2 + 1) / (BS * 2 * HEADS * DIM)
    )
