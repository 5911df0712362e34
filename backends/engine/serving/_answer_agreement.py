"""Greedy answers of the real engine with a KV codec (or plan) against the fp32 engine's.

Rules
-----
1. Every question of ``QUESTIONS`` is asked through the chat template, greedy, for at most
   ``max_tokens`` tokens, of an fp32 engine and of one engine per codec or plan: the engine
   that would serve it (paged cache, its own block raw, the same code path as ``--kv-codec``).
   All questions run as one batch; a request's tokens do not depend on its batch neighbours
   (the engine's rows are independent), so batching changes the speed only.
2. ``identical``: the share of questions whose answer is the fp32 answer token for token.
   ``token_agreement``: the share of the fp32 answers' tokens produced before the first
   divergence (a diverged answer is a different answer from there on; later coincidences
   are not counted).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from .._arrays import Float32Array
from ..kv._plan import KVPlan
from ..kv.codecs._texts import QUESTIONS
from ..model._model import LlamaModel
from ..model._sampling import SamplingParams
from ._engine import Engine

__all__ = [
    "DEFAULT_ANSWER_TOKENS",
    "MAX_ANSWER_TOKENS",
    "AnswerAgreement",
    "answer_agreement",
    "greedy_answers",
]

DEFAULT_ANSWER_TOKENS = 24
"""Tokens of each greedy answer compared (short answers: the questions are short)."""
_KV_LIMIT_BYTES = 64 << 20
MAX_ANSWER_TOKENS = 1024
"""The longest answer asked for: a question's prompt (under 100 tokens) and this many tokens fit
the fp32 reference engine's pool of ``_KV_LIMIT_BYTES`` (90 blocks, 1,440 tokens); past it the
engine refuses the request, which ``kv-quality`` found out only after its measurement."""

Calibration = tuple[Sequence[Float32Array], Sequence[Float32Array]]


@dataclass(frozen=True, slots=True)
class AnswerAgreement:
    """One codec's greedy answers against fp32's (rule 2)."""

    codec: str
    questions: int
    identical: float
    token_agreement: float
    seconds: float


def greedy_answers(
    model: LlamaModel,
    codec: str | KVPlan,
    questions: Sequence[str],
    max_tokens: int,
    calibration: Calibration | None = None,
) -> list[list[int]]:
    """Each question's greedy answer (token ids) from an engine storing KV by ``codec``."""
    # One seat per question: a windowed plan reserves each running sequence's raw window.
    engine = Engine(
        model,
        _KV_LIMIT_BYTES,
        kv_codec=codec,
        kv_calibration=calibration,
        max_num_seqs=max(1, len(questions)),
    )
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    answers: dict[str, list[int]] = {}
    for index, question in enumerate(questions):
        ids = model.tokenizer.apply_chat_template([{"role": "user", "content": question}])
        engine.add_request(str(index), ids, params)
        answers[str(index)] = []
    while engine.has_unfinished_requests():
        for event in engine.step():
            answers[event.request_id].append(event.token_id)
    return [answers[str(index)] for index in range(len(questions))]


def _agreed_prefix(reference: Sequence[int], answer: Sequence[int]) -> int:
    agreed = 0
    for a, b in zip(reference, answer, strict=False):
        if a != b:
            break
        agreed += 1
    return agreed


def answer_agreement(
    model: LlamaModel,
    codecs: Sequence[str | KVPlan],
    *,
    questions: Sequence[str] = QUESTIONS,
    max_tokens: int = DEFAULT_ANSWER_TOKENS,
    calibration: Calibration | None = None,
    progress: Callable[[str], None] | None = None,
) -> list[AnswerAgreement]:
    """Each codec's agreement with the fp32 engine's greedy answers (see the module comment)."""
    say = progress or (lambda _: None)
    reference = greedy_answers(model, "fp32", questions, max_tokens)
    results = []
    for codec in codecs:
        label = codec if isinstance(codec, str) else codec.name
        started = time.perf_counter()
        answers = greedy_answers(model, codec, questions, max_tokens, calibration)
        identical = [a == r for a, r in zip(answers, reference, strict=True)]
        agreed = sum(_agreed_prefix(r, a) for r, a in zip(reference, answers, strict=True))
        total = sum(len(r) for r in reference)
        result = AnswerAgreement(
            codec=label,
            questions=len(questions),
            identical=float(np.mean(identical)),
            token_agreement=agreed / total if total else 1.0,
            seconds=time.perf_counter() - started,
        )
        say(f"greedy answers {label}: {result.identical:.0%} identical")
        results.append(result)
    return results
