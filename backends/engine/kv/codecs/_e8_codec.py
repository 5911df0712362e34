"""``e8-2``: keys and values as 8-dimensional E8 lattice points at 2 bits per dimension.

Why written here rather than taken from a library: the codec is the product being judged --
its bits, its error and its speed are what the benchmark reports -- and no package offers E8
quantization of KV blocks (QuIP#'s E8P is a CUDA kernel for weights, with torch).  The lattice
part (``_e8``) is ~150 lines of numpy that the tests check against brute force.

Rules (one block ``x`` [tokens, kv_heads, head_dim], one layer)
------------------------------------------------------------
1. Keys are centred by the layer's key mean per head (``key_mean`` [kv_heads, head_dim], from
   calibration, zeros by default).  Adding one vector to every key adds one constant to every
   score of a query, which softmax ignores; centring removes the shared offset before it costs
   bits.  Values are centred only when calibration gives them a mean too (``key_mean`` stacked
   [2, kv_heads, head_dim]): it is subtracted before coding and added back after decoding, so
   it is exact; ``calibrate`` does not give one by default (measured: no gain, see rule 2).
2. Keys are then multiplied by the layer's key transform ``key_scale``: per head either a
   vector of per-channel multipliers [kv_heads, head_dim] or a symmetric matrix [kv_heads,
   head_dim, head_dim] (from calibration; identity by default), and by its inverse after
   decoding.  The lattice error is isotropic in the space it quantizes; what attention feels of
   a key's error ``dk`` is ``q . dk``, so the error should be small along directions where
   queries are large and keys small.  With ``Sq``, ``Sk`` the calibration queries' and centred
   keys' second-moment matrices, ``E[(q . dk)^2]`` is least for ``A^T A = M``, ``M = Sk^-1/2
   (Sk^1/2 Sq Sk^1/2)^1/2 Sk^-1/2`` (the matrix geometric mean of ``Sq`` and ``Sk^-1``; per
   channel it is ``sqrt(Q_c / K_c)``).  On this model ``A = M^(3/8)`` (``KEY_TRANSFORM_POWER``,
   3/4 of the high-rate optimum's ``M^(1/2)``) with both moments shrunk ``KEY_TRANSFORM_SHRINK``
   = 0.1 towards their diagonals, estimated on ``_texts.CALIBRATION_TEXTS`` (seven passages,
   2,326 tokens).  Side by side over the three prompts (attention error / KL / top-1): the old
   252-token text with ``M^(1/4)`` and shrink 0.3, 0.374 / 0.260 / 70.3 %; the longer text,
   0.363 / 0.251 / 71.4 %; with ``M^(3/8)`` and shrink 0.1, 0.358 / 0.221 / 72.9 % (on 252
   tokens the weaker power and heavier shrink had won: a 64 x 64 matrix needs the data).
   Applied in C (``_e8core.transform``: each output a float32 sum over its inputs in their
   order, not BLAS), so the codes do not depend on the BLAS kernel or a SIMD width (numpy's
   ``einsum`` did the same work in 3x the time: 54 -> 18 us for a 16-token block of keys);
   the inverse is computed once per codec.  Free like the mean: per-layer constants,
   no bits per block.  Values may carry a transform of their own (``key_scale`` stacked [2,
   kv_heads, head_dim, head_dim]): what the model reads of a value's error is ``dv W_o``, so
   ``M`` from the output projection's rows for the KV head's query heads and the values'
   moment is the same construction (``calibrate(value_power=...)``); measured at power 1/4
   with the value mean it lowered attention error 0.363 -> 0.362 but raised KL 0.251 -> 0.288,
   so the default calibration leaves values as they are.
3. Each head's vectors are rotated by ``diag(s) H / sqrt(head_dim)``: ``H`` the Sylvester
   Hadamard matrix (``scipy.linalg.hadamard``), ``s`` random signs drawn from ``(seed,
   layer)`` per head, applied as a fast Walsh-Hadamard transform (float32 adds and subtracts
   in a fixed order, in C, ``_e8core``: no BLAS, so the codes do not depend on the BLAS kernel
   or its threads; ``H`` is symmetric and ``H H = head_dim I``, so the same transform undoes
   it).  Post-RoPE keys
   have outlier channels (a few channels 10x the others); the rotation spreads every channel
   over all of them, so the coordinates the lattice sees are near Gaussian.  Without it the
   attention error of E8 keys on this model is ~1.0.
4. Each token-head gets one scale, ``RMS / tau`` over its rotated coordinates, stored as a
   uint8 index into ``SCALE_LEVELS`` (and used rounded, so decoding multiplies by exactly what
   encoding divided by): index 0 is an all-zero vector, index ``i`` the level
   ``2 ** ((i - SCALE_INDEX_OF_ONE) / SCALE_STEPS_PER_OCTAVE)``, the nearest in the log domain
   (cut at the geometric mean of two neighbours); scales beyond the last level take it.  The
   levels and the cuts are built from ``sqrt`` and products of float64 (each correctly rounded
   by IEEE 754), never ``log`` or ``pow``, and an index is found by comparisons, so the codes do
   not depend on a libm or a SIMD path.  Levels 2 ** (1/16) apart span 2 ** -7.9 .. 2 ** 7.9;
   this model's scales lie in 2 ** -5.8 .. 2 ** 2.2 (keys and values of three calibration texts,
   every layer).  Side by side over the three prompts (attention error / KL / top-1): float16
   scales 0.3580 / 0.2210 / 72.9 %, 16 levels an octave 0.3585 / 0.2208 / 71.9 %, 8 an octave
   (twice the span) 0.3600 / 0.2387 / 70.6 %.  ``DEFAULT_TAU`` = 0.85 and rule 4b's pair were
   tuned together on SmolLM2's own keys and values in attention, not round-trip error: on a text
   of neither the calibration nor issue 14's held-out set (``_texts.PROMPTS`` joined, 1,295
   tokens, step semantics), ``e8-2w``'s attention error with the pair -5 / +3 at tau 1.0 / 0.9 /
   0.85 / 0.8: 0.0966 / 0.0873 / 0.0849 / 0.0907; at 0.85 the pairs -3 / +2, -4 / +2, -6 / +4:
   0.0838 / 0.0825 / 0.0920; ``e8-2`` 0.3566 (1.0, -5 / +3) -> 0.3447.  A smaller tau is a wider
   ball (fewer coordinates beyond the codebook's reach; the model's rotated K/V have heavier
   tails than a Gaussian), so the block levels need not reach as far.  On unit Gaussians the
   same choice is worse (round-trip MSE per coordinate 0.0741 -> 0.0804): the model's data
   decided.
4b. Block scales (``block_scale_roles``: keys and values of ``e8-2``, keys only of ``e8-2w``):
   each 8-block of a token-head takes one of two levels near its token-head's,
   ``BLOCK_SCALE_STEPS`` = -4 and +2 steps of the uint8 index (x 0.84 and x 1.09; indexes kept
   in 1..255), the one whose code has the smaller squared error
   in the rotated space (the low one on a tie; in C, ``_e8core.encode_scaled``: the block divided
   by each level in float64, both searched, the 8 squares summed in a fixed order, so the choice
   does not depend on a SIMD path); one bit per block, packed after the
   token-head's index (``scales`` [tokens, heads, 1 + blocks / 8] uint8).  A block's norm varies
   about its token-head's RMS (chi-squared, 8 degrees): a small block gets a finer grid, a large
   one a wider ball.  It costs one more bit per 8 elements, 1/8 bit per element, and one more
   codebook search per block; on unit Gaussians at tau 1.0 with -5 / +3 (the best pair of a
   sweep over -9..+6 steps and tau 0.9-1.2 there) the mean squared error per coordinate falls
   0.0901 -> 0.0742 (-18 %, the 6 dB per bit of rate theory gives 1/8 bit per element: -16 %).
   On issue 14's first 1,500-token text (attention error / KL / top-1): 0.400 / 0.120 / 80.8 %
   -> 0.357 / 0.098 / 83.4 % (tau 1.0, -5 / +3; rule 4 says why 0.85 and -4 / +2 now).
   ``e8-2w`` gives it its keys only: its window spends most of the bits (the issue's bound is 3.4
   bits at 1,500 tokens: 3.39 so, 3.44 with values' block scales too), and keys carry most of a
   windowed error (the first text, one scale: 0.142; exact keys 0.052, exact values 0.130; block
   scales on the keys 0.115, on both 0.113).
5. The scaled vector is cut into 8-blocks, each coded as the index (uint16) of its nearest
   point in the 56,881-point codebook (``_e8``, rules 2-5: a search in C).
6. Bits per element: 16 bits per 8 elements + 8 bits of scale per ``head_dim`` elements =
   2 + 8/64 = 2.125 for head_dim 64 (7.5x fewer than fp16); with block scales one more bit per
   8 elements (a whole byte per head of 64), 2.25 (7.1x fewer).  The key mean, the key scale and
   the signs are per layer, not per block, and are not counted (``_codec`` rule 3).
7. The attention-sink token (position 0) draws far more attention than any other and its key
   is an outlier; the cache keeps it at full precision (a read-time policy like the recent
   window, ``_codec`` rule 4), the codec does not special-case it.
8. Decoding is the codebook rows times the scales, then one product per head with a matrix
   built once per codec: the inverse rotation ``H / sqrt(d) diag(s)`` and, for keys, the
   inverse key transform (the mean is added after).  On a 16-token block that one product
   replaces six butterfly stages and the transform's loops (~20x fewer numpy calls: decode is
   what every miss of the pool's decoded-block cache pays).  It may go through BLAS: a decoded
   block always has the same shape, so it decodes to the same bits every time in a process,
   and nodes exchange codes, not decoded rows, only when their numerics agree.  Encoding stays
   free of BLAS (the codes are what must not depend on the kernel).
"""

