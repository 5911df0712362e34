"""Embeddings answers: their vectors read from the wire (observation rule 10), the cosine
distance between two backends' (``EmbeddingDistanceScorer``), and its gate."""

from __future__ import annotations

import base64
from typing import Any

import numpy as np
import orjson
import pytest

from evaluators import Gates, MetricSamples, Outcome, judge
from evaluators._exchange import Exchange
from evaluators._observation import Capture, Embeddings, observe
from evaluators._score import Direction
from evaluators._scorers_quality import EmbeddingDistanceScorer
from evaluators._verdicts import MetricVerdict

METRIC = "quality.embedding_distance"


def _answer(rows: list[list[float]], *, b64: bool = False, **extra: Any) -> bytes:
    data = [{"object": "embedding", "index": i,
             "embedding": base64.b64encode(np.asarray(r, "<f4").tobytes()).decode()
             if b64 else r} for i, r in enumerate(rows)]
    return orjson.dumps({"object": "list", "data": data, "model": "m",
                         "usage": {"prompt_tokens": 3, "total_tokens": 3}, **extra})


def _observe(body: bytes, *, max_bytes: int = 1 << 20, backend: str = "primary") -> Any:
    capture = Capture(started=0.0, max_bytes=max_bytes, max_chunk_times=8, status=200)
    capture.add_chunk(0.1, body)
    capture.ended = 0.1
    return observe(capture, request_id="r", backend=backend, route="embeddings",
                   wall_started=0.0)


def _distance(primary: bytes, candidate: bytes) -> float | None:
    exchange = Exchange("r", "s", "embeddings", "cand", _observe(primary),
                        _observe(candidate, backend="cand"))
    (score,) = EmbeddingDistanceScorer().score(exchange)
    assert score.metric == METRIC and score.primary is None
    return score.candidate


def test_floats_and_base64_read_the_same_vectors() -> None:
    rows = [[0.5, -0.25, 1.0], [3.0, 0.0, -1.5]]
    floats, b64 = _observe(_answer(rows)).embeddings, _observe(_answer(rows, b64=True)).embeddings
    assert floats == b64 and floats.count == 2 and floats.dims == 3
    np.testing.assert_array_equal(floats.matrix(), np.asarray(rows, np.float32))
    # Out of order on the wire, in index order here.
    shuffled = orjson.loads(_answer(rows))
    shuffled["data"].reverse()
    assert _observe(orjson.dumps(shuffled)).embeddings == floats


@pytest.mark.parametrize("data", [
    [], [{"index": 1, "embedding": [1.0]}], [{"index": 0, "embedding": [1.0]}] * 2,
    [{"index": 0, "embedding": [1.0, 2.0]}, {"index": 1, "embedding": [1.0]}],
    [{"index": 0, "embedding": []}], [{"index": 0, "embedding": [True, 1.0]}],
    [{"index": 0, "embedding": ["1.0"]}], [{"index": 0, "embedding": "not base64!"}],
    [{"index": 0, "embedding": base64.b64encode(b"abc").decode()}],
    [{"index": 0, "embedding": [1e39]}], [{"index": 0, "embedding": [10**400]}],
    [{"index": "0", "embedding": [1.0]}], ["x"], {"index": 0},
])
def test_data_that_is_not_one_whole_vector_per_index_is_unknown(data: Any) -> None:
    assert Embeddings.from_json(data) is None


def test_numbers_past_float32_on_the_wire_are_unknown() -> None:
    for body in (b'{"object":"list","data":[{"index":0,"embedding":[1e39]}]}',
                 b'{"object":"list","data":[{"index":0,"embedding":[1' + b"0" * 400 + b']}]}'):
        assert _observe(body).embeddings is None


