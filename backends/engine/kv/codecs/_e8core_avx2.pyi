"""Types of the C extension ``backends.engine.kv.codecs._e8core_avx2``: ``_e8core.c`` built
for x86-64-v3, the same interface as ``_e8core`` (``_e8builds``)."""

from ._e8core import *  # noqa: F403
