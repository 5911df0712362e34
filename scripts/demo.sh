#!/usr/bin/env bash
# One command: set up, then run the real-model demo on the embedded default (SQLite,
# loopback processes, no Docker): `understudy demo` starts the primary (the reference
# engine serving SmolLM2, recompute baseline), its replica (the noise floor) and three
# candidates (the bidirectional-KV disaggregated engine, a 4-bit KIVI engine, a 2-bit one
# that is deliberately worse) behind the gateway, each on its own fixed CPU slice where the
# machine allows cgroups (as root here), drives agentic multi-turn sessions through it with
# the openai client, prints the scorecard and promotes what the judge passes. Flags go to `understudy demo` (--sessions, --turns, --minutes, --primary-vllm,
# --no-promote, --workdir).
set -euo pipefail
cd "$(dirname "$0")/.."

scripts/setup.sh >/dev/null
exec .venv/bin/understudy demo "$@"