from __future__ import annotations

import functools
import math
from typing import Any

import numpy as np
import numpy.typing as npt
import scipy.linalg

from ._codec import (
    DEFAULT_SEED,
    ROLES,
    BlockCodec,
    EncodedBlock,
    Float32Array,
    Role,
    block_shape,
)
from ._e8 import e8_codebook
from ._e8builds import e8core

__all__ = [
    "BLOCK_SCALE_STEPS",
    "DEFAULT_TAU",
    "E8_BLOCK",
    "KEY_SCALE_POWER",
    "KEY_TRANSFORM_POWER",
    "KEY_TRANSFORM_SHRINK",
    "SCALE_INDEX_OF_ONE",
    "SCALE_LEVELS",
    "SCALE_STEPS_PER_OCTAVE",
    "VALUE_TRANSFORM_POWER",
    "E8Codec",
    "hadamard_transform",
    "key_scale_from",
    "key_transform_from",
    "rotation_signs",
]

DEFAULT_TAU = 0.85
"""Target RMS of the scaled coordinates (rule 4)."""
E8_BLOCK = 8
KEY_SCALE_POWER = 0.125
"""Exponent of ``Q_c / K_c`` in the per-channel key scale (rule 2)."""
KEY_TRANSFORM_POWER = 0.375
"""Exponent of ``M`` in the per-head key transform (rule 2)."""
KEY_TRANSFORM_SHRINK = 0.1
"""Weight of the diagonal in the calibration moments of the key transform (rule 2)."""
VALUE_TRANSFORM_POWER = 0.25
"""Exponent of the values' ``M`` (output metric and value moment) in their transform (rule 2)."""
SCALE_STEPS_PER_OCTAVE = 16
"""Levels of the uint8 scale per factor of 2 (rule 4; a power of 2: the levels are square roots)."""
SCALE_INDEX_OF_ONE = 128
"""The scale index of level 1.0 (rule 4): 127 levels below it, 127 above."""
BLOCK_SCALE_STEPS = (-4, 2)
"""The two levels an 8-block may take, in steps of ``SCALE_LEVELS`` from its token-head's
(rule 4b): x 2 ** (-4/16) = 0.84 or x 2 ** (2/16) = 1.09."""
_EMPTY = np.zeros(0, dtype=np.float32)


