"""Every KV codec by name (``CODECS``) and ``codec_by_name``, the one way to build one.

Registry names and what the cache does with them: ``e8-2w`` is ``e8-2`` with a 128-token
full-precision window (``window_tokens``), a read-time policy of the cache; the KIVI codecs
carry KIVI's own 128-token window.  The benchmark measures every codec with and without one.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from types import MappingProxyType

from ..._arrays import Float32Array
from ._codec import DEFAULT_SEED, ROLES, CodecSpec, KVCodec, Role
from ._e8_codec import E8Codec
from ._float import Float8Codec, Float16Codec, Float32Codec
from ._kivi import KIVI_WINDOW, KiviCodec

__all__ = ["CODECS", "E8_WINDOW", "WINDOWED_BUILDS", "BitsRange", "bits_range", "codec_by_name"]

E8_WINDOW = 128
"""Recent tokens ``e8-2w`` keeps at full precision (KIVI's window)."""


WINDOWED_BUILDS: Mapping[str, str] = MappingProxyType({"e8-2": "e8-2w"})
"""What a codec is built as for a cache with a recent window (a plan's ``window_tokens``, the
windowed codecs): ``e8-2`` as ``e8-2w``, block scales on the keys only (``_e8_codec`` rule 4b),
so that ``--kv-codec e8-2w`` serves what ``kv-quality`` measures as ``e8-2w``."""


def _e8(window: int, name: str) -> CodecSpec:
    # A window spends most of the bits: block scales for the keys only (``_e8_codec`` rule 4b).
    block_scale_roles: tuple[Role, ...] = ("key",) if window else ROLES
    blocks = "8-block of the keys" if window else "8-block"
    scales = f"8-bit log scale per token-head and 1 bit per {blocks}"
    return CodecSpec(
        name,
        f"E8 lattice, 2 bits/dim + an {scales}, Hadamard-rotated"
        f"{f', {window}-token window' if window else ''}",
        lambda layer, seed, key_mean, key_scale: E8Codec(
            layer=layer,
            seed=seed,
            key_mean=key_mean,
            key_scale=key_scale,
            window_tokens=window,
            block_scale_roles=block_scale_roles,
            name=name,
        ),
    )


def _kivi(bits: int) -> CodecSpec:
    return CodecSpec(
        f"kivi-{bits}",
        f"KIVI {bits}-bit asymmetric, keys per channel, values per token (group 32)",
        lambda *_: KiviCodec(bits, window_tokens=KIVI_WINDOW),
    )


CODECS: Mapping[str, CodecSpec] = MappingProxyType(
    {
        spec.name: spec
        for spec in (
            CodecSpec("fp32", "float32, the reference", lambda *_: Float32Codec()),
            CodecSpec("fp16", "IEEE float16", lambda *_: Float16Codec()),
            CodecSpec("fp8", "float8 e4m3, a float32 scale per head", lambda *_: Float8Codec()),
            _kivi(8),
            _kivi(4),
            _kivi(2),
            _e8(0, "e8-2"),
            _e8(E8_WINDOW, "e8-2w"),
        )
    }
)
"""Every codec by name, from the least lossy to the most."""


def codec_by_name(
    name: str,
    *,
    layer: int = 0,
    seed: int = DEFAULT_SEED,
    key_mean: Float32Array | None = None,
    key_scale: Float32Array | None = None,
    windowed: bool = False,
) -> KVCodec:
    """The codec ``name`` for ``layer``: ``seed``, ``key_mean`` and ``key_scale`` [kv_heads,
    head_dim] (the layer's calibrated key mean and per-channel key multipliers) matter to the
    codecs that rotate, centre and weigh (E8); the others ignore them.  ``windowed``: the layer
    is read with a recent window, so ``name`` is built as ``WINDOWED_BUILDS`` says.  Unknown
    names raise ``KeyError`` naming the known ones."""
    if windowed:
        name = WINDOWED_BUILDS.get(name, name)
    try:
        spec = CODECS[name]
    except KeyError:
        raise KeyError(f"unknown KV codec {name!r} (known: {', '.join(CODECS)})") from None
    return spec.build(layer, seed, key_mean, key_scale)


@dataclass(frozen=True, slots=True)
class BitsRange:
    """The lightest and the heaviest of some codecs: mean bits per element of K and V."""

    lightest: str
    least_bits: float
    heaviest: str
    most_bits: float


def bits_range(names: Iterable[str], kv_heads: int, head_dim: int, tokens: int) -> BitsRange:
    """What the codecs ``names`` store for blocks of ``tokens`` x ``kv_heads`` x ``head_dim``,
    measured (``_codec`` rule 3: scales per head or per block make it depend on the shape)."""
    bits = {
        name: codec_by_name(name).bits_per_element(kv_heads, head_dim, tokens) for name in names
    }
    if not bits:
        raise ValueError("no codec named")
    lightest, heaviest = min(bits, key=bits.__getitem__), max(bits, key=bits.__getitem__)
    return BitsRange(lightest, bits[lightest], heaviest, bits[heaviest])
