"""The E8 codebook search in C (``_e8core.c``) gives the codes of the numpy rule it replaced.

``e8_reference`` holds that rule as numpy computed it; every row here must get the same code
from both, and the same nearest lattice points: Gaussian rows from well inside the ball to far
outside it, rows that sit on ties (zeros, half-integers, lattice and codebook points), extreme
scales, the real model's keys and values as the codec hands them over, and bad input.
"""

from __future__ import annotations

from types import ModuleType

import numpy as np
import numpy.typing as npt
import pytest

from backends.engine import LlamaModel
from backends.engine.kv.codecs import Role, _e8core, codec_by_name
from backends.engine.kv.codecs._codec import EncodedBlock
from backends.engine.kv.codecs._e8 import (
    CODEBOOK_NORM2,
    CODEBOOK_SIZE,
    DESCENT_STEPS,
    SHRINK,
    e8_codebook,
    nearest_d8,
    nearest_e8,
    nearest_in_codebook_brute_force,
)
from backends.engine.kv.codecs._e8_codec import (
    _SCALE_CUTS,
    SCALE_LEVELS,
    E8Codec,
    _block_levels,
    _block_scaled_codes,
    _level_pairs,
    _token_scales,
    _transformed,
    hadamard_transform,
)
from backends.engine.kv.codecs._e8builds import BUILDS
from backends.engine.kv.codecs._quality import calibrate, capture_kv
from backends.engine.kv.codecs._texts import CALIBRATION_TEXTS

from .e8_reference import (
    reference_codes,
    reference_hadamard,
    reference_nearest_d8,
    reference_nearest_e8,
)

Float64Array = npt.NDArray[np.float64]


def assert_same_codes(x: Float64Array) -> None:
    book = e8_codebook()
    codes = book.encode(x)
    assert codes.dtype == np.uint16 and codes.shape == (x.shape[0],)
    np.testing.assert_array_equal(codes.astype(np.int64), reference_codes(x, book))
    np.testing.assert_array_equal(nearest_e8(x), reference_nearest_e8(x))
    np.testing.assert_array_equal(nearest_d8(x), reference_nearest_d8(x))


def test_constants_are_the_rules() -> None:
    assert CODEBOOK_NORM2 == 10 and DESCENT_STEPS == 4
    assert SHRINK == (0.9, 1.0 - 1.0 / np.sqrt(10.0))
    assert _e8core.CODEBOOK_SIZE == CODEBOOK_SIZE == len(e8_codebook())


@pytest.mark.parametrize("scale", [0.3, 0.8, 1.0, 1.4, 3.0, 30.0])
def test_gaussian_rows_get_the_reference_codes(scale: float) -> None:
    """From all inside the ball (0.3) to all outside it (30), where the shrink and the descent
    decide."""
    x = np.random.default_rng(int(scale * 10)).standard_normal((4000, 8)) * scale
    assert_same_codes(x)


def test_heavy_tailed_and_extreme_scales_get_the_reference_codes() -> None:
    rng = np.random.default_rng(21)
    t = rng.standard_t(2, size=(2000, 8))
    tiny = rng.standard_normal((200, 8)) * 1e-300
    huge = rng.standard_normal((200, 8)) * np.array([1e6, 1e30, 1e150, 1.0, 1.0, 1.0, 1.0, 1.0])
    one_coordinate = np.zeros((64, 8))
    one_coordinate[np.arange(64), np.arange(64) % 8] = np.geomspace(1e-8, 1e8, 64)
    assert_same_codes(np.concatenate([t, tiny, huge, one_coordinate]))


