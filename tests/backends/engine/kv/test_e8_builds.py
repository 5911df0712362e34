"""The two builds of ``_e8core.c`` (``_e8builds``) give the same bits.

The baseline build (x86-64-v2, 2 lanes) is held to the numpy rule by ``test_e8_search.py``;
here every other build this CPU runs (x86-64-v3, 4 lanes) is held to the baseline, call by
call, on the rows that exercise every path of the search: the real model's keys and values as
the codec hands them over, Gaussian rows from well inside the ball to far outside, heavy
tails, ties (zeros, half-integers, lattice points), a number of rows that is not a multiple of
any lane count, and block levels equal, zero or in either order.
"""

from __future__ import annotations

from types import ModuleType

import numpy as np
import numpy.typing as npt
import pytest

from backends.engine import LlamaModel
from backends.engine.kv.codecs import _e8core, codec_by_name
from backends.engine.kv.codecs._e8 import CODEBOOK_SIZE, e8_codebook
from backends.engine.kv.codecs._e8_codec import _SCALE_CUTS, E8Codec, _level_pairs
from backends.engine.kv.codecs._e8builds import BUILDS, e8core
from backends.engine.kv.codecs._quality import capture_kv
from backends.engine.kv.codecs._texts import CALIBRATION_TEXTS

F32 = npt.NDArray[np.float32]
OTHER_BUILDS = BUILDS[1:]


def test_the_codec_runs_the_widest_build_the_cpu_can() -> None:
    assert BUILDS[0] is _e8core and _e8core.LANES == 2
    assert e8core is BUILDS[-1]
    if _e8core.RUNS_AVX2:
        assert len(BUILDS) == 2 and e8core.LANES == 4
        assert e8core.__name__ == "backends.engine.kv.codecs._e8core_avx2"
    else:
        assert BUILDS == (_e8core,)


def _rotated_blocks(model: LlamaModel) -> list[F32]:
    """[16, kv_heads, head_dim] rotated keys and values of the model, as the codec codes them
    (uncalibrated: the heavier tails), and Gaussian, heavy-tailed and tie-making blocks of the
    same shape."""
    ids = model.tokenizer.encode(CALIBRATION_TEXTS[0])[:97]
    keys, values = capture_kv(model, ids)
    blocks = []
    for layer in (0, model.config.num_layers // 2, model.config.num_layers - 1):
        codec = codec_by_name("e8-2", layer=layer)
        assert isinstance(codec, E8Codec)
        for start in range(1, 97, 16):
            blocks.append(codec._rotated(keys[layer][start : start + 16], "key"))
            blocks.append(codec._rotated(values[layer][start : start + 16], "value"))
    rng = np.random.default_rng(14)
    shape = blocks[0].shape
    for scale in (0.05, 0.3, 1.0, 3.0, 30.0):
        blocks.append((rng.standard_normal(shape) * scale).astype(np.float32))
    blocks.append(rng.standard_cauchy(shape).astype(np.float32))
    points = e8_codebook().points[rng.integers(0, CODEBOOK_SIZE, size=shape[0] * shape[1] * 8)]
    blocks.append((points.reshape(shape) * 0.7).astype(np.float32))
    blocks.append((rng.integers(-6, 7, size=shape) * 0.25).astype(np.float32))
    blocks.append(np.zeros(shape, dtype=np.float32))
    return blocks


def _outputs(build: ModuleType, block: F32, table: F32) -> list[npt.NDArray[np.generic]]:
    """Every function of ``build`` on ``block`` (and its rows of 8, one short of a multiple of
    every lane count), in one list."""
    tokens, heads, dim = block.shape
    out: list[npt.NDArray[np.generic]] = []
    hadamard = np.empty_like(block)
    build.hadamard(block, dim, hadamard)
    columns = np.ascontiguousarray(
        np.random.default_rng(dim).standard_normal((heads, dim, dim)).astype(np.float32))
    transformed = np.empty_like(block)
    build.transform(block, columns, heads, dim, transformed)
    scales = np.empty((tokens, heads), dtype=np.uint8)
    build.token_scales(block, 0.85, _SCALE_CUTS, scales)
    codes = np.empty((tokens, heads, dim // 8), dtype=np.uint16)
    high = np.empty_like(codes, dtype=np.uint8)
    build.encode_scaled(block, scales, table, codes, high)
    decoded = np.empty_like(block)
    flags = np.packbits(high, axis=-1, bitorder="little")
    build.decode_scaled(codes, np.concatenate([scales[..., None], flags], axis=-1), 2, table,
                        decoded)
    rows = (block.reshape(-1, 8)[:-1] / 0.6).astype(np.float64)
    nearest_d8, nearest_e8 = np.empty_like(rows), np.empty_like(rows)
    build.nearest_d8(rows, nearest_d8)
    build.nearest_e8(rows, nearest_e8)
    row_codes = np.empty(len(rows), dtype=np.uint16)
    build.encode(rows, row_codes)
    keys = np.empty(len(rows), dtype=np.int64)
    build.keys(nearest_e8, keys)
    out += [hadamard, transformed, scales, codes, high, decoded, nearest_d8, nearest_e8,
            row_codes, keys]
    return out


@pytest.mark.skipif(not OTHER_BUILDS, reason="this CPU runs only the baseline build")
@pytest.mark.parametrize("build", OTHER_BUILDS, ids=lambda b: f"{b.LANES} lanes")
def test_every_build_gives_the_baselines_bits(build: ModuleType, engine_model: LlamaModel
                                              ) -> None:
    rng = np.random.default_rng(8)
    mixed = rng.choice([0.0, 0.3, 0.84, 1.0, 1.09, 2.5], size=(256, 2)).astype(np.float32)
    mixed[:4] = [(1.0, 1.0), (0.0, 1.0), (1.0, 0.0), (1.09, 0.84)]
    blocks = _rotated_blocks(engine_model)
    for table in (_level_pairs(), mixed):
        for block in blocks:
            for got, expected in zip(_outputs(build, block, table), _outputs(_e8core, block, table),
                                     strict=True):
                np.testing.assert_array_equal(got, expected)
