"""The judge on known distributions with fixed seeds: verdicts, reasons, gates."""

from __future__ import annotations

import itertools
import json

import numpy as np
import pydantic
import pytest

from evaluators._checks import Outcome
from evaluators._gates import SEMANTIC_SIMILARITY_METRIC, TTFT_METRIC, Gates, MetricGate
from evaluators._judge import judge
from evaluators._score import Direction
from evaluators._verdicts import MetricSamples, Verdict

ITL = "latency.itl_mean_s"
TPS = "throughput.output_tps"
COST = "cost.usd"
SUCCESS = "reliability.success"
TOKEN_F1 = "quality.token_f1"
CACHE = "cache.hit_ratio"

DIRECTIONS: dict[str, Direction] = {
    TTFT_METRIC: "lower",
    ITL: "lower",
    TPS: "higher",
    COST: "lower",
    SUCCESS: "higher",
    SEMANTIC_SIMILARITY_METRIC: "higher",
    TOKEN_F1: "higher",
    CACHE: "higher",
}


def _rng(seed: int) -> np.random.Generator:
    return np.random.default_rng(seed)


def _latency(rng: np.random.Generator, n: int, scale: float = 1.0) -> np.ndarray:
    return rng.lognormal(np.log(0.2), 0.3, n) * scale


def _one(metric: str, samples: MetricSamples, gates: Gates | None = None) -> Verdict:
    return judge({metric: samples}, gates or Gates(), DIRECTIONS)


def _check(verdict: Verdict, metric: str, check: str) -> Outcome:
    (found,) = [c for c in verdict.metric(metric).checks if c.name == check]
    return found.outcome


def test_a_slower_candidate_fails_on_the_median_shift() -> None:
    rng = _rng(1)
    samples = MetricSamples(candidate=_latency(rng, 300, 1.3), baseline=_latency(rng, 300))
    verdict = _one(TTFT_METRIC, samples)
    assert verdict.outcome is Outcome.FAIL
    assert _check(verdict, TTFT_METRIC, "median_shift") is Outcome.FAIL
    shift = verdict.metric(TTFT_METRIC).checks[0]
    assert shift.value is not None and shift.value > 0.2  # worse by ~30%
    assert any(r.startswith(f"{TTFT_METRIC}: median change toward worse") for r in verdict.reasons)


def test_an_equal_candidate_passes() -> None:
    rng = _rng(2)
    samples = MetricSamples(candidate=_latency(rng, 400), baseline=_latency(rng, 400))
    verdict = _one(TTFT_METRIC, samples)
    assert verdict.outcome is Outcome.PASS, verdict.reasons
    assert verdict.reasons == ("all 1 gated metrics pass",)


def test_a_faster_candidate_passes_on_a_lower_is_better_metric() -> None:
    rng = _rng(3)
    samples = MetricSamples(candidate=_latency(rng, 300, 0.7), baseline=_latency(rng, 300))
    verdict = _one(TTFT_METRIC, samples)
    assert verdict.outcome is Outcome.PASS, verdict.reasons
    assert verdict.metric(TTFT_METRIC).statistics is not None


def test_direction_decides_what_worse_means() -> None:
    rng = _rng(4)
    baseline = rng.normal(30.0, 3.0, 300)
    faster = MetricSamples(candidate=rng.normal(36.0, 3.0, 300), baseline=baseline)
    slower = MetricSamples(candidate=rng.normal(24.0, 3.0, 300), baseline=baseline)
    assert _one(TPS, faster).outcome is Outcome.PASS
    assert _check(_one(TPS, slower), TPS, "median_shift") is Outcome.FAIL


def test_a_variance_increase_under_the_same_median_fails() -> None:
    rng = _rng(5)
    samples = MetricSamples(
        candidate=rng.normal(0.2, 0.05, 300), baseline=rng.normal(0.2, 0.02, 300)
    )
    verdict = _one(ITL, samples)
    assert _check(verdict, ITL, "median_shift") is Outcome.PASS
    assert _check(verdict, ITL, "std_ratio") is Outcome.FAIL
    assert verdict.outcome is Outcome.FAIL