def test_ties_and_lattice_points_get_the_reference_codes() -> None:
    """Rows where candidates tie exactly: the first in the rule's order wins in both."""
    book = e8_codebook()
    rng = np.random.default_rng(22)
    halves = rng.integers(-8, 9, size=(3000, 8)) / 2.0
    quarters = rng.integers(-16, 17, size=(3000, 8)) / 4.0
    special = np.array(
        [
            [0.0] * 8,
            [0.5] * 8,
            [-0.5] * 8,
            [0.25] * 8,
            [1.5] * 8,
            [3.5] * 8,
            [-3.5] * 8,
            [0.5, -0.5] * 4,
            [3.0, 3.0, 0, 0, 0, 0, 0, 0],
            [1.0, 0, 0, 0, 0, 0, 0, 0],
            [5e-324] * 8,
            [-0.0] * 8,
        ]
    )
    outside = book.points[np.square(book.points).sum(axis=1) >= 8.0] * 1.05
    assert_same_codes(np.concatenate([halves, quarters, special, book.points, outside]))
    np.testing.assert_array_equal(book.encode(book.points), np.arange(len(book)))


def test_outside_rows_are_as_close_as_brute_force() -> None:
    """The rule's promise (``_e8`` rule 4) holds for the C search too."""
    book = e8_codebook()
    x = np.random.default_rng(23).standard_normal((1500, 8)) * 1.4
    chosen = book.points[book.encode(x)]
    brute = nearest_in_codebook_brute_force(x, book)
    np.testing.assert_allclose(
        np.square(chosen - x).sum(axis=1), np.square(brute - x).sum(axis=1), atol=1e-9
    )


