"""The chat tokenizer a GGUF describes, built with ``tokenizers`` and rendered with jinja2.

A GGUF carries no ``tokenizer.json``: the byte-level BPE vocabulary, its merges, the token types
and the chat template are metadata.  For SmolLM2 (``tokenizer.ggml.pre == "smollm"``) llama.cpp
splits digits one by one before the GPT-2 regex; the Hugging Face tokenizer of the original model
does the same with a ``Digits`` pre-tokenizer, and so do we.  Tokens of type CONTROL (3) become
special added tokens, USER_DEFINED (4) plain added tokens, as transformers does with a GGUF.

The chat template is rendered the way ``transformers.apply_chat_template`` renders it: a sandboxed
jinja2 environment with ``trim_blocks`` and ``lstrip_blocks``, ``raise_exception``, ``tojson``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import jinja2
import jinja2.meta
import jinja2.sandbox
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

from ._gguf import TokenizerSpec

__all__ = ["ChatTokenizer"]

_CONTROL = 3
_USER_DEFINED = 4
_IM_START = "<|im_start|>"
_IM_END = "<|im_end|>"

# Pre-tokenizer names (llama.cpp `tokenizer.ggml.pre`) whose vocabularies split digits singly.
_INDIVIDUAL_DIGITS = frozenset({"smollm", "starcoder", "refact"})


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


class ChatTokenizer:
    """Encode, decode and chat-format text for one model."""

    __slots__ = (
        "_spec",
        "_template",
        "_tokenizer",
        "im_end_token_id",
        "im_start_token_id",
        "template_variables",
    )

    def __init__(self, spec: TokenizerSpec) -> None:
        if spec.model != "gpt2":
            raise ValueError(f"unsupported tokenizer model {spec.model!r}; only byte-level BPE")
        vocab = {token: index for index, token in enumerate(spec.tokens)}
        merges = [(left, right) for left, _, right in (m.partition(" ") for m in spec.merges)]
        bpe = models.BPE(vocab=vocab, merges=merges, fuse_unk=False)
        tokenizer = Tokenizer(bpe)
        byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        if spec.pre in _INDIVIDUAL_DIGITS:
            tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
                [pre_tokenizers.Digits(individual_digits=True), byte_level]
            )
        else:
            tokenizer.pre_tokenizer = byte_level
        tokenizer.decoder = decoders.ByteLevel()
        types = spec.token_types or (1,) * len(spec.tokens)
        tokenizer.add_special_tokens(
            [
                AddedToken(tok, normalized=False, special=True)
                for tok, kind in zip(spec.tokens, types, strict=True)
                if kind == _CONTROL
            ]
        )
        tokenizer.add_tokens(
            [
                AddedToken(tok, normalized=False, special=False)
                for tok, kind in zip(spec.tokens, types, strict=True)
                if kind == _USER_DEFINED
            ]
        )
        self._spec = spec
        self._tokenizer = tokenizer
        self.im_start_token_id = tokenizer.token_to_id(_IM_START)
        self.im_end_token_id = tokenizer.token_to_id(_IM_END)
        self._template: jinja2.Template | None = None
        # The names the chat template reads and does not set itself: those a render's extra
        # variables (vLLM's ``chat_template_kwargs``) can change.
        self.template_variables: frozenset[str] = frozenset()
        if spec.chat_template is not None:
            env = jinja2.sandbox.ImmutableSandboxedEnvironment(
                trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
            )
            env.globals["raise_exception"] = _raise_exception
            self._template = env.from_string(spec.chat_template)
            self.template_variables = frozenset(
                jinja2.meta.find_undeclared_variables(env.parse(spec.chat_template))
            )

    @property
    def backend(self) -> Tokenizer:
        """The underlying ``tokenizers.Tokenizer``."""
        return self._tokenizer

    @property
    def vocab_size(self) -> int:
        return len(self._spec.tokens)

    @property
    def bos_token_id(self) -> int | None:
        return self._spec.bos_token_id

    @property
    def eos_token_id(self) -> int | None:
        return self._spec.eos_token_id

    @property
    def stop_token_ids(self) -> frozenset[int]:
        """Token ids that end a chat answer: eos and ``<|im_end|>``."""
        ids = {self._spec.eos_token_id, self.im_end_token_id}
        return frozenset(i for i in ids if i is not None)

    def _token(self, token_id: int | None) -> str:
        return "" if token_id is None else self._spec.tokens[token_id]

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``; special tokens written in the text are recognised."""
        return list(self._tokenizer.encode(text, add_special_tokens=False).ids)

    def decode(self, token_ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        return str(self._tokenizer.decode(list(token_ids), skip_special_tokens=skip_special_tokens))

    def render_chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool = True,
        **extra: Any,
    ) -> str:
        """The chat template applied to ``messages`` (OpenAI-style role/content dicts); ``extra``
        variables may set the special tokens' text, as in ``transformers``, not the messages."""
        if self._template is None:
            raise ValueError("this model's GGUF carries no chat template")
        variables = {
            "bos_token": self._token(self._spec.bos_token_id),
            "eos_token": self._token(self._spec.eos_token_id),
            **extra,
        }
        return self._template.render(
            messages=[dict(m) for m in messages],
            add_generation_prompt=add_generation_prompt,
            **variables,
        )

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool = True,
        **extra: Any,
    ) -> list[int]:
        """Token ids of the rendered chat, like ``transformers``' ``apply_chat_template``."""
        return self.encode(
            self.render_chat(messages, add_generation_prompt=add_generation_prompt, **extra)
        )
