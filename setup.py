"""The C extensions: gateway._relaycore, the relay's per-chunk byte path (issue 15), and
backends.engine.kv.codecs._e8core, the E8 codebook search (issue 14).

Everything else about the package is in pyproject.toml; setuptools reads both. (The
extensions are declared here because ``ext-modules`` in pyproject.toml needs setuptools 74.)
_e8core is built without fused multiply-add contraction: its codes must be the same bits on
every machine (its rule 1).  It is built at -O3 for x86-64-v2 (SSE4.2, numpy 2's own baseline,
so every machine numpy runs on): the same codes, ~10-20 % less search time than -O2 (rule 1
holds: neither flag reassociates or contracts).  On x86-64 the same file is built a second
time, as _e8core_avx2 for x86-64-v3 (AVX2: 4 rows in a register where SSE holds 2; FMA is
in that level but -ffp-contract=off keeps it out), which _e8builds.py runs where the CPU can.
"""

import platform

from setuptools import Extension, setup

_WARNINGS = ["-Wall", "-Wextra", "-Wno-unused-parameter"]
_X86_64 = platform.machine() in ("x86_64", "AMD64")
_E8_TARGET = ["-march=x86-64-v2"] if _X86_64 else []
_E8_ARGS = ["-O3", "-std=c11", "-ffp-contract=off", "-fno-trapping-math", *_WARNINGS]
_E8_SOURCE = "backends/engine/kv/codecs/_e8core.c"
_E8_AVX2 = [Extension(
    "backends.engine.kv.codecs._e8core_avx2", [_E8_SOURCE],
    define_macros=[("E8CORE_AVX2", "1")], extra_compile_args=["-march=x86-64-v3", *_E8_ARGS],
)] if _X86_64 else []

setup(ext_modules=[
    Extension(
        "gateway._relaycore", ["gateway/_relaycore.c"],
        extra_compile_args=["-O2", "-std=c11", *_WARNINGS, "-Wno-missing-field-initializers",
                            "-Wno-cast-function-type"],
    ),
    Extension(
        "backends.engine.kv.codecs._e8core", [_E8_SOURCE],
        extra_compile_args=[*_E8_TARGET, *_E8_ARGS],
    ),
    *_E8_AVX2,
])