def _scale_levels() -> tuple[Float32Array, npt.NDArray[np.float64]]:
    """Rule 4's 256 scale levels (index 0: zero) and the 254 cuts between levels 1..255, from
    square roots and products only, read-only."""
    root = 2.0
    for _ in range(SCALE_STEPS_PER_OCTAVE.bit_length() - 1):
        root = math.sqrt(root)
    fractions = [1.0]
    for _ in range(SCALE_STEPS_PER_OCTAVE - 1):
        fractions.append(fractions[-1] * root)
    levels = np.zeros(256, dtype=np.float32)
    for index in range(1, 256):
        octave, step = divmod(index - SCALE_INDEX_OF_ONE, SCALE_STEPS_PER_OCTAVE)
        levels[index] = math.ldexp(fractions[step], octave)
    wide = levels[1:].astype(np.float64)
    cuts = np.sqrt(wide[:-1] * wide[1:])  # exact products of float32s, rounded square roots
    levels.flags.writeable = False
    cuts.flags.writeable = False
    return levels, cuts


SCALE_LEVELS, _SCALE_CUTS = _scale_levels()
"""The scale of each uint8 index (rule 4) and the geometric means between neighbours."""
_EIGEN_FLOOR = 1e-9  # of the largest eigenvalue: keeps a rank-deficient moment invertible