@pytest.mark.parametrize("seed", range(6))
def test_answers_made_faster_widen_no_spread_that_is_judged(seed: int) -> None:
    """Half the answers (those below the median) twice as fast, the rest as they were
    (prefix-cache hits, speculative decoding on short answers): every quantile no worse,
    the whole spread ~1.55x. The spread check reads the slow side of the primary's
    median for a candidate significantly better; read whole it FAILed in 11 of 12
    windows (its p99 ratio ~1.04, so not excused as a tail no worse)."""
    rng = _rng(100 + seed)
    candidate = _latency(rng, 2000)
    candidate[candidate < 0.2] /= 2.0
    verdict = _one(TTFT_METRIC, MetricSamples(candidate=candidate,
                                              baseline=_latency(rng, 2000)))
    assert verdict.outcome is Outcome.PASS, verdict.reasons
    (spread,) = [c for c in verdict.metric(TTFT_METRIC).checks if c.name == "std_ratio"]
    assert "on the slow side of the primary's median" in spread.reason


@pytest.mark.parametrize("seed", range(6))
def test_rare_stalls_are_caught_under_a_better_median(seed: int) -> None:
    """10 % faster, with 0.5 % of answers stalled 10x: the p99 is no worse, so the spread
    check was excused and the candidate PASSed in 10 of 12 windows; on the slow side of
    the primary's median the stalls show."""
    rng = _rng(200 + seed)
    candidate = _latency(rng, 2000, 0.9)
    candidate[:10] *= 10.0
    verdict = _one(TTFT_METRIC, MetricSamples(candidate=candidate,
                                              baseline=_latency(rng, 2000)))
    assert _check(verdict, TTFT_METRIC, "median_shift") is Outcome.PASS
    assert _check(verdict, TTFT_METRIC, "std_ratio") is not Outcome.PASS, verdict.reasons
    assert verdict.outcome is not Outcome.PASS


def test_a_heavier_tail_fails_on_the_p99_ratio() -> None:
    rng = _rng(6)
    candidate = _latency(rng, 1000)
    candidate[rng.random(1000) < 0.04] *= 4.0
    verdict = _one(TTFT_METRIC, MetricSamples(candidate=candidate, baseline=_latency(rng, 1000)))
    assert _check(verdict, TTFT_METRIC, "tail_ratio") is Outcome.FAIL
    assert _check(verdict, TTFT_METRIC, "median_shift") is not Outcome.FAIL
    assert verdict.outcome is Outcome.FAIL


def test_sparse_data_is_inconclusive_even_when_it_looks_good() -> None:
    rng = _rng(7)
    samples = MetricSamples(candidate=_latency(rng, 12, 0.5), baseline=_latency(rng, 12))
    verdict = _one(TTFT_METRIC, samples)
    assert verdict.outcome is Outcome.INCONCLUSIVE
    metric = verdict.metric(TTFT_METRIC)
    assert metric.outcome is Outcome.INCONCLUSIVE
    assert "too few samples" in metric.reasons[0]
    assert metric.statistics is not None  # still exposed


def test_min_samples_is_configurable_per_metric() -> None:
    rng = _rng(8)
    samples = MetricSamples(candidate=_latency(rng, 40), baseline=_latency(rng, 40))
    strict = Gates(metrics={ITL: MetricGate(min_samples=50, max_shift_ratio=0.1)})
    assert _one(ITL, samples, strict).outcome is Outcome.INCONCLUSIVE
    assert _one(ITL, samples, Gates(min_samples=20)).outcome is not Outcome.INCONCLUSIVE


