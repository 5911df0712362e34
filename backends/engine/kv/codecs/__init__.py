"""KV codecs: how blocks of keys and values are stored, at what true size and what error.

    codec = codec_by_name("e8-2", layer=3, key_mean=means[3])
    block = codec.encode(keys, "key")          # keys: float32 [tokens, kv_heads, head_dim]
    restored = codec.decode(block)             # float32, same shape
    codec.bits_per_element(kv_heads=3, head_dim=64)   # measured from the encoded arrays

``CODECS`` names them all (fp32, fp16, fp8, kivi-8/4/2, e8-2, e8-2w); ``measure_quality``
runs the real model over real text and reports each codec's attention-output error, next-token
KL divergence and top-1 agreement against fp32.  The rules a codec keeps, and what is left to
the cache (the sink token and the recent window), are in ``_codec``'s module comment.
"""

from ._codec import EncodedBlock, KVCodec, Role
from ._quality import CodecQuality, QualityReport, measure_quality
from ._registry import CODECS, codec_by_name

__all__ = [
    "CODECS",
    "CodecQuality",
    "EncodedBlock",
    "KVCodec",
    "QualityReport",
    "Role",
    "codec_by_name",
    "measure_quality",
]
