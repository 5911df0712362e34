#!/usr/bin/env bash
# One command: set up, then run understudy on a self-contained local setup: the vLLM
# protocol simulator as the primary and the gateway in front of it (examples/understudy.toml).
# It sends a few requests through the gateway with the openai client and shows what the
# gateway measured. Pass --once to stop after that; otherwise it serves until Ctrl-C.
set -euo pipefail
cd "$(dirname "$0")/.."

scripts/setup.sh >/dev/null
exec .venv/bin/python examples/demo.py "$@"
