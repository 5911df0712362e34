"""The C extensions: gateway._relaycore, the relay's per-chunk byte path (issue 15), and
backends.engine.kv.codecs._e8core, the E8 codebook search (issue 14).

Everything else about the package is in pyproject.toml; setuptools reads both. (The
extensions are declared here because ``ext-modules`` in pyproject.toml needs setuptools 74.)
_e8core is built without fused multiply-add contraction: its codes must be the same bits on
every machine (its rule 1).  It is built at -O3 for x86-64-v2 (SSE4.2, numpy 2's own baseline,
so every machine numpy runs on): the same codes, ~10-20 % less search time than -O2 (rule 1
holds: neither flag reassociates or contracts).
"""

import platform

from setuptools import Extension, setup

_WARNINGS = ["-Wall", "-Wextra", "-Wno-unused-parameter"]
_E8_TARGET = ["-march=x86-64-v2"] if platform.machine() in ("x86_64", "AMD64") else []

setup(ext_modules=[
    Extension(
        "gateway._relaycore", ["gateway/_relaycore.c"],
        extra_compile_args=["-O2", "-std=c11", *_WARNINGS, "-Wno-missing-field-initializers",
                            "-Wno-cast-function-type"],
    ),
    Extension(
        "backends.engine.kv.codecs._e8core", ["backends/engine/kv/codecs/_e8core.c"],
        extra_compile_args=["-O3", *_E8_TARGET, "-std=c11", "-ffp-contract=off",
                            "-fno-trapping-math", *_WARNINGS],
    ),
])