def test_a_failure_outranks_an_inconclusive_metric() -> None:
    rng = _rng(9)
    samples = {
        TTFT_METRIC: MetricSamples(candidate=_latency(rng, 10), baseline=_latency(rng, 10)),
        ITL: MetricSamples(candidate=_latency(rng, 300, 1.5), baseline=_latency(rng, 300)),
    }
    verdict = judge(samples, Gates(), DIRECTIONS)
    assert verdict.outcome is Outcome.FAIL
    assert any(r.startswith(f"{TTFT_METRIC}: too few samples") for r in verdict.reasons)
    assert any(r.startswith(f"{ITL}: ") for r in verdict.reasons)


def test_the_reasons_that_decided_the_verdict_come_first() -> None:
    """Rule 5: a failing metric's reasons before an inconclusive one's, even where the
    inconclusive metric comes first in metric order (ITL sorts before TTFT)."""
    rng = _rng(9)
    samples = {
        ITL: MetricSamples(candidate=_latency(rng, 10), baseline=_latency(rng, 10)),
        TTFT_METRIC: MetricSamples(candidate=_latency(rng, 300, 1.5),
                                   baseline=_latency(rng, 300)),
    }
    for order in (samples, dict(reversed(samples.items()))):
        reasons = judge(order, Gates(), DIRECTIONS).reasons
        assert reasons[0].startswith(f"{TTFT_METRIC}: "), reasons
        assert reasons[-1].startswith(f"{ITL}: too few samples"), reasons


def test_significant_but_tolerable_worsening_is_marginal() -> None:
    rng = _rng(10)
    baseline = rng.lognormal(np.log(0.05), 0.1, 400)
    candidate = rng.lognormal(np.log(0.05 * 1.05), 0.1, 400)  # 5% slower, 10% tolerated
    verdict = _one(ITL, MetricSamples(candidate=candidate, baseline=baseline))
    check = verdict.metric(ITL).checks[0]
    assert check.name == "median_shift" and check.significant
    assert check.outcome is Outcome.MARGINAL
    assert verdict.outcome is Outcome.MARGINAL


def test_a_result_within_the_marginal_band_is_marginal() -> None:
    rng = _rng(11)
    values = rng.beta(17, 3, 400)  # mean 0.85: right at the default minimum
    verdict = _one(SEMANTIC_SIMILARITY_METRIC, MetricSamples(candidate=values))
    assert _check(verdict, SEMANTIC_SIMILARITY_METRIC, "mean_limit") is Outcome.MARGINAL


def test_semantic_similarity_below_the_minimum_fails() -> None:
    rng = _rng(12)
    values = rng.beta(7, 3, 200)  # mean 0.7
    verdict = _one(SEMANTIC_SIMILARITY_METRIC, MetricSamples(candidate=values))
    assert verdict.outcome is Outcome.FAIL


def test_cost_ratio_gate() -> None:
    rng = _rng(13)
    baseline = rng.gamma(2.0, 0.001, 400)
    dearer = MetricSamples(candidate=rng.gamma(2.0, 0.0013, 400), baseline=baseline)
    same = MetricSamples(candidate=rng.gamma(2.0, 0.001, 400), baseline=baseline)
    assert _check(_one(COST, dearer), COST, "mean_ratio") is Outcome.FAIL
    assert _one(COST, same).outcome is Outcome.PASS


def test_error_rate_increase_gate() -> None:
    rng = _rng(14)
    baseline = (rng.random(500) < 0.99).astype(float)
    worse = MetricSamples(candidate=(rng.random(500) < 0.90).astype(float), baseline=baseline)
    verdict = _one(SUCCESS, worse)
    assert _check(verdict, SUCCESS, "mean_worsening") is Outcome.FAIL


def test_candidate_below_the_noise_floor_is_flagged() -> None:
    rng = _rng(15)
    floor = rng.beta(40, 2, 200)  # secondary vs primary: ~0.95
    samples = MetricSamples(candidate=rng.beta(18, 2, 300), noise_floor=floor)  # ~0.90
    verdict = _one(SEMANTIC_SIMILARITY_METRIC, samples)
    assert _check(verdict, SEMANTIC_SIMILARITY_METRIC, "noise_floor") is Outcome.FAIL
    # Above the absolute minimum (0.85): only the floor sees the drop.
    assert _check(verdict, SEMANTIC_SIMILARITY_METRIC, "mean_limit") is Outcome.PASS


