"""The C extensions: gateway._relaycore, the relay's per-chunk byte path (issue 15), and
backends.engine.kv.codecs._e8core, the E8 codebook search (issue 14).

Everything else about the package is in pyproject.toml; setuptools reads both. (The
extensions are declared here because ``ext-modules`` in pyproject.toml needs setuptools 74.)
_e8core is built without fused multiply-add contraction: its codes must be the same bits on
every machine (its rule 1).
"""

from setuptools import Extension, setup

_WARNINGS = ["-Wall", "-Wextra", "-Wno-unused-parameter"]

setup(ext_modules=[
    Extension(
        "gateway._relaycore", ["gateway/_relaycore.c"],
        extra_compile_args=["-O2", "-std=c11", *_WARNINGS, "-Wno-missing-field-initializers",
                            "-Wno-cast-function-type"],
    ),
    Extension(
        "backends.engine.kv.codecs._e8core", ["backends/engine/kv/codecs/_e8core.c"],
        extra_compile_args=["-O2", "-std=c11", "-ffp-contract=off", "-fno-trapping-math",
                            *_WARNINGS],
    ),
])