def test_real_keys_and_values_get_the_reference_codes(engine_model: LlamaModel) -> None:
    """The rows the codec hands the codebook for the model's own K/V, calibrated as served."""
    means, scales = calibrate(engine_model)
    ids = engine_model.tokenizer.encode(CALIBRATION_TEXTS[0])[:97]
    keys, values = capture_kv(engine_model, ids)
    rows = []
    for layer in (0, 1, engine_model.config.num_layers // 2, engine_model.config.num_layers - 1):
        codec = codec_by_name("e8-2", layer=layer, key_mean=means[layer], key_scale=scales[layer])
        assert isinstance(codec, E8Codec)
        roles: tuple[tuple[Role, npt.NDArray[np.float32]], ...] = (
            ("key", keys[layer]),
            ("value", values[layer]),
        )
        for role, block in roles:
            for start in range(1, 97, 16):  # after the sink, as the cache codes them
                rows.append(codec._lattice_rows(block[start : start + 16], role)[1])
    x = np.concatenate(rows)
    assert (e8_codebook().index_of(nearest_e8(x)) < 0).mean() > 0.05  # the descent is exercised
    assert_same_codes(x)


@pytest.mark.parametrize("dim", [1, 8, 64, 128])
def test_hadamard_gives_the_reference_bits(dim: int) -> None:
    rng = np.random.default_rng(dim)
    x = (rng.standard_t(3, size=(16, 3, dim)) * 10.0 ** rng.integers(-30, 30, (16, 3, 1))).astype(
        np.float32
    )
    np.testing.assert_array_equal(hadamard_transform(x), reference_hadamard(x))
    strided = x[:, ::2]
    np.testing.assert_array_equal(hadamard_transform(strided), reference_hadamard(strided))


def test_hadamard_refuses_a_dimension_not_a_power_of_two() -> None:
    with pytest.raises(ValueError, match="power of two"):
        hadamard_transform(np.zeros((2, 48), dtype=np.float32))


@pytest.mark.parametrize(("heads", "dim"), [(3, 64), (2, 24), (1, 1)])
def test_key_transform_sums_each_output_in_input_order(heads: int, dim: int) -> None:
    """Rule 2 in C: each output the float32 sum of its products in the inputs' order, from 0
    (outputs 16 at a time and a tail: both in that order)."""
    rng = np.random.default_rng(dim)
    x = (rng.standard_t(3, size=(16, heads, dim)) * 10.0).astype(np.float32)
    matrices = rng.standard_normal((heads, dim, dim)).astype(np.float32)
    expected = np.zeros_like(x)
    for j in range(dim):
        expected += x[:, :, j : j + 1] * matrices[None, :, :, j]
    columns = np.ascontiguousarray(matrices.transpose(0, 2, 1))
    np.testing.assert_array_equal(_transformed(x, columns), expected)
    np.testing.assert_array_equal(_transformed(x[::2], columns), expected[::2])


def test_key_transform_refuses_mismatched_shapes() -> None:
    rows, out = np.zeros((4, 2, 8), dtype=np.float32), np.zeros((4, 2, 8), dtype=np.float32)
    with pytest.raises(ValueError, match="columns"):
        _e8core.transform(rows, np.zeros((2, 8, 4), dtype=np.float32), 2, 8, out)
    with pytest.raises(ValueError, match="positive"):
        _e8core.transform(rows, np.zeros((2, 8, 8), dtype=np.float32), 0, 8, out)
    with pytest.raises(TypeError, match="format"):
        _e8core.transform(rows.astype(np.float64), np.zeros((2, 8, 8), dtype=np.float32), 2, 8, out)


def test_bad_rows_are_refused() -> None:
    book = e8_codebook()
    for bad in (np.nan, np.inf, -np.inf, 1e200):
        x = np.zeros((3, 8))
        x[1, 4] = bad
        with pytest.raises(ValueError, match="E8 row 1 is not finite"):
            book.encode(x)
        with pytest.raises(ValueError, match="E8 row 1 is not finite"):
            nearest_e8(x)
    for bad in (np.nan, np.inf, -np.inf):  # rule 4b's rows, float32 (1e200 is none)
        rotated = np.ones((1, 1, 24), dtype=np.float32)
        rotated[0, 0, 12] = bad
        with pytest.raises(ValueError, match="E8 row 1 is not finite"):
            _block_scaled_codes(rotated, np.full((1, 1), 128, dtype=np.uint8))
    with pytest.raises(ValueError, match=r"\[n, 8\]"):
        book.encode(np.zeros((3, 7)))
    with pytest.raises(ValueError, match=r"\[n, 8\]"):
        nearest_d8(np.zeros(8))
    assert book.encode(np.zeros((0, 8))).shape == (0,)


def _products_in_c_order(d: Float64Array, roots: Float64Array) -> Float64Array:
    """``r . d`` for every root, summed as ``_e8core`` sums them (its rule 2): a whole root's
    two products added, a half root's first four products in order plus its last four."""
    terms = d[:, None, :] * roots[None]
    whole = np.abs(roots).max(axis=1) == 1.0
    first, second = np.nonzero(roots[whole])[1].reshape(-1, 2).T
    out = np.empty(terms.shape[:2])
    out[:, whole] = terms[:, whole, first] + terms[:, whole, second]
    t = terms[:, ~whole]
    low = ((t[..., 0] + t[..., 1]) + t[..., 2]) + t[..., 3]
    high = ((t[..., 4] + t[..., 5]) + t[..., 6]) + t[..., 7]
    out[:, ~whole] = low + high
    return out


def _codes_by_full_scan(x: Float64Array) -> npt.NDArray[np.int64]:
    """Rules 2-4 with every root of the descent scanned and its product summed in the C's order:
    what ``_e8core``'s pruned look must give exactly, ties and thresholds included."""
    book = e8_codebook()
    roots = book.roots
    codes = book.index_of(reference_nearest_e8(x))
    rows = np.nonzero(codes < 0)[0]
    xs = x[rows]
    norms = np.sqrt(np.square(xs).sum(axis=1, keepdims=True))
    point, err = np.zeros_like(xs), np.full(rows.size, np.inf)
    for fraction in SHRINK:
        factor = np.minimum(1.0, fraction * np.sqrt(CODEBOOK_NORM2) / np.maximum(norms, 1e-30))
        candidate = reference_nearest_e8(xs * factor)
        candidate_err = np.square(candidate - xs).sum(axis=1)
        inside = np.square(candidate).sum(axis=1) <= CODEBOOK_NORM2 + 1e-9
        better = inside & (candidate_err < err)
        point[better], err[better] = candidate[better], candidate_err[better]
    active = np.arange(rows.size)
    for _ in range(DESCENT_STEPS):
        p, e = point[active], err[active]
        after = (e[:, None] + 2.0) - 2.0 * _products_in_c_order(xs[active] - p, roots)
        along = (np.square(p).sum(axis=1, keepdims=True) + 2.0) + 2.0 * (p @ roots.T)  # exact
        after[along > CODEBOOK_NORM2 + 1e-9] = np.inf
        pick = after.argmin(axis=1)  # the first root in the codebook's order on a tie
        picked = after[np.arange(active.size), pick]
        step = picked < e - 1e-9
        active, pick, picked = active[step], pick[step], picked[step]
        point[active] += roots[pick]
        err[active] = picked
    codes[rows] = book.index_of(point)
    return codes


def test_rows_at_the_descent_threshold_get_the_full_scan_codes() -> None:
    """Rows moved so that a step's gain sits at the descent's threshold (1e-9) or within
    rounding of it: the C looks at only the roots its bounds cannot rule out, and must pick
    what a scan of all 240 picks (a bound off by 1e-6 fails here).  Against the numpy rule
    ``reference_codes`` a few of these rows differ, in the C before this search too: einsum
    sums a half root's eight products in another order, and at an exact threshold the last
    bit decides."""
    book = e8_codebook()
    x = np.random.default_rng(24).standard_normal((2000, 8)) * 1.4
    x = x[book.index_of(nearest_e8(x)) < 0]
    p = book.points[book.encode(x)]
    inside = np.square(p[:, None, :] + book.roots[None]).sum(axis=2) <= CODEBOOK_NORM2
    toward = np.where(inside, (x - p) @ book.roots.T, -np.inf)
    root = book.roots[toward.argmax(axis=1)]
    product = np.einsum("nk,nk->n", x - p, root)
    rows = [
        x + ((1.0 + gain - product) / 2.0)[:, None] * root
        for gain in (-1e-7, -1e-12, 0.0, 4e-10, 5e-10, 6e-10, 1e-9, 1e-7, 1e-5)
    ]
    y = np.concatenate(rows)
    np.testing.assert_array_equal(book.encode(y).astype(np.int64), _codes_by_full_scan(y))


def _reference_token_scales(rotated: npt.NDArray[np.float32], tau: float) -> npt.NDArray[np.uint8]:
    """``_e8_codec`` rule 4 as numpy computed it before ``_e8core.token_scales``."""
    rms = np.sqrt(np.square(rotated).mean(axis=2)) / np.float32(tau)
    nearest = 1 + np.searchsorted(_SCALE_CUTS, rms.astype(np.float64))
    return np.where(rms > 0, nearest, 0).astype(np.uint8)


@pytest.mark.parametrize("dim", [8, 64, 128, 512])
def test_token_scales_are_numpys(dim: int) -> None:
    """The C's scale index is numpy's, bit for bit: sums of 8 to 512 squares (numpy's pairwise
    order, recursive beyond 128), RMS from 1e-25 to 1e20, a zero row, overflow, NaN, and RMS
    on the cuts between levels."""
    rng = np.random.default_rng(dim + 1)
    x = rng.standard_normal((64, 3, dim)) * 10.0 ** rng.uniform(-25, 20, (64, 3, 1))
    on_cuts = np.zeros((len(_SCALE_CUTS), 3, dim))
    on_cuts[:, :, 0] = (_SCALE_CUTS * np.sqrt(dim))[:, None]
    rows = np.concatenate([x, on_cuts]).astype(np.float32)
    rows[0, 0] = 0.0
    rows[1, 1, 0] = np.inf
    rows[1, 2, 0] = np.nan
    rows[2, 0, :] = 3e38
    for tau in (1.0, 0.93, 1.2):
        with np.errstate(all="ignore"):
            expected = _reference_token_scales(rows, tau)
        np.testing.assert_array_equal(_token_scales(rows, tau), expected)
        assert expected[0, 0] == 0 and expected[2, 0] == 255


def _reference_decode(codec: E8Codec, encoded: EncodedBlock) -> npt.NDArray[np.float32]:
    """``_e8_codec`` rule 8 as numpy computed it before ``_e8core.decode_scaled``: the float32
    codebook rows times their levels, then the codec's product per head."""
    tokens, heads, dim = encoded.shape
    blocks = dim // 8
    points = e8_codebook().points32[encoded.codes.astype(np.intp)]
    points = points.reshape(tokens, heads, blocks, 8)
    if encoded.role in codec.block_scale_roles:
        high = np.unpackbits(encoded.scales[..., 1:], axis=-1, count=blocks, bitorder="little")
        points *= SCALE_LEVELS[_block_levels(encoded.scales[..., 0], high)][..., None]
    else:
        points *= SCALE_LEVELS[encoded.scales][..., None, None]
    flat = points.reshape(tokens, heads, dim)
    out = np.matmul(flat.transpose(1, 0, 2), codec._decoder(encoded.role, heads, dim))
    mean = codec._means[encoded.role]
    if mean is not None:
        out += mean[:, None, :]
    return np.ascontiguousarray(out.transpose(1, 0, 2))


@pytest.mark.parametrize("dim", [8, 64, 128])
def test_decoded_blocks_are_numpys(dim: int) -> None:
    """The C's rows times levels are numpy's products: with and without block scales (one flag
    byte or more), every scale index (clipped at 1 and 255), zero token-heads, a key mean."""
    rng = np.random.default_rng(dim + 2)
    mean = rng.standard_normal((3, dim)).astype(np.float32)
    codecs = (E8Codec(key_mean=mean), E8Codec(block_scale_roles=("key",), name="e8-2w"))
    for codec in codecs:
        for tokens in (1, 5, 16):
            spread = 10.0 ** rng.uniform(-2.5, 2.5, (tokens, 3, 1))
            x = (rng.standard_normal((tokens, 3, dim)) * spread).astype(np.float32)
            x[0, 1] = 0.0
            roles: tuple[Role, ...] = ("key", "value")
            for role in roles:
                encoded = codec.encode(x, role)
                expected = _reference_decode(codec, encoded)
                np.testing.assert_array_equal(codec.decode(encoded), expected)
                scales = encoded.scales.copy()
                index = scales[..., 0] if scales.ndim == 3 else scales  # a view: written over
                index[...] = rng.integers(0, 256, index.shape)
                every = EncodedBlock(
                    codec.name, role, encoded.shape, encoded.codes, scales, encoded.zeros
                )
                np.testing.assert_array_equal(codec.decode(every), _reference_decode(codec, every))


def test_a_code_beyond_the_codebook_is_refused() -> None:
    codec = E8Codec()
    encoded = codec.encode(np.ones((2, 1, 8), dtype=np.float32), "value")
    codes = encoded.codes.copy()
    codes[1, 0, 0] = CODEBOOK_SIZE
    bad = EncodedBlock(codec.name, "value", encoded.shape, codes, encoded.scales, encoded.zeros)
    with pytest.raises(ValueError, match="beyond the 56881-point codebook"):
        codec.decode(bad)


@pytest.mark.parametrize("scale", [0.2, 1.0, 3.0, 40.0])
def test_block_scale_choice_is_the_nearer_level(scale: float) -> None:
    """``_e8_codec`` rule 4b from the C's float32 rows and table of level pairs: each 8-block's
    code is its search at the nearer of its two levels (squared error summed pairwise, the low
    level on a tie), whatever the C's bound skipped."""
    rng = np.random.default_rng(int(scale * 10) + 3)
    x = (rng.standard_normal((16, 3, 64)) * scale).astype(np.float32)
    x[3, 1] = 0.0
    codec = E8Codec()
    encoded = codec.encode(x, "value")
    rotated = codec._rotated(x, "value")
    rows = rotated.reshape(-1, 8).astype(np.float64)
    pairs = _level_pairs()[encoded.scales[..., 0]].astype(np.float64)
    levels = np.repeat(pairs[:, :, None, :], 8, axis=2).reshape(-1, 2)
    book = e8_codebook()
    codes, errors = [], []
    for level in (levels[:, 0:1], levels[:, 1:2]):
        scaled = np.where(level > 0, rows / np.where(level > 0, level, 1.0), 0.0)
        code = book.encode(scaled)
        miss = np.square(book.points[code] * level - rows)
        low_half = (miss[:, 0] + miss[:, 1]) + (miss[:, 2] + miss[:, 3])
        errors.append(low_half + ((miss[:, 4] + miss[:, 5]) + (miss[:, 6] + miss[:, 7])))
        codes.append(code)
    high = errors[1] < errors[0]
    np.testing.assert_array_equal(encoded.codes.reshape(-1), np.where(high, codes[1], codes[0]))
    flags = np.unpackbits(encoded.scales[..., 1:], axis=-1, count=8, bitorder="little")
    np.testing.assert_array_equal(flags.reshape(-1), high.astype(np.uint8))


@pytest.mark.parametrize("build", BUILDS, ids=lambda b: f"{b.LANES} lanes")
def test_block_scale_choice_holds_where_the_bounds_skip_a_search(build: ModuleType) -> None:
    """``_e8core.encode_scaled_row`` skips a level's slow path only where its bound says the
    level must lose (its rules a-c): rows just inside and outside a level's ball, on its lattice
    inside and outside the ball, far outside, with levels equal, zero or in either order, get
    the choice that searching both levels gives (the low level on a tie), in every build."""
    rng = np.random.default_rng(4)
    table = rng.choice([0.3, 0.84, 1.0, 1.09, 2.5], size=(256, 2)).astype(np.float32)
    table[:4] = [(1.0, 1.0), (0.0, 1.0), (1.0, 0.0), (1.09, 0.84)]
    tokens, heads, dim = 16, 8, 64
    scales = rng.integers(0, 256, size=(tokens, heads)).astype(np.uint8)
    scales[0] = np.arange(heads) % 4
    pairs = table[scales].astype(np.float64)  # [tokens, heads, 2]
    chosen = pairs[..., rng.integers(0, 2)]
    level = np.where(chosen > 0, chosen, 1.0)[..., None, None]
    direction = rng.standard_normal((tokens, heads, dim // 8, 8))
    direction /= np.linalg.norm(direction, axis=-1, keepdims=True)
    book = e8_codebook()
    on_lattice = book.points[rng.integers(0, CODEBOOK_SIZE, size=direction.shape[:-1])]
    radius = np.sqrt(CODEBOOK_NORM2)
    shell = (*direction.shape[:-1], 1)
    kinds = [
        direction * radius * rng.uniform(0.98, 1.02, size=shell),
        direction * radius * rng.uniform(1.0, 1.7, size=shell),
        on_lattice,
        on_lattice * 2.0,
        on_lattice * 1.25 + rng.standard_normal(direction.shape) * 1e-7,
        direction * 40.0,
    ]
    book_codes, book_high = [], []
    for rows in kinds:
        x = (rows * level).reshape(tokens, heads, dim).astype(np.float32)
        codes = np.empty((tokens, heads, dim // 8), dtype=np.uint16)
        high = np.empty_like(codes, dtype=np.uint8)
        build.encode_scaled(x, scales, table, codes, high)
        flat = x.reshape(-1, 8).astype(np.float64)
        levels = np.repeat(pairs[:, :, None, :], dim // 8, axis=2).reshape(-1, 2)
        found, errors = [], []
        for at in (levels[:, 0:1], levels[:, 1:2]):
            code = book.encode(np.where(at > 0, flat / np.where(at > 0, at, 1.0), 0.0))
            miss = np.square(book.points[code] * at - flat)
            low_half = (miss[:, 0] + miss[:, 1]) + (miss[:, 2] + miss[:, 3])
            errors.append(low_half + ((miss[:, 4] + miss[:, 5]) + (miss[:, 6] + miss[:, 7])))
            found.append(code)
        expected_high = errors[1] < errors[0]
        book_codes.append((codes.reshape(-1), np.where(expected_high, found[1], found[0])))
        book_high.append((high.reshape(-1), expected_high.astype(np.uint8)))
    for (got, expected), (got_high, expected_high) in zip(book_codes, book_high, strict=True):
        np.testing.assert_array_equal(got, expected)
        np.testing.assert_array_equal(got_high, expected_high)
