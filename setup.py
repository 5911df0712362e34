"""The one C extension, gateway._relaycore: the relay's per-chunk byte path (issue 15).

Everything else about the package is in pyproject.toml; setuptools reads both. (The
extension is declared here because ``ext-modules`` in pyproject.toml needs setuptools 74.)
"""

from setuptools import Extension, setup

setup(ext_modules=[Extension(
    "gateway._relaycore", ["gateway/_relaycore.c"],
    extra_compile_args=["-O2", "-std=c11", "-Wall", "-Wextra", "-Wno-unused-parameter",
                        "-Wno-missing-field-initializers", "-Wno-cast-function-type"],
)])