def test_candidate_at_the_noise_floor_is_not_flagged() -> None:
    rng = _rng(16)
    samples = MetricSamples(candidate=rng.beta(40, 2, 300), noise_floor=rng.beta(40, 2, 200))
    verdict = _one(SEMANTIC_SIMILARITY_METRIC, samples)
    assert verdict.outcome is Outcome.PASS, verdict.reasons


def test_a_noisy_primary_relaxes_the_minimum_to_the_floor() -> None:
    rng = _rng(17)
    candidate = rng.beta(8, 2, 300)  # ~0.80, below 0.85
    alone = _one(SEMANTIC_SIMILARITY_METRIC, MetricSamples(candidate=candidate))
    assert alone.outcome is Outcome.FAIL
    floor = rng.beta(8, 2, 200)  # the primary's own replica agrees no better
    relaxed = _one(
        SEMANTIC_SIMILARITY_METRIC, MetricSamples(candidate=candidate, noise_floor=floor)
    )
    assert relaxed.outcome is not Outcome.FAIL, relaxed.reasons
    assert "relaxed" in relaxed.metric(SEMANTIC_SIMILARITY_METRIC).reasons[0]


def test_a_floor_that_is_the_only_gate_needs_enough_samples() -> None:
    rng = _rng(18)
    samples = MetricSamples(candidate=rng.beta(9, 1, 300), noise_floor=rng.beta(9, 1, 10))
    assert _one(TOKEN_F1, samples).outcome is Outcome.INCONCLUSIVE


def test_ungated_metrics_do_not_count() -> None:
    rng = _rng(19)
    samples = {
        CACHE: MetricSamples(candidate=rng.random(5), baseline=rng.random(5)),
        TOKEN_F1: MetricSamples(candidate=rng.random(100)),
    }
    verdict = judge(samples, Gates(), DIRECTIONS)
    assert all(not m.gated for m in verdict.metrics)
    assert verdict.outcome is Outcome.INCONCLUSIVE
    assert verdict.reasons == ("no gated metric to judge",)


def test_a_required_metric_without_samples_is_inconclusive() -> None:
    rng = _rng(20)
    samples = {ITL: MetricSamples(candidate=_latency(rng, 300), baseline=_latency(rng, 300))}
    verdict = judge(samples, Gates(required_metrics=(TTFT_METRIC,)), DIRECTIONS)
    assert verdict.metric(TTFT_METRIC).outcome is Outcome.INCONCLUSIVE
    assert verdict.outcome is Outcome.INCONCLUSIVE


def test_verdict_to_dict_is_plain_json_and_deterministic() -> None:
    rng = _rng(21)
    samples = {
        TTFT_METRIC: MetricSamples(candidate=_latency(rng, 100, 1.2), baseline=_latency(rng, 100)),
        SEMANTIC_SIMILARITY_METRIC: MetricSamples(
            candidate=rng.beta(18, 2, 100), noise_floor=rng.beta(18, 2, 50)
        ),
        COST: MetricSamples(candidate=np.zeros(40), baseline=np.zeros(40)),
    }
    first = judge(samples, Gates(), DIRECTIONS).to_dict()
    text = json.dumps(first, allow_nan=False)
    assert json.dumps(judge(samples, Gates(), DIRECTIONS).to_dict(), allow_nan=False) == text
    assert first["verdict"] in {o.value for o in Outcome}
    ttft = next(m for m in first["metrics"] if m["metric"] == TTFT_METRIC)
    assert {"hl_shift", "hl_ci_low", "p_value", "tail_ratio_ci_low"} <= ttft["statistics"].keys()