def test_a_models_list_and_a_chat_answer_carry_no_embeddings() -> None:
    models = orjson.dumps({"object": "list", "data": [{"id": "m", "object": "model"}]})
    chat = orjson.dumps({"object": "chat.completion", "choices": [
        {"index": 0, "message": {"role": "assistant", "content": "hi"}}]})
    assert _observe(models).embeddings is None and _observe(chat).embeddings is None


def test_distance_of_the_same_other_and_mismatched_vectors() -> None:
    rng = np.random.default_rng(7)
    rows = rng.normal(size=(4, 64)).tolist()
    assert _distance(_answer(rows), _answer(rows, b64=True)) == pytest.approx(0.0, abs=1e-7)
    near = (np.asarray(rows) + rng.normal(scale=0.05, size=(4, 64))).tolist()
    d = _distance(_answer(rows), _answer(near))
    assert d is not None and 0.0005 < d < 0.005
    flipped = (-np.asarray(rows)).tolist()
    assert _distance(_answer(rows), _answer(flipped)) == pytest.approx(2.0)
    # Another count or dimension: no agreement (a client's index cannot take them).
    assert _distance(_answer(rows), _answer(rows[:3])) == 1.0
    assert _distance(_answer(rows), _answer([r[:32] for r in rows])) == 1.0
    zero = [[0.0] * 3]
    assert _distance(_answer(zero), _answer(zero)) == 0.0
    assert _distance(_answer(zero), _answer([[1.0, 0.0, 0.0]])) == 1.0


def test_an_answer_not_whole_is_not_scored() -> None:
    rows = [[1.0, 2.0]]
    truncated = Exchange("r", "s", "embeddings", "cand", _observe(_answer(rows)),
                         _observe(_answer(rows), max_bytes=10, backend="cand"))
    (score,) = EmbeddingDistanceScorer().score(truncated)
    assert score.candidate is None
    chat = orjson.dumps({"object": "chat.completion", "choices": []})
    assert _distance(_answer(rows), chat) is None


def test_the_gate_holds_the_distance_under_its_maximum() -> None:
    rng = np.random.default_rng(3)
    directions: dict[str, Direction] = {METRIC: "lower"}
    gates = Gates(min_samples=20)

    def outcome(mean: float, floor: float | None = None) -> Outcome:
        values = np.abs(rng.normal(mean, mean / 4, 60))
        floor_values = None if floor is None else np.abs(rng.normal(floor, floor / 4, 60))
        samples = MetricSamples(candidate=values, noise_floor=floor_values)
        return judge({METRIC: samples}, gates, directions).metric(METRIC).outcome

    assert gates.max_embedding_distance == 0.01
    assert outcome(0.001) is Outcome.PASS  # fp8-like
    assert outcome(0.05) is Outcome.FAIL
    assert outcome(0.05, floor=0.0005) is Outcome.FAIL
    assert outcome(0.0012, floor=0.001) is Outcome.PASS


def test_a_replica_that_misses_the_maximum_relaxes_it() -> None:
    """Gates rule 2 and the judge's rule 3: the distance has no noise-floor check of its
    own, but a replica of the primary that does not keep the maximum relaxes it to the
    replica's own distance. The floor was dropped with the check, so a candidate exactly
    as far from the primary as the primary's own replica (0.0115 against 0.01, within the
    rule's bound of 0.012) FAILed."""
    rng = np.random.default_rng(4)
    directions: dict[str, Direction] = {METRIC: "lower"}

    def judged(mean: float) -> MetricVerdict:
        samples = MetricSamples(candidate=np.abs(rng.normal(mean, 0.002, 200)),
                                noise_floor=np.abs(rng.normal(0.0115, 0.002, 200)))
        return judge({METRIC: samples}, Gates(), directions).metric(METRIC)

    as_far = judged(0.0115)
    assert as_far.outcome is not Outcome.FAIL, as_far.reasons
    assert "relaxed from 0.01 to the noise floor's mean" in as_far.reasons[0]
    assert judged(0.05).outcome is Outcome.FAIL  # beyond the replica's distance too
