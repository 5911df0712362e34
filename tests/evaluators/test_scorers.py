"""The scorer family: the shared contract, the registry, and the quality scorers."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any

import orjson
import pytest
from rapidfuzz.distance import Levenshtein

from evaluators import Capture, Exchange, Observation, Usage, observe
from evaluators._embedding import SentenceEncoder
from evaluators._price import GpuHourPrice, TokenPrice
from evaluators._score import METRICS, Score, Scorer, score_exchange
from evaluators._scorers import DEFAULT_SCORERS, SCORERS, ScorerConfig, build_scorers
from evaluators._scorers_quality import (
    DEFAULT_MAX_EDIT_CHARS,
    DEFAULT_MAX_F1_CHARS,
    EditSimilarityScorer,
    ExactMatchScorer,
    FinishReasonScorer,
    JsonValidityScorer,
    SemanticSimilarityScorer,
    TokenF1Scorer,
    ToolCallScorer,
    token_f1,
)


def make_observation(**overrides: Any) -> Observation:
    fields: dict[str, Any] = {
        "request_id": "r1", "backend": "primary", "route": "chat_completions",
        "status": 200, "streamed": True, "started_at": 1000.0, "ttft_s": 0.2,
        "chunk_gaps_s": (0.05, 0.05, 0.05), "e2e_s": 1.0,
        "usage": Usage(prompt_tokens=100, completion_tokens=41, cached_tokens=None),
        "finish_reason": "stop", "text": "The capital of France is Paris.",
        "tool_calls": (), "model": "m", "bytes": 1234, "truncated": False, "error": None,
    }
    fields.update(overrides)
    return Observation(**fields)


def make_exchange(primary: Observation | None = None,
                  candidate: Observation | None = None, **candidate_overrides: Any
                  ) -> Exchange:
    primary = primary if primary is not None else make_observation()
    if candidate is None:
        candidate = dataclasses.replace(primary, backend="cand", **candidate_overrides)
    return Exchange(request_id=primary.request_id, session_key="s1", route=primary.route,
                    candidate=candidate.backend, primary=primary,
                    candidate_observation=candidate)


def only(scores: list[Score]) -> Score:
    assert len(scores) == 1
    return scores[0]


@pytest.fixture(scope="module")
def encoder() -> SentenceEncoder:
    return SentenceEncoder()


@pytest.fixture(scope="module")
def every_scorer(encoder: SentenceEncoder) -> list[Scorer]:
    prices = {"primary": TokenPrice(prompt_usd_per_mtok=1, completion_usd_per_mtok=2),
              "cand": GpuHourPrice(gpu_usd_per_hour=3.6)}
    return build_scorers(DEFAULT_SCORERS, ScorerConfig(prices=prices), encoder=encoder)


FAILED_CANDIDATES: dict[str, dict[str, Any]] = {
    "error": {"error": "connection reset", "status": 200},
    "status_500": {"status": 500, "text": None, "usage": None, "finish_reason": None},
    "status_0": {"status": 0, "error": "connect timeout", "text": None, "usage": None,
                 "ttft_s": None, "e2e_s": None, "chunk_gaps_s": (), "finish_reason": None},
    "truncated": {"truncated": True, "text": None},
    "text_unknown": {"text": None},
    "usage_unknown": {"usage": None},
}


def _failed_exchanges() -> Iterator[tuple[str, Exchange]]:
    for name, overrides in FAILED_CANDIDATES.items():
        yield f"candidate_{name}", make_exchange(**overrides)
        failed = make_observation(**overrides)
        yield f"primary_{name}", make_exchange(primary=failed,
                                               candidate=make_observation(backend="cand"))


# -- the contract every scorer keeps -----------------------------------------------------------

def test_registry_builds_every_scorer_and_each_metric_is_described(
        every_scorer: list[Scorer]) -> None:
    assert [s.name for s in every_scorer] == list(SCORERS)
    emitted = {score.metric for score in score_exchange(make_exchange(), every_scorer)}
    assert emitted == set(METRICS)
    for spec in METRICS.values():
        assert spec.direction in ("higher", "lower")
        assert spec.kind in ("per_backend", "pairwise")


@pytest.mark.parametrize(("case", "exchange"), list(_failed_exchanges()),
                         ids=[name for name, _ in _failed_exchanges()])
def test_every_scorer_copes_with_failed_observations(
        every_scorer: list[Scorer], case: str, exchange: Exchange) -> None:
    scores = score_exchange(exchange, every_scorer)
    assert {s.metric for s in scores} == set(METRICS)
    for score in scores:
        if METRICS[score.metric].kind == "pairwise":
            assert score.primary is None
    by_metric = {s.metric: s for s in scores}
    if "usage_unknown" not in case:
        for metric in ("quality.exact_match", "quality.edit_similarity", "quality.token_f1",
                       "quality.semantic_similarity"):
            assert by_metric[metric].candidate is None, metric


def test_identical_answers_score_perfectly(every_scorer: list[Scorer]) -> None:
    by_metric = {s.metric: s for s in score_exchange(make_exchange(), every_scorer)}
    for metric in ("quality.exact_match", "quality.edit_similarity", "quality.token_f1",
                   "quality.finish_reason_match", "reliability.success"):
        assert by_metric[metric].candidate == 1.0, metric
    assert by_metric["quality.semantic_similarity"].candidate == pytest.approx(1.0, abs=1e-5)
    assert by_metric["latency.e2e_ratio"].candidate == 1.0
    assert by_metric["quality.tool_call_match"].candidate is None  # no tool calls anywhere
    assert by_metric["quality.json_valid"] == Score("quality.json_valid", None, None)


def test_score_rejects_what_the_contract_forbids() -> None:
    with pytest.raises(ValueError, match="unknown metric"):
        Score("quality.vibes", 1.0, None)
    with pytest.raises(ValueError, match="pairwise"):
        Score("quality.exact_match", 1.0, 1.0)
    with pytest.raises(ValueError, match="finite"):
        Score("latency.e2e_s", float("nan"), 1.0)


def test_build_scorers_rejects_unknown_and_repeated_names() -> None:
    with pytest.raises(ValueError, match="unknown scorers"):
        build_scorers(["exact_match", "vibes"])
    with pytest.raises(ValueError, match="twice"):
        build_scorers(["exact_match", "exact_match"])


def test_build_scorers_loads_an_encoder_only_when_asked() -> None:
    scorers = build_scorers(["exact_match", "latency"])
    assert [s.name for s in scorers] == ["exact_match", "latency"]
    (semantic,) = build_scorers(["semantic_similarity"])
    assert isinstance(semantic, SemanticSimilarityScorer)


def test_scorer_config_parses_a_discriminated_price_per_backend() -> None:
    config = ScorerConfig.model_validate({"prices": {
        "primary": {"mode": "per_token", "prompt_usd_per_mtok": 0.5,
                    "completion_usd_per_mtok": 1.5},
        "cand": {"mode": "gpu_hour", "gpu_usd_per_hour": 2.0, "gpu_count": 2},
    }})
    assert isinstance(config.prices["primary"], TokenPrice)
    assert isinstance(config.prices["cand"], GpuHourPrice)
    with pytest.raises(ValueError, match="mode"):
        ScorerConfig.model_validate({"prices": {"x": {"mode": "free"}}})


# -- quality -----------------------------------------------------------------------------------

def test_exact_match_does_not_normalize() -> None:
    assert only(ExactMatchScorer().score(make_exchange(text="the capital of France is Paris."))
                ).candidate == 0.0
    assert only(ExactMatchScorer().score(make_exchange(text="The capital of France is Paris."))
                ).candidate == 1.0


@pytest.mark.parametrize(("a", "b", "expected"), [
    ("kitten", "sitting", 1 - 3 / 7),
    ("", "", 1.0),
    ("abc", "", 0.0),
    ("Paris", "Paris", 1.0),
])
def test_edit_similarity(a: str, b: str, expected: float) -> None:
    exchange = make_exchange(primary=make_observation(text=b), text=a)
    assert only(EditSimilarityScorer().score(exchange)).candidate == pytest.approx(expected)


def test_edit_similarity_reads_only_its_first_max_chars(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Levenshtein is quadratic: near the old 65,536-character cap one exchange cost
    0.1-0.9 s of CPU, and past it the value was None. Now each text's first
    ``max_chars`` characters are compared (quality rule 1): what differs past them does
    not count, what differs within them does."""
    exchange = make_exchange(primary=make_observation(text="x" * 11), text="x" * 10)
    assert only(EditSimilarityScorer(max_chars=10).score(exchange)).candidate == 1.0
    assert only(EditSimilarityScorer(max_chars=11).score(exchange)).candidate == (
        pytest.approx(10 / 11))

    shared = "The capital of France is Paris. " * (DEFAULT_MAX_EDIT_CHARS // 32 + 1)
    head = shared[:DEFAULT_MAX_EDIT_CHARS]
    primary = make_observation(text=head + "a" * 1000)
    assert only(EditSimilarityScorer().score(make_exchange(primary, text=head + "b" * 2000))
                ).candidate == 1.0
    within = head[:-1] + "?" + "a" * 1000
    assert only(EditSimilarityScorer().score(make_exchange(primary, text=within))
                ).candidate == pytest.approx(1 - 1 / DEFAULT_MAX_EDIT_CHARS)

    handed: list[int] = []
    similarity = Levenshtein.normalized_similarity

    def spy(a: str, b: str) -> float:
        handed.extend((len(a), len(b)))
        return float(similarity(a, b))

    monkeypatch.setattr(Levenshtein, "normalized_similarity", spy)
    long = make_observation(text="x" * 100_000)  # past the old cap: it was None
    assert only(EditSimilarityScorer().score(make_exchange(long, text="x" * 200_000))
                ).candidate == 1.0
    assert handed == [DEFAULT_MAX_EDIT_CHARS, DEFAULT_MAX_EDIT_CHARS]


@pytest.mark.parametrize(("candidate", "reference", "expected"), [
    ("The Eiffel Tower!", "eiffel tower", 1.0),  # case, punctuation, articles
    ("a cat sat", "the dog sat", 0.5),  # {cat, sat} vs {dog, sat}: P = R = 1/2
    ("paris paris london", "paris", 0.5),  # multiset: P = 1/3, R = 1
    ("", "", 1.0),
    ("the", "", 1.0),  # nothing left after normalisation on either side
    ("answer", "", 0.0),
    ("red green", "blue", 0.0),
    # MLQA: each Han or kana character a token, every mark dropped, the kana-range ones
    # (U+30FB, U+30A0) too: {東, 京, 大, 阪} against {東, 京}: P = 1, R = 1/2
    ("東京", "東京・大阪。", 2 / 3),
    ("東京\u30a0大阪", "「東京」 大阪", 1.0),
])
def test_token_f1_is_squad_f1(candidate: str, reference: str, expected: float) -> None:
    assert token_f1(candidate, reference) == pytest.approx(expected)
    exchange = make_exchange(primary=make_observation(text=reference), text=candidate)
    assert only(TokenF1Scorer().score(exchange)).candidate == pytest.approx(expected)


def test_token_f1_reads_only_its_first_max_chars() -> None:
    """80,000 CJK characters a side cost 0.2-0.5 s of CPU (a token each, spaced out by a
    regex with a Python-level template). Now each text's first ``max_chars`` characters
    are read (quality rule 1): what differs past them does not count, what differs within
    them does."""
    head = ("東京は日本の首都です。" * (DEFAULT_MAX_F1_CHARS // 11 + 1))[:DEFAULT_MAX_F1_CHARS]
    primary = make_observation(text=head + "大阪" * 40_000)
    past = make_exchange(primary, text=head + "名古屋" * 30_000)
    assert only(TokenF1Scorer().score(past)).candidate == 1.0
    within = make_exchange(primary, text=head[:-2] + "京都" + "大阪" * 40_000)
    value = only(TokenF1Scorer().score(within)).candidate
    assert value is not None and 0.99 < value < 1.0
    assert only(TokenF1Scorer(max_chars=4).score(
        make_exchange(make_observation(text="one two"), text="one twelve"))).candidate == 1.0


def test_semantic_similarity_ranks_paraphrase_above_unrelated(
        encoder: SentenceEncoder) -> None:
    scorer = SemanticSimilarityScorer(encoder)
    primary = make_observation(text="The capital of France is Paris.")
    paraphrase = only(scorer.score(make_exchange(primary, text="Paris is France's capital.")))
    unrelated = only(scorer.score(make_exchange(primary, text="Turtles can live 100 years.")))
    assert paraphrase.candidate is not None and unrelated.candidate is not None
    assert paraphrase.candidate > 0.8 > 0.3 > unrelated.candidate


def _call(name: str, arguments: str) -> dict[str, Any]:
    return {"name": name, "arguments": arguments}


@pytest.mark.parametrize(("candidate_calls", "primary_calls", "expected"), [
    ((), (), None),
    ((_call("f", '{"a": 1, "b": [1, 2]}'),), (_call("f", '{"b":[1,2],"a":1}'),), 1.0),
    ((_call("f", '{"a": 1}'),), (_call("f", '{"a": 2}'),), 0.0),
    ((_call("g", '{"a": 1}'),), (_call("f", '{"a": 1}'),), 0.0),
    # Parallel calls in another order are the same calls; a call twice is not two calls.
    ((_call("f", "{}"), _call("g", "{}")), (_call("g", "{}"), _call("f", "{}")), 1.0),
    ((_call("f", "{}"), _call("f", "{}")), (_call("f", "{}"), _call("g", "{}")), 0.0),
    ((_call("f", '{"x": 1}'), _call("f", "{}")), (_call("f", "{}"), _call("f", '{"x": 1.0}')),
     1.0),
    ((), (_call("f", "{}"),), 0.0),
    ((_call("f", "{}"),), (), 0.0),
    ((_call("f", "{broken"),), (_call("f", "{broken"),), 1.0),
    ((_call("f", "{broken"),), (_call("f", "{}"),), 0.0),
    # A bool is never a number (Python's True == 1 said it was); numbers are equal by
    # value, an integer exactly however long (orjson read 2**64 and 2**64 + 1 as one float).
    ((_call("f", '{"a": true}'),), (_call("f", '{"a": 1}'),), 0.0),
    ((_call("f", '{"a": false}'),), (_call("f", '{"a": 0}'),), 0.0),
    ((_call("f", '{"a": [0, true]}'),), (_call("f", '{"a": [0.0, 1]}'),), 0.0),
    ((_call("f", "true"),), (_call("f", "1"),), 0.0),
    ((_call("f", '{"a": [0, true]}'),), (_call("f", '{ "a" : [0.0, true] }'),), 1.0),
    ((_call("f", '{"x": 1e2, "y": 0.10}'),), (_call("f", '{"y": 0.1, "x": 100}'),), 1.0),
    ((_call("f", '{"n": 18446744073709551616}'),),
     (_call("f", '{"n": 18446744073709551617}'),), 0.0),
    ((_call("f", '{"n": -9223372036854775809}'),),
     (_call("f", '{"n": -9223372036854775810}'),), 0.0),
    ((_call("f", '{"n": 18446744073709551617, "b": true}'),),
     (_call("f", '{"b": true, "n": 18446744073709551617}'),), 1.0),
    ((_call("f", '{"n": 18446744073709551617, "b": true}'),),
     (_call("f", '{"b": 1, "n": 18446744073709551617}'),), 0.0),
    ((_call("f", '{"n": 1' + "0" * 4400 + "}"),), (_call("f", '{"n": 1' + "0" * 4400 + "}"),),
     1.0),  # more digits than Python converts: compared as text
    ((_call("f", '{"x": NaN}'),), (_call("f", '{"x": NaN}'),), 1.0),  # not JSON: as text
])
def test_tool_call_match(candidate_calls: tuple[dict[str, Any], ...],
                         primary_calls: tuple[dict[str, Any], ...],
                         expected: float | None) -> None:
    exchange = make_exchange(primary=make_observation(tool_calls=primary_calls, text=""),
                             tool_calls=candidate_calls, text="")
    assert only(ToolCallScorer().score(exchange)).candidate == expected


@pytest.mark.parametrize("depth", [990, 1000, 1024])
def test_tool_call_arguments_nested_as_deep_as_json_parses_never_raise(depth: int) -> None:
    """orjson parses 1,024 levels; comparing two such values raised RecursionError (past
    the interpreter's ~1,000), and score_batch dropped the whole exchange."""
    deep = "[" * depth + "]" * depth
    other = "[" * depth + "1" + "]" * depth
    for candidate, expected in ((deep, 1.0), (other, 0.0)):
        exchange = make_exchange(primary=make_observation(tool_calls=(_call("f", deep),),
                                                          text=""),
                                 tool_calls=(_call("f", candidate),), text="")
        assert only(ToolCallScorer().score(exchange)).candidate == expected


def test_tool_call_match_is_unknown_when_an_answer_is_incomplete() -> None:
    calls = (_call("f", "{}"),)
    primary = make_observation(tool_calls=calls)
    for overrides in ({"truncated": True}, {"status": 502}, {"error": "reset"}):
        exchange = make_exchange(primary, tool_calls=calls, **overrides)
        assert only(ToolCallScorer().score(exchange)).candidate is None


@pytest.mark.parametrize(("primary_text", "candidate_text", "expected"), [
    ('{"a": 1}', '  {"b": [1, 2]}\n', Score("quality.json_valid", 1.0, 1.0)),
    ('[1, 2]', '{"a": ', Score("quality.json_valid", 0.0, 1.0)),
    ('{"a": 1}', '```json\n{"a": 1}\n```', Score("quality.json_valid", 0.0, 1.0)),
    ('{"a": 1}', '"just a string"', Score("quality.json_valid", 0.0, 1.0)),
    ('{"a": [1, 2', '{"a": [1, 2]}', Score("quality.json_valid", 1.0, 0.0)),  # primary cut
    ("Paris.", '{"a": 1}', Score("quality.json_valid", None, None)),  # JSON not asked for
    ("", "{}", Score("quality.json_valid", None, None)),
])
def test_json_validity_where_the_primary_answered_json(
        primary_text: str, candidate_text: str, expected: Score) -> None:
    exchange = make_exchange(primary=make_observation(text=primary_text), text=candidate_text)
    assert JsonValidityScorer().score(exchange) == [expected]


def test_json_validity_of_a_failed_candidate_is_unknown() -> None:
    exchange = make_exchange(primary=make_observation(text="{}"), text=None, status=500)
    assert JsonValidityScorer().score(exchange) == [Score("quality.json_valid", None, 1.0)]


@pytest.mark.parametrize(("candidate", "primary", "expected"), [
    ("stop", "stop", 1.0),
    ("length", "stop", 0.0),
    (None, "stop", None),
    ("stop", None, None),
])
def test_finish_reason_agreement(candidate: str | None, primary: str | None,
                                 expected: float | None) -> None:
    exchange = make_exchange(primary=make_observation(finish_reason=primary),
                             finish_reason=candidate)
    assert only(FinishReasonScorer().score(exchange)).candidate == expected


def test_quality_scorers_on_observations_parsed_from_a_real_stream() -> None:
    def streamed(backend: str, pieces: list[str]) -> Observation:
        capture = Capture(started=0.0, max_bytes=1 << 16, max_chunk_times=64, status=200,
                          streamed=True)
        for i, piece in enumerate(pieces):
            event = {"model": "m", "choices": [{"index": 0, "delta": {"content": piece}}]}
            chunk = b"data: " + orjson.dumps(event) + b"\n\n"
            capture.add_chunk(0.1 * (i + 1), chunk)
        capture.add_chunk(1.0, b'data: {"choices":[{"index":0,"delta":{},'
                               b'"finish_reason":"stop"}]}\n\ndata: [DONE]\n\n')
        capture.ended = 1.0
        return observe(capture, request_id="r", backend=backend, route="chat_completions",
                       wall_started=0.0)

    exchange = make_exchange(primary=streamed("primary", ["The answer", " is 42."]),
                             candidate=streamed("cand", ["The answer is", " 42!"]))
    scores = score_exchange(exchange, [ExactMatchScorer(), TokenF1Scorer(),
                                       FinishReasonScorer()])
    assert [s.candidate for s in scores] == [0.0, 1.0, 1.0]


def test_a_time_that_is_not_a_number_is_unknown_to_every_scorer(
        every_scorer: list[Scorer]) -> None:
    """A NaN or infinite latency is unknown (``_observation`` rule 11): the latency
    scorers handed it to ``Score``, which refused it, and the exchange lost every score."""
    nan, inf = float("nan"), float("inf")
    for times in ({"ttft_s": nan, "e2e_s": nan, "chunk_gaps_s": (0.05, nan, 0.05)},
                  {"ttft_s": inf, "e2e_s": -inf, "chunk_gaps_s": (0.05, -inf)}):
        primary = make_observation(**times)
        assert (primary.ttft_s, primary.e2e_s, primary.chunk_gaps_s) == (None, None, ())
        scores = {s.metric: s for s in score_exchange(
            make_exchange(primary, dataclasses.replace(make_observation(), backend="cand")),
            every_scorer)}
        for metric in ("latency.ttft_s", "latency.itl_mean_s", "latency.e2e_s",
                       "throughput.output_tps"):
            assert scores[metric].primary is None and scores[metric].candidate is not None
        assert scores["latency.ttft_ratio"].candidate is None
        assert scores["quality.exact_match"].candidate == 1.0
