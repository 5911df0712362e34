"""Agentic traffic mirrored and scored: tool calls, several choices, refusals.

A small aiohttp upstream plays the primary and the candidate and answers exactly the shape
a test needs (the simulator's answers are too regular); the real ``openai`` client talks to
the gateway; every exchange is joined into a MemorySink and scored by the real scorers.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import openai
import orjson
import pytest
from aiohttp import web

from evaluators import Capture, Exchange, Gates, ReportInputs, Usage, judge_inputs, observe
from evaluators._exchange import json_requested, requested_choices
from evaluators._observation import CLIENT_DISCONNECTED
from evaluators._scorers import build_scorers
from evaluators._scorers_timing import ReliabilityScorer, ThroughputScorer
from evaluators.store import EvaluatedRequests, StoredSamples
from gateway._cli_eval import _print as print_report
from tests.utils import eventually, leave_stream_after, run_gateway, run_sim, serving

TEXT_SCORERS = ("exact_match", "edit_similarity", "token_f1", "tool_calls", "finish_reason")
TEXT_METRICS = ("quality.exact_match", "quality.edit_similarity", "quality.token_f1")

Answer = Callable[[dict[str, Any]], tuple[list[dict[str, Any]], dict[str, Any]]]
"""(the request's body) -> (the stream's choice deltas, one per event; the message answer)."""


def _event(choices: list[dict[str, Any]], usage: dict[str, Any] | None = None) -> bytes:
    doc: dict[str, Any] = {"id": "c1", "object": "chat.completion.chunk", "created": 1,
                           "model": "m", "choices": choices}
    if usage is not None:
        doc["usage"] = usage
    return b"data: " + orjson.dumps(doc) + b"\n\n"


USAGE = {"prompt_tokens": 7, "completion_tokens": 5, "total_tokens": 12}


@asynccontextmanager
async def _upstream(answer: Answer) -> AsyncIterator[str]:
    """An OpenAI chat server whose answers ``answer`` makes, streamed as given or whole."""

    async def chat(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        deltas, whole = answer(body)
        if body.get("stream") is not True:
            return web.json_response({"id": "c1", "object": "chat.completion", "created": 1,
                                      "model": "m", "choices": whole["choices"],
                                      "usage": USAGE})
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for choice in deltas:
            await response.write(_event([choice]))
        if (body.get("stream_options") or {}).get("include_usage"):
            await response.write(_event([], USAGE))
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    async with serving(web.AppRunner(app)) as url:
        yield url


async def _exchange(primary: Answer, candidate: Answer, *, stream: bool,
                    **request: Any) -> Exchange:
    """One chat request through a gateway mirroring to ``candidate``; its joined exchange."""
    async with _upstream(primary) as primary_url, _upstream(candidate) as candidate_url, \
            run_gateway(primary_url, candidates=[{"name": "cand", "url": candidate_url}]) as gw:
        client = openai.AsyncOpenAI(base_url=gw.base_url, api_key="x", max_retries=0)
        try:
            answer = await client.chat.completions.create(
                model="m", stream=stream, messages=HISTORY, **request)
            if stream:
                async for _ in answer:  # type: ignore[union-attr]
                    pass
        finally:
            await client.close()
        await eventually(lambda: len(gw.sink) == 1)
        return gw.sink.snapshot()[0]


def _scores(exchange: Exchange) -> dict[str, float | None]:
    return {score.metric: score.candidate
            for scorer in build_scorers(TEXT_SCORERS) for score in scorer.score(exchange)}


# An agent's turn: an earlier tool call and its result in the history.
HISTORY: list[Any] = [
    {"role": "user", "content": "Weather in Paris, then Berlin?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": '{"temp_c": 21}'},
]
TOOLS: list[Any] = [{"type": "function", "function": {
    "name": "get_weather", "parameters": {"type": "object",
                                          "properties": {"city": {"type": "string"}}}}}]


def _tool_call(arguments: str) -> Answer:
    """A tool-call-only answer, its arguments streamed in two pieces as vLLM does."""
    def answer(body: dict[str, Any]) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        assert body["tools"] == TOOLS and body["messages"] == HISTORY
        half = len(arguments) // 2
        deltas = [
            {"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None},
            {"index": 0, "delta": {"tool_calls": [{"index": 0, "id": "call_2", "type": "function",
                                                   "function": {"name": "get_weather",
                                                                "arguments": arguments[:half]}}]},
             "finish_reason": None},
            {"index": 0, "delta": {"tool_calls": [{"index": 0,
                                                   "function": {"arguments": arguments[half:]}}]},
             "finish_reason": None},
            {"index": 0, "delta": {}, "finish_reason": "tool_calls"},
        ]
        message = {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_2", "type": "function",
             "function": {"name": "get_weather", "arguments": arguments}}]}
        return deltas, {"choices": [{"index": 0, "message": message,
                                     "finish_reason": "tool_calls"}]}
    return answer


@pytest.mark.parametrize("stream", [True, False])
async def test_tool_call_answers_are_judged_by_their_calls_not_as_equal_empty_texts(
        stream: bool) -> None:
    exchange = await _exchange(_tool_call('{"city": "Berlin"}'), _tool_call('{"city": "Rome"}'),
                               stream=stream, tools=TOOLS, tool_choice="auto")
    scores = _scores(exchange)
    # Different calls: the calls' metric says so, and no text metric claims agreement.
    assert scores["quality.tool_call_match"] == 0.0
    assert all(scores[m] is None for m in TEXT_METRICS), scores
    assert scores["quality.finish_reason_match"] == 1.0
    # Streamed or not, the observation is the same: the calls, the reason, no text.
    for observation in (exchange.primary, exchange.candidate_observation):
        assert observation.text == "" and observation.finish_reason == "tool_calls"
    assert exchange.primary.tool_calls == (
        {"name": "get_weather", "arguments": '{"city": "Berlin"}'},)


@pytest.mark.parametrize("stream", [True, False])
async def test_same_tool_call_with_other_key_order_and_spacing_matches(stream: bool) -> None:
    exchange = await _exchange(_tool_call('{"city":"Berlin","unit":"c"}'),
                               _tool_call('{ "unit": "c",\n "city": "Berlin" }'),
                               stream=stream, tools=TOOLS)
    scores = _scores(exchange)
    assert scores["quality.tool_call_match"] == 1.0
    assert all(scores[m] is None for m in TEXT_METRICS), scores


def _text(answer: str) -> Answer:
    def respond(body: dict[str, Any]) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        deltas: list[dict[str, Any]] = [
            {"index": 0, "delta": {"content": piece}, "finish_reason": None}
            for piece in (answer[:3], answer[3:])]
        deltas.append({"index": 0, "delta": {}, "finish_reason": "stop"})
        return deltas, {"choices": [{"index": 0, "finish_reason": "stop",
                                     "message": {"role": "assistant", "content": answer}}]}
    return respond


@pytest.mark.parametrize("stream", [True, False])
async def test_text_where_the_primary_called_a_tool_differs_as_text(stream: bool) -> None:
    exchange = await _exchange(_tool_call('{"city": "Berlin"}'), _text("Berlin is 18 °C."),
                               stream=stream, tools=TOOLS)
    scores = _scores(exchange)
    assert scores["quality.tool_call_match"] == 0.0
    assert scores["quality.exact_match"] == 0.0 and scores["quality.token_f1"] == 0.0
    assert scores["quality.finish_reason_match"] == 0.0


def _two_choices(first: str, second: str, *, second_first: bool) -> Answer:
    """n=2: the choices' deltas interleaved, in an order a backend's scheduling picks."""
    def respond(body: dict[str, Any]) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        assert body["n"] == 2
        pieces = {0: [first[:2], first[2:]], 1: [second[:2], second[2:]]}
        order = [1, 0, 1, 0] if second_first else [0, 1, 0, 1]
        deltas: list[dict[str, Any]] = [
            {"index": i, "delta": {"content": pieces[i].pop(0)}, "finish_reason": None}
            for i in order]
        deltas += [{"index": 0, "delta": {}, "finish_reason": "stop"},
                   {"index": 1, "delta": {}, "finish_reason": "length"}]
        return deltas, {"choices": [
            {"index": 0, "finish_reason": "stop",
             "message": {"role": "assistant", "content": first}},
            {"index": 1, "finish_reason": "length",
             "message": {"role": "assistant", "content": second}}]}
    return respond


@pytest.mark.parametrize("stream", [True, False])
async def test_several_choices_compare_the_first_choice_whatever_the_interleaving(
        stream: bool) -> None:
    exchange = await _exchange(_two_choices("Paris is sunny", "Rain in Berlin",
                                            second_first=False),
                               _two_choices("Paris is sunny", "Rain in Berlin",
                                            second_first=True),
                               stream=stream, n=2)
    for observation in (exchange.primary, exchange.candidate_observation):
        assert (observation.text, observation.finish_reason) == ("Paris is sunny", "stop")
    scores = _scores(exchange)
    assert all(scores[m] == 1.0 for m in TEXT_METRICS), scores


def _refusal(text: str) -> Answer:
    def respond(body: dict[str, Any]) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        deltas = [{"index": 0, "delta": {"role": "assistant", "content": None, "refusal": ""},
                   "finish_reason": None},
                  {"index": 0, "delta": {"refusal": text}, "finish_reason": None},
                  {"index": 0, "delta": {}, "finish_reason": "stop"}]
        return deltas, {"choices": [{"index": 0, "finish_reason": "stop", "message": {
            "role": "assistant", "content": None, "refusal": text}}]}
    return respond


@pytest.mark.parametrize("stream", [True, False])
async def test_a_refusal_is_the_answer_text_it_is_compared_on(stream: bool) -> None:
    exchange = await _exchange(_text("Berlin is 18 °C."), _refusal("I can't help with that."),
                               stream=stream)
    assert exchange.candidate_observation.text == "I can't help with that."
    scores = _scores(exchange)
    assert scores["quality.exact_match"] == 0.0 and scores["quality.token_f1"] == 0.0


async def test_a_client_that_stops_reading_is_no_primary_failure() -> None:
    # An agent that has read enough of a stream closes it: the primary's answer is cut on
    # the client's side, which says nothing of the primary's reliability.
    async with run_sim(ttft_ms=1, itl_ms=20, tokens=40) as primary, \
            run_sim(ttft_ms=1, itl_ms=1, tokens=40) as candidate, \
            run_gateway(primary.url, candidates=[{"name": "cand", "url": candidate.url}]) as gw:
        client = openai.AsyncOpenAI(base_url=gw.base_url, api_key="x", max_retries=0)
        try:
            stream = await client.chat.completions.create(
                model="sim-model", messages=[{"role": "user", "content": "hi"}], stream=True)
            await leave_stream_after(stream, 3)
        finally:
            await client.close()
        await eventually(lambda: len(gw.sink) == 1)
        exchange = gw.sink.snapshot()[0]
    assert exchange.primary.error == CLIENT_DISCONNECTED
    assert exchange.candidate_observation.ok
    scores = {s.metric: s for s in ReliabilityScorer().score(exchange)}
    success = scores["reliability.success"]
    assert (success.candidate, success.primary) == (1.0, None)


async def test_a_long_answer_that_is_not_a_stream_keeps_its_usage_past_the_capture() -> None:
    # 2000 tokens, not streamed, past a 4 KiB capture: the text is lost, the usage at the
    # answer's end is not, so throughput (and cost) are measured as for a stream.
    async with run_sim(ttft_ms=1, itl_ms=0, tokens=2000) as primary, \
            run_sim(ttft_ms=1, itl_ms=0, tokens=2000) as candidate, \
            run_gateway(primary.url, candidates=[{"name": "cand", "url": candidate.url}],
                        capture={"max_bytes": 4096}) as gw:
        client = openai.AsyncOpenAI(base_url=gw.base_url, api_key="x", max_retries=0)
        try:
            await client.chat.completions.create(
                model="sim-model", messages=[{"role": "user", "content": "a long story"}])
        finally:
            await client.close()
        await eventually(lambda: len(gw.sink) == 1)
        exchange = gw.sink.snapshot()[0]
    for observation in (exchange.primary, exchange.candidate_observation):
        assert observation.truncated and observation.text is None
        assert observation.usage is not None and observation.usage.completion_tokens == 2001
    tps = next(s for s in ThroughputScorer().score(exchange))
    assert tps.candidate is not None and tps.primary is not None


def _truncated(answer: bytes, keep: int) -> Capture:
    capture = Capture(started=0.0, max_bytes=keep, max_chunk_times=8, status=200)
    capture.add_chunk(0.0, answer)
    return capture


def test_usage_is_read_from_a_truncated_answer_s_tail_only_where_it_is_whole() -> None:
    message = '{"a": 1, \\"usage\\": {\\"prompt_tokens\\": 99}}'  # escaped: not the usage
    answer = orjson.dumps({"id": "c", "choices": [{"index": 0, "message": {
        "role": "assistant", "content": "x" * 500 + message}, "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}})
    observed = observe(_truncated(answer, 100), request_id="r", backend="b", route="chat",
                       wall_started=0.0)
    assert observed.truncated and observed.usage == Usage(3, 2, None)
    assert observed.text is None and observed.finish_reason is None
    cut = observe(_truncated(answer[:-20], 100), request_id="r", backend="b", route="chat",
                  wall_started=0.0)
    assert cut.usage is None


async def test_an_embeddings_request_has_no_output_rate() -> None:
    # vLLM (and the simulator) report completion_tokens: 0 for embeddings: no output is
    # not an output rate of 0 tokens/s, which would sit among the chat answers' rates.
    async with run_sim(ttft_ms=1) as primary, run_sim(ttft_ms=1) as candidate, \
            run_gateway(primary.url, candidates=[{"name": "cand", "url": candidate.url}]) as gw:
        client = openai.AsyncOpenAI(base_url=gw.base_url, api_key="x", max_retries=0)
        try:
            await client.embeddings.create(model="sim-model", input=["tool result", "query"])
        finally:
            await client.close()
        await eventually(lambda: len(gw.sink) == 1)
        exchange = gw.sink.snapshot()[0]
    assert exchange.route == "embeddings" and exchange.candidate_observation.ok
    assert exchange.primary.usage is not None and exchange.primary.usage.completion_tokens == 0
    tps = next(s for s in ThroughputScorer().score(exchange))
    assert (tps.candidate, tps.primary) == (None, None)


def _parallel_calls(*calls: tuple[str, str]) -> Answer:
    """Parallel tool calls in one message, in the order given, each streamed in two pieces
    under its own index (vLLM's framing)."""
    def answer(body: dict[str, Any]) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        deltas: list[dict[str, Any]] = [
            {"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]
        for i, (name, arguments) in enumerate(calls):
            half = len(arguments) // 2
            deltas += [
                {"index": 0, "delta": {"tool_calls": [{
                    "index": i, "id": f"call_{i}", "type": "function",
                    "function": {"name": name, "arguments": arguments[:half]}}]},
                 "finish_reason": None},
                {"index": 0, "delta": {"tool_calls": [{
                    "index": i, "function": {"arguments": arguments[half:]}}]},
                 "finish_reason": None}]
        deltas.append({"index": 0, "delta": {}, "finish_reason": "tool_calls"})
        message = {"role": "assistant", "content": None, "tool_calls": [
            {"id": f"call_{i}", "type": "function",
             "function": {"name": name, "arguments": arguments}}
            for i, (name, arguments) in enumerate(calls)]}
        return deltas, {"choices": [{"index": 0, "message": message,
                                     "finish_reason": "tool_calls"}]}
    return answer


PARIS = ("get_weather", '{"city": "Paris"}')
BERLIN = ("get_weather", '{"city": "Berlin"}')
TIME_BERLIN = ("get_time", '{"city": "Berlin"}')


@pytest.mark.parametrize("stream", [True, False])
async def test_parallel_tool_calls_in_another_order_match(stream: bool) -> None:
    # Parallel calls of one message are independent (the client runs them all and answers
    # each by its id): the order a model lists them in carries no meaning.
    exchange = await _exchange(_parallel_calls(PARIS, BERLIN, TIME_BERLIN),
                               _parallel_calls(TIME_BERLIN, PARIS, BERLIN),
                               stream=stream, tools=TOOLS, parallel_tool_calls=True)
    assert len(exchange.candidate_observation.tool_calls) == 3
    assert _scores(exchange)["quality.tool_call_match"] == 1.0


@pytest.mark.parametrize(("candidate", "why"), [
    ((BERLIN, BERLIN), "one call twice, the other missing"),
    ((PARIS,), "a call missing"),
    ((PARIS, BERLIN, BERLIN), "a call more"),
    ((BERLIN, ("get_weather", '{"city": "Rome"}')), "other arguments"),
])
async def test_parallel_tool_calls_match_only_as_the_same_calls(
        candidate: tuple[tuple[str, str], ...], why: str) -> None:
    exchange = await _exchange(_parallel_calls(PARIS, BERLIN), _parallel_calls(*candidate),
                               stream=True, tools=TOOLS)
    assert _scores(exchange)["quality.tool_call_match"] == 0.0, why


def _choices(exchange: Exchange) -> tuple[float | None, float | None]:
    score = only_score(build_scorers(("choices",)), exchange)
    return score.candidate, score.primary


def only_score(scorers: list[Any], exchange: Exchange) -> Any:
    (score,) = [s for scorer in scorers for s in scorer.score(exchange)]
    return score


@pytest.mark.parametrize("stream", [True, False])
async def test_a_candidate_that_answers_fewer_choices_than_asked_is_counted(
        stream: bool) -> None:
    # n=2: the primary answers both choices, the candidate only the first. Choice 0 agrees,
    # so every text metric says 1.0; the missing choice must be seen all the same.
    exchange = await _exchange(_two_choices("Paris is sunny", "Rain in Berlin",
                                            second_first=False),
                               _text("Paris is sunny"), stream=stream, n=2)
    assert exchange.requested_choices == 2
    assert (exchange.primary.choices, exchange.candidate_observation.choices) == (2, 1)
    assert _choices(exchange) == (0.0, 1.0)
    assert _scores(exchange)["quality.exact_match"] == 1.0


@pytest.mark.parametrize("stream", [True, False])
async def test_an_answer_with_the_choices_asked_for_is_complete(stream: bool) -> None:
    exchange = await _exchange(_text("Paris is sunny"), _text("Paris is sunny"), stream=stream)
    assert exchange.requested_choices == 1
    assert _choices(exchange) == (1.0, 1.0)


@pytest.mark.parametrize(("route", "payload", "expected"), [
    ("chat_completions", {"messages": []}, 1),
    ("chat_completions", {"messages": [], "n": 3}, 3),
    ("chat_completions", {"messages": [], "n": None}, 1),
    ("chat_completions", {"messages": [], "n": "2"}, None),
    ("chat_completions", {"messages": [], "n": True}, None),
    ("chat_completions", {"messages": [], "n": 0}, None),
    ("completions", {"prompt": "once upon"}, 1),
    ("completions", {"prompt": ["a", "b", "c"], "n": 2}, 6),
    ("completions", {"prompt": [1, 2, 3]}, 1),
    ("completions", {"prompt": [[1, 2], [3]]}, 2),
    ("completions", {"prompt": []}, None),
    ("completions", {"prompt": {"x": 1}}, None),
    ("embeddings", {"input": "x"}, None),
    ("chat_completions", None, None),
])
def test_choices_requested_by_a_request(route: str, payload: dict[str, Any] | None,
                                        expected: int | None) -> None:
    assert requested_choices(route, payload) == expected


async def test_answers_cut_at_the_capture_are_counted_as_the_reason_quality_is_unknown(
        ) -> None:
    # A 4 KiB capture: the candidate's long answer outgrows it, the primary's short one
    # does not. Its quality is unknown; the reason is counted, by side, and scored.
    async with run_sim(ttft_ms=1, itl_ms=0, tokens=8) as primary, \
            run_sim(ttft_ms=1, itl_ms=0, tokens=2000) as candidate, \
            run_gateway(primary.url, candidates=[{"name": "cand", "url": candidate.url}],
                        capture={"max_bytes": 4096}) as gw:
        client = openai.AsyncOpenAI(base_url=gw.base_url, api_key="x", max_retries=0)
        try:
            for stream in (True, False):
                answer = await client.chat.completions.create(
                    model="sim-model", messages=[{"role": "user", "content": "a story"}],
                    stream=stream)
                if stream:
                    async for _ in answer:  # type: ignore[union-attr]
                        pass
        finally:
            await client.close()
        await eventually(lambda: len(gw.sink) == 2)
        truncated = {side: gw.metric("understudy_mirror_truncated_total", candidate="cand",
                                     side=side) for side in ("candidate", "primary")}
        exchanges = gw.sink.snapshot()
    assert truncated == {"candidate": 2.0, "primary": 0.0}
    scorers = build_scorers(("exact_match", "capture"))
    for exchange in exchanges:
        scores = {s.metric: s for scorer in scorers for s in scorer.score(exchange)}
        assert scores["quality.exact_match"].candidate is None
        capture = scores["capture.truncated"]
        assert (capture.candidate, capture.primary) == (1.0, 0.0)


def test_the_report_counts_the_exchanges_whose_answers_the_capture_cut(
        capsys: pytest.CaptureFixture[str]) -> None:
    stored = {"capture.truncated": StoredSamples([1.0, 0.0, 1.0, 0.0], [0.0, 0.0, 1.0, 0.0]),
              "quality.exact_match": StoredSamples([1.0, 1.0], [])}
    inputs = ReportInputs(candidate="cand", secondary=None, since=None, capped=False,
                          stored=stored, floor={}, conditioned={}, replica={},
                          evaluated=EvaluatedRequests(), traffic=[])
    judged = judge_inputs(inputs, Gates())
    report = judged.to_dict()
    assert report["unscored"] == {"capture_truncated": {
        "exchanges": 2, "candidate": 2, "primary": 1,
        "why": "an answer outgrew [capture] max_bytes: its text is unknown, its quality "
               "not scored"}}
    metric = next(m for m in report["metrics"] if m["metric"] == "capture.truncated")
    assert metric["gated"] is False
    print_report(judged)  # the CLI's table says it too
    assert "2 exchanges without quality values, capture_truncated: candidate 2, primary 1" \
        in " ".join(capsys.readouterr().out.split())


@pytest.mark.parametrize(("primary", "candidate", "low", "high"), [
    # Chinese and Japanese put no spaces between words: each ideograph or kana is a token
    # (MLQA's segmentation), or near-identical answers score as wholly different.
    ("巴黎是法国的首都。", "巴黎是法国首都。", 0.9, 0.95),
    ("東京は日本の首都です。", "東京は日本の首都だ。", 0.75, 0.85),
    # Punctuation beyond ASCII is punctuation: full-width stops, guillemets, dashes.
    ("Paris。", "Paris", 1.0, 1.0),
    ("«Paris», dit-il — enfin.", "Paris dit-il enfin", 1.0, 1.0),
    ("Der Preis beträgt 5 €.", "Der Preis beträgt 5 €", 1.0, 1.0),
    ("巴黎", "柏林", 0.0, 0.0),
])
async def test_token_f1_reads_words_beyond_ascii(primary: str, candidate: str, low: float,
                                                 high: float) -> None:
    exchange = await _exchange(_text(primary), _text(candidate), stream=True)
    f1 = _scores(exchange)["quality.token_f1"]
    assert f1 is not None and low <= f1 <= high, f1


def _json_validity(exchange: Exchange) -> tuple[float | None, float | None]:
    score = only_score(build_scorers(("json_validity",)), exchange)
    return score.candidate, score.primary


JSON_MODE: Any = {"type": "json_object"}


@pytest.mark.parametrize("stream", [True, False])
async def test_json_mode_holds_both_answers_to_json_even_when_the_primary_strays(
        stream: bool) -> None:
    # The request asked for JSON: a primary that answers prose fails it, where inferring
    # "wanted JSON" from the primary's own answer would not judge the exchange at all.
    exchange = await _exchange(_text('Sure! {"city": "Paris"}'), _text('{"city": "Paris"}'),
                               stream=stream, response_format=JSON_MODE)
    assert exchange.json_requested is True
    assert _json_validity(exchange) == (1.0, 0.0)
    exchange = await _exchange(_text('{"city": "Paris"}'), _text("Paris."),
                               stream=stream, response_format=JSON_MODE)
    assert _json_validity(exchange) == (0.0, 1.0)


async def test_without_json_mode_json_is_inferred_from_the_primary_s_answer() -> None:
    exchange = await _exchange(_text("[1] Paris, see the docs"), _text("Paris."),
                               stream=True, response_format={"type": "text"})
    assert exchange.json_requested is False
    assert _json_validity(exchange) == (0.0, 0.0)  # it looked like JSON: inferred, as before
    exchange = await _exchange(_text("Paris."), _text('{"a": 1}'), stream=True)
    assert _json_validity(exchange) == (None, None)


@pytest.mark.parametrize(("payload", "expected"), [
    ({"response_format": {"type": "json_object"}}, True),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, True),
    ({"response_format": {"type": "text"}}, False),
    ({"guided_json": {"type": "object"}}, True),
    ({"structured_outputs": {"json": {"type": "object"}}}, True),
    ({"response_format": "json"}, False),
    ({}, False),
    (None, None),
])
def test_json_requested_by_a_request(payload: dict[str, Any] | None,
                                     expected: bool | None) -> None:
    assert json_requested("chat_completions", payload) is expected
