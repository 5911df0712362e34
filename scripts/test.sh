#!/usr/bin/env bash
# The whole test suite: sets up both environments (the project's and the real vLLM's,
# built once and reused), checks lint and types, then runs every test, real vLLM included,
# and runs the engine's exactness tests again under a forced OpenBLAS kernel other than this
# machine's (Haswell, or Sandybridge where Haswell is native), so that a break of the engine's
# bitwise promise on any CPU shows here.
set -euo pipefail
cd "$(dirname "$0")/.."

scripts/setup.sh
scripts/setup-vllm.sh
scripts/setup-deploy.sh
scripts/setup-browser.sh
scripts/start-postgres.sh
echo "test: ruff"
.venv/bin/ruff check .
echo "test: mypy (strict on the packages)"
.venv/bin/mypy
echo "test: pytest"
.venv/bin/pytest --ignore=tests/demo "$@"
# The real-model demo starts seven engine processes (~1 GiB each): it runs in a process of its
# own, not beside the memory the whole suite's process has gathered by then.
echo "test: the real-model demo"
.venv/bin/pytest tests/demo

native=$(.venv/bin/python -c 'from backends.engine.model._numerics import blas_kernel; print(blas_kernel())')
forced=Haswell
[ "$native" = Haswell ] && forced=Sandybridge
echo "test: engine exactness under OPENBLAS_CORETYPE=$forced (native kernel: $native)"
OPENBLAS_CORETYPE=$forced exec .venv/bin/pytest -q \
    tests/backends/engine/model/test_linear.py tests/backends/engine/kv/test_kvcache.py \
    tests/backends/engine/kv/test_paged_codec.py \
    tests/backends/engine/model/test_model.py tests/backends/engine/serving/test_scheduler.py \
    tests/backends/engine/serving/test_disagg.py