@functools.cache
def rotation_signs(seed: int, layer: int, kv_heads: int, head_dim: int) -> Float32Array:
    """Random signs [kv_heads, head_dim] of a layer (rule 2), read-only, cached per process."""
    if head_dim & (head_dim - 1) or head_dim % E8_BLOCK:
        raise ValueError(f"head_dim must be a power of two and a multiple of 8, got {head_dim}")
    rng = np.random.default_rng([seed, layer])
    signs = rng.choice(np.array([-1.0, 1.0], dtype=np.float32), size=(kv_heads, head_dim))
    signs.flags.writeable = False
    return signs


def hadamard_transform(x: Float32Array) -> Float32Array:
    """``x @ H / sqrt(d)`` along the last axis (``H``: Sylvester Hadamard, ``d`` a power of 2),
    as butterflies in float32 (``_e8core``, rule 3)."""
    rows = np.ascontiguousarray(x, dtype=np.float32)
    out = np.empty_like(rows)
    e8core.hadamard(rows, rows.shape[-1], out)
    return out


def key_scale_from(
    query_power: Float32Array, key_power: Float32Array, power: float = KEY_SCALE_POWER
) -> Float32Array:
    """Rule 2's per-channel key multipliers [kv_heads, head_dim] from calibration mean squares
    of the queries (summed over each KV head's query group) and of the centred keys; each
    head's multipliers have geometric mean 1."""
    ratio = np.maximum(query_power, 1e-12) / np.maximum(key_power, 1e-12)
    scale = ratio.astype(np.float64) ** power
    scale /= np.exp(np.log(scale).mean(axis=-1, keepdims=True))
    return scale.astype(np.float32)


def _psd_power(matrix: npt.NDArray[np.float64], power: float) -> npt.NDArray[np.float64]:
    """``matrix ** power`` of symmetric PSD matrices [..., d, d], eigenvalues floored."""
    values, vectors = np.linalg.eigh(matrix)
    values = np.maximum(values, _EIGEN_FLOOR * values.max(axis=-1, keepdims=True))
    out: npt.NDArray[np.float64] = (vectors * values[..., None, :] ** power) @ np.swapaxes(
        vectors, -1, -2
    )
    return out


def key_transform_from(
    query_moment: npt.NDArray[np.floating[Any]],
    key_moment: npt.NDArray[np.floating[Any]],
    power: float = KEY_TRANSFORM_POWER,
    shrink: float = KEY_TRANSFORM_SHRINK,
) -> Float32Array:
    """Rule 2's per-head key transform [kv_heads, head_dim, head_dim] from the calibration
    second-moment matrices [kv_heads, head_dim, head_dim] of the queries (summed over each KV
    head's query group) and of the centred keys: ``M ** power``, with determinant 1."""
    moments = []
    for moment in (query_moment, key_moment):
        m = np.asarray(moment, dtype=np.float64)
        diagonal = np.einsum("hii->hi", m)
        moments.append((1.0 - shrink) * m + shrink * (diagonal[..., None] * np.eye(m.shape[-1])))
    sq, sk = moments
    root, inverse_root = _psd_power(sk, 0.5), _psd_power(sk, -0.5)
    mean = inverse_root @ _psd_power(root @ sq @ root, 0.5) @ inverse_root
    transform = _psd_power(mean, power)
    _, logdet = np.linalg.slogdet(transform)
    transform /= np.exp(logdet / transform.shape[-1])[:, None, None]
    return np.ascontiguousarray(transform, dtype=np.float32)


