#!/usr/bin/env bash
# The whole test suite: sets up both environments (the project's and the real vLLM's,
# built once and reused), checks lint and types, then runs every test, real vLLM included.
set -euo pipefail
cd "$(dirname "$0")/.."

scripts/setup.sh
scripts/setup-vllm.sh
scripts/start-postgres.sh
echo "test: ruff"
.venv/bin/ruff check .
echo "test: mypy (strict on the packages)"
.venv/bin/mypy
echo "test: pytest"
exec .venv/bin/pytest "$@"
