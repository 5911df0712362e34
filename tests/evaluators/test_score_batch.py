"""Scoring in batches: every exchange gets the scores it gets alone (issue 15).

The batch is the default scorers over a mix the scoring child meets: answers of
different lengths, word-for-word equal answers, a primary shared by two candidates,
failed and truncated candidates, JSON and tool calls; the throughput window and the
GPU-hour cost it feeds must see the same sequence either way.
"""

from __future__ import annotations

import dataclasses
import math
import random

import pytest

from evaluators._embedding import SentenceEncoder
from evaluators._exchange import Exchange
from evaluators._price import GpuHourPrice, TokenPrice
from evaluators._score import Score, Scorer, score_batch, score_exchange
from evaluators._scorers import DEFAULT_SCORERS, ScorerConfig, build_scorers
from evaluators._scorers_quality import SemanticSimilarityScorer
from tests.evaluators.test_scorers import make_exchange, make_observation

WORDS = ("the gateway mirrors a sample of traffic to each candidate and scores its answer "
         "against the primary on quality latency throughput and cost").split()
TOLERANCE = 1e-5
PRICES = {"primary": TokenPrice(prompt_usd_per_mtok=1, completion_usd_per_mtok=2),
          "cand": GpuHourPrice(gpu_usd_per_hour=3.6)}


@pytest.fixture(scope="module")
def encoder() -> SentenceEncoder:
    return SentenceEncoder()


def _text(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


def mixed_exchanges() -> list[Exchange]:
    rng = random.Random(15)
    exchanges = []
    for i in range(24):
        primary = make_observation(request_id=f"r{i}", text=_text(rng, rng.choice((3, 40, 180))),
                                   started_at=1000.0 + i * 0.3, e2e_s=1.0 + (i % 5) * 0.2)
        candidate_text = primary.text if i % 4 == 0 else _text(rng, rng.choice((5, 60, 200)))
        candidate = dataclasses.replace(primary, backend="cand", text=candidate_text)
        if i % 7 == 3:
            candidate = dataclasses.replace(candidate, status=500, text=None, usage=None,
                                            finish_reason=None)
        elif i % 7 == 5:
            candidate = dataclasses.replace(candidate, truncated=True, text=None)
        exchanges.append(make_exchange(primary, candidate))
        if i % 6 == 1:  # a second candidate's exchange shares this primary
            second = dataclasses.replace(primary, backend="cand2", text=_text(rng, 30))
            exchanges.append(make_exchange(primary, second))
    exchanges.append(make_exchange(make_observation(request_id="json", text='{"a": 1}'),
                                   text='{"a": 1'))
    return exchanges


def _same(batch: list[Score], alone: list[Score]) -> None:
    assert [s.metric for s in batch] == [s.metric for s in alone]
    for b, a in zip(batch, alone, strict=True):
        for x, y in ((b.candidate, a.candidate), (b.primary, a.primary)):
            assert (x is None) == (y is None), (b, a)
            if x is not None and y is not None:
                assert math.isclose(x, y, rel_tol=TOLERANCE, abs_tol=TOLERANCE), (b, a)


def test_batch_scores_equal_single_scores(encoder: SentenceEncoder) -> None:
    exchanges = mixed_exchanges()
    config = ScorerConfig(prices=PRICES)
    alone_scorers = build_scorers(DEFAULT_SCORERS, config, encoder=encoder)
    batch_scorers = build_scorers(DEFAULT_SCORERS, config, encoder=encoder)
    alone = [score_exchange(e, alone_scorers) for e in exchanges]
    batched = score_batch(exchanges, batch_scorers)
    assert len(batched) == len(exchanges)
    for b, a in zip(batched, alone, strict=True):
        assert not isinstance(b, Exception)
        _same(b, a)


def test_semantic_batch_encodes_each_distinct_text_once(encoder: SentenceEncoder) -> None:
    scorer = SemanticSimilarityScorer(encoder)
    shared = make_observation(text="Paris is the capital of France.")
    exchanges = [make_exchange(shared, text="The capital of France is Paris."),
                 make_exchange(shared),  # word for word the primary's
                 make_exchange(shared, status=503, text=None)]
    batch = scorer.score_batch(exchanges)
    assert [s[0].candidate is None for s in batch] == [False, False, True]
    assert batch[1][0].candidate == pytest.approx(1.0, abs=TOLERANCE)
    for b, e in zip(batch, exchanges, strict=True):
        _same(b, scorer.score(e))


class _Flaky:
    """A batch scorer whose batch call fails and whose single call fails on one id."""

    name = "flaky"

    def score(self, exchange: Exchange) -> list[Score]:
        if exchange.request_id == "bad":
            raise RuntimeError("bad exchange")
        return [Score("quality.exact_match", 1.0, None)]

    def score_batch(self, exchanges: list[Exchange]) -> list[list[Score]]:
        raise RuntimeError("the batch failed")


def test_a_failing_exchange_costs_only_its_own_scores() -> None:
    scorers: list[Scorer] = [_Flaky()]
    exchanges = [make_exchange(make_observation(request_id=r)) for r in ("a", "bad", "c")]
    results = score_batch(exchanges, scorers)
    assert isinstance(results[1], RuntimeError)
    assert results[0] == results[2] == [Score("quality.exact_match", 1.0, None)]


def test_encoder_batches_are_bounded_in_padded_tokens() -> None:
    with pytest.raises(ValueError, match="max_batch_tokens"):
        SentenceEncoder(max_batch_tokens=0)