class E8Codec(BlockCodec):
    """E8 lattice codes for one layer (see the module comment).

    ``key_mean`` is the keys' mean [kv_heads, head_dim], or the keys' and the values' means
    stacked [2, kv_heads, head_dim]; ``key_scale`` the keys' per-channel multipliers [kv_heads,
    head_dim], their transform [kv_heads, head_dim, head_dim], or the keys' and the values'
    transforms stacked [2, kv_heads, head_dim, head_dim] (rules 1-2; the registry's one pair of
    per-layer constants carries both roles); ``block_scale_roles``: the roles that take rule
    4b's bit per 8-block."""

    __slots__ = (
        "_columns",
        "_decoders",
        "_means",
        "_unweights",
        "_weights",
        "block_scale_roles",
        "key_mean",
        "key_scale",
        "layer",
        "name",
        "seed",
        "tau",
        "window_tokens",
    )

    def __init__(
        self,
        *,
        layer: int = 0,
        seed: int = DEFAULT_SEED,
        key_mean: Float32Array | None = None,
        key_scale: Float32Array | None = None,
        tau: float = DEFAULT_TAU,
        window_tokens: int = 0,
        block_scale_roles: tuple[Role, ...] = ROLES,
        name: str = "e8-2",
    ) -> None:
        if tau <= 0:
            raise ValueError("tau must be positive")
        self.name = name
        self.layer = layer
        self.seed = seed
        self.tau = tau
        self.window_tokens = window_tokens
        self.block_scale_roles = block_scale_roles
        self.key_mean = None if key_mean is None else np.asarray(key_mean, dtype=np.float32)
        self.key_scale = None if key_scale is None else np.asarray(key_scale, dtype=np.float32)
        self._decoders: dict[tuple[Role, int, int], Float32Array] = {}
        self._means: dict[Role, Float32Array | None] = {"key": None, "value": None}
        self._weights: dict[Role, Float32Array | None] = {"key": None, "value": None}
        self._unweights: dict[Role, Float32Array | None] = {"key": None, "value": None}
        self._columns: dict[Role, Float32Array] = {}
        if self.key_mean is not None:
            both = self.key_mean.ndim == 3
            self._means["key"] = self.key_mean[0] if both else self.key_mean
            self._means["value"] = self.key_mean[1] if both else None
        if self.key_scale is not None:
            both = self.key_scale.ndim == 4
            for role, weights in zip(
                ROLES, self.key_scale if both else (self.key_scale, None), strict=True
            ):
                if weights is not None:
                    self._weights[role] = weights
                    self._unweights[role] = _unweights(weights)
                    if weights.ndim == 3:
                        self._columns[role] = np.ascontiguousarray(weights.transpose(0, 2, 1))

    def _to_coded(self, x: Float32Array, role: Role) -> Float32Array:
        """Rules 1-2: what is rotated and coded (centred and weighted where calibrated)."""
        mean, weights = self._means[role], self._weights[role]
        for constant in (mean, weights):
            if constant is not None and constant.shape[:2] != x.shape[1:]:
                raise ValueError(
                    f"a {role} constant {constant.shape} does not fit a block {x.shape}"
                )
        out = x if mean is None else x - mean[None]
        if weights is None:
            return out
        if weights.ndim == 2:
            return out * weights[None]
        return _transformed(out, self._columns[role])

    def _encode(self, x: Float32Array, role: Role) -> EncodedBlock:
        tokens, heads, dim = x.shape
        rotated = self._rotated(x, role)
        scales = _token_scales(rotated, self.tau)
        if role not in self.block_scale_roles:
            rows = _scaled_rows(rotated, SCALE_LEVELS[scales][..., None])
            codes = e8_codebook().encode(rows).reshape(tokens, heads, dim // E8_BLOCK)
            return EncodedBlock(self.name, role, block_shape(x), codes, scales, _EMPTY)
        codes, high = _block_scaled_codes(rotated, scales)
        flags = np.packbits(high, axis=-1, bitorder="little")
        metadata = np.concatenate([scales[..., None], flags], axis=-1)
        return EncodedBlock(self.name, role, block_shape(x), codes, metadata, _EMPTY)

    def _rotated(self, x: Float32Array, role: Role) -> Float32Array:
        """Rules 1-3: the centred, weighted, sign-flipped and Hadamard-rotated vectors."""
        _, heads, dim = x.shape
        signs = rotation_signs(self.seed, self.layer, heads, dim)
        return hadamard_transform(self._to_coded(x, role) * signs[None])

    def _lattice_rows(
        self, x: Float32Array, role: Role
    ) -> tuple[npt.NDArray[np.uint8], npt.NDArray[np.float64]]:
        """Rules 1-4 without block scales: the uint8 scale index of each token-head and the
        rotated vectors divided by its level, cut into rows of 8 (float64)."""
        rotated = self._rotated(x, role)
        scales = _token_scales(rotated, self.tau)
        return scales, _scaled_rows(rotated, SCALE_LEVELS[scales][..., None])

    def _decode(self, encoded: EncodedBlock) -> Float32Array:
        """Rule 8: codebook rows times the scales (in C, ``_e8core.decode_scaled``: the float32
        products numpy made, from the C's own table of points), then one product per head."""
        tokens, heads, dim = encoded.shape
        flat = np.empty((tokens, heads, dim), dtype=np.float32)
        scales = np.ascontiguousarray(encoded.scales, dtype=np.uint8)
        block_scaled = encoded.role in self.block_scale_roles
        e8core.decode_scaled(
            np.ascontiguousarray(encoded.codes, dtype=np.uint16),
            scales,
            scales.shape[-1] if block_scaled else 1,
            _level_pairs() if block_scaled else SCALE_LEVELS,
            flat,
        )
        out = np.matmul(flat.transpose(1, 0, 2), self._decoder(encoded.role, heads, dim))
        mean = self._means[encoded.role]
        if mean is not None:
            out += mean[:, None, :]
        return np.ascontiguousarray(out.transpose(1, 0, 2))

    def _decoder(self, role: Role, heads: int, dim: int) -> Float32Array:
        """Each head's ``H / sqrt(d) diag(s)`` and the inverse of the role's transform (rule 8),
        built once per role and shape."""
        cached = self._decoders.get((role, heads, dim))
        if cached is not None:
            return cached
        signs = rotation_signs(self.seed, self.layer, heads, dim)
        rotation = scipy.linalg.hadamard(dim).astype(np.float64) / np.sqrt(dim)
        matrix = rotation[None] * signs[:, None, :]
        unweights = self._unweights[role]
        if unweights is not None and unweights.ndim == 3:
            matrix = matrix @ np.swapaxes(unweights.astype(np.float64), 1, 2)
        elif unweights is not None:
            matrix = matrix * unweights[:, None, :]
        decoder = np.ascontiguousarray(matrix, dtype=np.float32)
        decoder.flags.writeable = False
        self._decoders[role, heads, dim] = decoder
        return decoder


def _transformed(x: Float32Array, columns: Float32Array) -> Float32Array:
    """Each token-head's vector of ``x`` [tokens, heads, dim] times its head's matrix, given
    transposed (``columns`` [heads, dim, dim]), in C (rule 2: a fixed order, no BLAS)."""
    rows = np.ascontiguousarray(x, dtype=np.float32)
    out = np.empty_like(rows)
    heads, dim = columns.shape[:2]
    e8core.transform(rows, columns, heads, dim, out)
    return out


def _token_scales(rotated: Float32Array, tau: float) -> npt.NDArray[np.uint8]:
    """Rule 4: the uint8 index of the level nearest each token-head's ``RMS / tau``, in C
    (``_e8core.token_scales``: the float32 RMS numpy's ``sqrt(square(x).mean())`` gives, then
    the count of ``_SCALE_CUTS`` below it, as ``searchsorted`` counts)."""
    rows = np.ascontiguousarray(rotated, dtype=np.float32)
    scales = np.empty(rows.shape[:-1], dtype=np.uint8)
    e8core.token_scales(rows, tau, _SCALE_CUTS, scales)
    return scales


def _scaled_rows(rotated: Float32Array, levels: Float32Array) -> npt.NDArray[np.float64]:
    """``rotated`` divided by ``levels`` (broadcast; 0 where a level is 0: an all-zero vector),
    cut into float64 rows of 8 (rule 5)."""
    safe = np.where(levels > 0, levels, np.float32(1.0))
    scaled = np.where(levels > 0, rotated / safe, np.float32(0.0))
    return scaled.reshape(-1, E8_BLOCK).astype(np.float64)


def _block_levels(
    scales: npt.NDArray[np.uint8], high: npt.NDArray[np.uint8]
) -> npt.NDArray[np.intp]:
    """Rule 4b: each 8-block's level index [tokens, heads, blocks] from its token-head's index
    and its flag (0: ``BLOCK_SCALE_STEPS[0]`` steps, 1: ``[1]``), kept in 1..255; 0 stays 0."""
    low_step, high_step = BLOCK_SCALE_STEPS
    steps = np.where(high > 0, high_step, low_step)
    token = scales.astype(np.intp)[..., None]
    return np.where(token > 0, np.clip(token + steps, 1, 255), 0)


_BOTH_FLAGS = np.array([0, 1], dtype=np.uint8)
"""Rule 4b's two flags, low and high: ``_block_levels`` of both levels of each token-head."""


@functools.cache
def _level_pairs() -> Float32Array:
    """Rule 4b's two levels (low, high) of every token-head scale index: float32 [256, 2],
    read-only, what ``SCALE_LEVELS[_block_levels(scales, flags)]`` gives, looked up in C."""
    pairs = np.ascontiguousarray(
        SCALE_LEVELS[_block_levels(np.arange(256, dtype=np.uint8), _BOTH_FLAGS)]
    )
    pairs.flags.writeable = False
    return pairs


def _block_scaled_codes(
    rotated: Float32Array, scales: npt.NDArray[np.uint8]
) -> tuple[npt.NDArray[np.uint16], npt.NDArray[np.uint8]]:
    """Rule 4b: each 8-block coded at both of its levels; the codes [tokens, heads, blocks] of
    the one whose point times its level is nearer the block (the low one on a tie) and the
    flags (1: high), both found in C (``_e8core.encode_scaled``: the block and its levels taken
    to float64, the division in float64, the squared distance summed in a fixed order, so the
    choice does not depend on a SIMD path)."""
    tokens, heads, dim = rotated.shape
    shape = (tokens, heads, dim // E8_BLOCK)
    codes = np.empty(shape, dtype=np.uint16)
    high = np.empty(shape, dtype=np.uint8)
    e8core.encode_scaled(
        np.ascontiguousarray(rotated, dtype=np.float32),
        np.ascontiguousarray(scales, dtype=np.uint8),
        _level_pairs(),
        codes,
        high,
    )
    return codes, high


def _unweights(weights: Float32Array) -> Float32Array:
    """The inverse of per-channel multipliers [heads, d] or of per-head transforms [heads, d, d],
    checked (rule 2)."""
    if weights.ndim == 3:
        if weights.shape[1] != weights.shape[2]:
            raise ValueError(f"a key transform is square per head, got {weights.shape}")
        if not np.isfinite(weights).all() or (np.linalg.det(weights) <= 0).any():
            raise ValueError("a key transform must be invertible with a positive determinant")
        inverse = np.linalg.inv(weights.astype(np.float64))
        return np.ascontiguousarray(inverse, dtype=np.float32)
    if weights.ndim != 2 or not (weights > 0).all():
        raise ValueError("key_scale must be positive per-channel multipliers or transforms")
    return np.ascontiguousarray(1.0 / weights.astype(np.float64), dtype=np.float32)
