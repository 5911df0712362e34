"""The real vLLM tier: where the vLLM virtualenv and model live, and how to run a server.

Build the tier once with ``scripts/setup-vllm.sh``; then ``VLLMServer(VLLMProfile(...))``.
"""

from backends.vllm._launch import (
    VLLMProfile,
    VLLMServer,
    VLLMServerError,
    command,
    default_vllm_home,
    environment,
    model_dir,
    vllm_python,
)

__all__ = [
    "VLLMProfile",
    "VLLMServer",
    "VLLMServerError",
    "command",
    "default_vllm_home",
    "environment",
    "model_dir",
    "vllm_python",
]