def test_gates_route_metrics_to_their_checks() -> None:
    gates = Gates()
    assert gates.gate_for(TTFT_METRIC, pairwise=False).max_tail_ratio == 1.2
    assert gates.gate_for(ITL, pairwise=False).max_tail_ratio is None
    assert gates.gate_for(COST, pairwise=False).max_mean_ratio == 1.1
    assert gates.gate_for(SUCCESS, pairwise=False).max_mean_worsening == 0.01
    assert not gates.gate_for(CACHE, pairwise=False).has_backend_checks
    assert gates.gate_for(SEMANTIC_SIMILARITY_METRIC, pairwise=True).min_mean == 0.85
    assert gates.gate_for(TOKEN_F1, pairwise=True).min_mean is None
    override = MetricGate(max_shift_ratio=0.5)
    assert Gates(metrics={TTFT_METRIC: override}).gate_for(TTFT_METRIC, pairwise=False) == override


def test_gates_are_frozen_and_strict() -> None:
    gates = Gates()
    with pytest.raises(pydantic.ValidationError):
        gates.min_samples = 5  # type: ignore[misc]
    with pytest.raises(pydantic.ValidationError):
        Gates(min_smaples=5)  # type: ignore[call-arg]
    with pytest.raises(pydantic.ValidationError):
        Gates(confidence=1.5)


def test_the_looks_at_one_window_spend_the_error_rate_between_them() -> None:
    """Gates rule 7: look k at one growing window is judged at (1 - confidence) * 6 /
    (pi^2 k^2), so the error rates of any number of looks add up to at most the gates'."""
    gates = Gates(confidence=0.99)
    levels = [1.0 - gates.for_look(k).confidence for k in range(1, 10_001)]
    assert levels[0] == pytest.approx(0.01 * 6 / np.pi ** 2)  # 0.61 %
    assert levels[9] == pytest.approx(levels[0] / 100)
    assert all(b < a for a, b in itertools.pairwise(levels))
    assert 0.0099 < sum(levels) <= 0.01
    assert gates.for_look(2).model_dump(exclude={"confidence"}) == \
        gates.model_dump(exclude={"confidence"})
    with pytest.raises(ValueError, match="at least 1"):
        gates.for_look(0)


def test_bad_inputs_are_refused() -> None:
    with pytest.raises(ValueError, match="pairwise"):
        MetricSamples(candidate=[1.0], baseline=[1.0], noise_floor=[1.0])
    with pytest.raises(ValueError, match="direction"):
        judge({"latency.unknown": MetricSamples(candidate=[1.0], baseline=[1.0])}, Gates(), {})


def test_a_pass_names_the_metrics_it_could_not_hold_to_a_noise_floor() -> None:
    """Tool-call agreement is held to the noise floor alone: without a replica it is not
    gated, and the PASS says so rather than "all 1 gated metrics pass" alone (60 % of
    tool calls unlike the primary's PASSed so)."""
    rng = _rng(11)
    tool_calls = "quality.tool_call_match"
    samples = {TTFT_METRIC: MetricSamples(candidate=_latency(rng, 400),
                                          baseline=_latency(rng, 400)),
               tool_calls: MetricSamples(candidate=(rng.random(400) < 0.6).astype(float))}
    verdict = judge(samples, Gates(), {**DIRECTIONS, tool_calls: "higher"})
    assert verdict.outcome is Outcome.PASS, verdict.reasons
    assert verdict.reasons[0] == "all 1 gated metrics pass"
    assert verdict.reasons[1].startswith(
        f"not judged, no noise floor measured: {tool_calls} (mirror a replica")
    assert not verdict.metric(tool_calls).gated
    with_floor = judge({**samples, tool_calls: MetricSamples(
        candidate=samples[tool_calls].candidate, noise_floor=np.ones(400))},
        Gates(), {**DIRECTIONS, tool_calls: "higher"})
    assert with_floor.outcome is Outcome.FAIL, with_floor.reasons  # 60 % against 100 %
