"""Like compared with like: matched load, cache strata, sample bias, samples needed.

Simulated backends with fixed seeds: every test is deterministic. Latency follows a load
model, latency = (base + per_request * concurrency) * noise, and TTFT a cache model,
TTFT = (base + per_token * uncached prompt tokens) * noise.
"""

from __future__ import annotations

import json
import math

import numpy as np
import numpy.typing as npt
import pytest
from scipy import stats

from evaluators._gates import Gates
from evaluators._judge import judge
from evaluators._matching import (
    UNKNOWN,
    cache_hit_rate,
    cache_strata,
    compare_at_matched_load,
    compare_within_cache_strata,
    load_curve,
)
from evaluators._power import (
    PowerQuery,
    samples_needed_for_location,
    samples_needed_for_mean,
    samples_needed_for_rate,
)
from evaluators._reweight import resample_indices
from evaluators._sample_bias import (
    MAX_IMPORTANCE_WEIGHT,
    SampleBias,
    check_sample_bias,
    turn_depth_bucket,
)
from evaluators._statistics import DEFAULT_CONFIDENCE, hodges_lehmann
from evaluators._strata import bin_labels, compare_strata
from evaluators._verdicts import LoadConditions, MetricSamples, MetricVerdict

FloatArray = npt.NDArray[np.float64]
ALPHA = 1.0 - DEFAULT_CONFIDENCE
BASE_S = 0.2
PER_REQUEST_S = 0.03
NOISE_SIGMA = 0.25
MIRROR_SHARE = 0.1


def _primary_concurrency(rng: np.random.Generator, n: int) -> FloatArray:
    """In-flight requests at the primary: around 12, from 1 to several dozen."""
    return np.maximum(1.0, np.round(rng.lognormal(np.log(12.0), 0.8, n)))


def _mirrored_concurrency(rng: np.random.Generator, n: int) -> FloatArray:
    """A candidate mirrored at 10 %: the request itself plus a tenth of the others."""
    others = _primary_concurrency(rng, n).astype(np.int64) - 1
    return 1.0 + rng.binomial(others, MIRROR_SHARE).astype(np.float64)


def _latency(rng: np.random.Generator, concurrency: FloatArray, speed: float = 1.0) -> FloatArray:
    noise = rng.lognormal(0.0, NOISE_SIGMA, concurrency.size)
    return speed * (BASE_S + PER_REQUEST_S * concurrency) * noise


def _plain_json(value: object) -> None:
    text = json.dumps(value, allow_nan=False)
    assert json.loads(text) == value


# --- matched load ---------------------------------------------------------------------


def test_the_same_backend_at_a_tenth_of_the_load_is_not_judged_faster() -> None:
    rng = np.random.default_rng(0)
    primary_c = _primary_concurrency(rng, 2000)
    candidate_c = _mirrored_concurrency(rng, 2000)
    primary = _latency(rng, primary_c)
    candidate = _latency(rng, candidate_c)

    naive = stats.mannwhitneyu(candidate, primary)
    assert naive.pvalue < 1e-100  # pooled, the idle candidate looks far faster
    assert np.median(candidate) < 0.5 * np.median(primary)

    matched = compare_at_matched_load(primary, primary_c, candidate, candidate_c)
    assert matched.comparable
    assert matched.p_value is not None and matched.p_value > 0.3  # 0.589
    assert not matched.significantly_better and not matched.significantly_worse
    assert matched.relative_shift is not None and abs(matched.relative_shift) < 0.02
    assert matched.relative_ci_low is not None and matched.relative_ci_high is not None
    assert matched.relative_ci_low < 0.0 < matched.relative_ci_high
    # Nearly every candidate value found primary values at its load; about 60 % of the
    # primary's did not (loads the candidate never saw), and they take no part.
    assert matched.n_candidate_matched >= 1990
    assert 1000 < matched.n_baseline_matched < 1400
    low = next(s for s in matched.strata if s.label == "[1, 2)")
    assert low.comparable and low.n_candidate > 600 and low.n_baseline >= 5
    assert any(not s.comparable and s.n_baseline > 0 for s in matched.strata)
    assert math.isclose(sum(s.weight for s in matched.strata), 1.0)
    _plain_json(matched.to_dict())


@pytest.mark.parametrize("candidate_load", ["same", "a tenth"])
def test_a_backend_truly_30_percent_faster_at_equal_load_is_judged_faster(
    candidate_load: str,
) -> None:
    rng = np.random.default_rng(1)
    primary_c = _primary_concurrency(rng, 2000)
    if candidate_load == "same":
        candidate_c = _primary_concurrency(rng, 2000)
    else:
        candidate_c = _mirrored_concurrency(rng, 2000)
    primary = _latency(rng, primary_c)
    candidate = _latency(rng, candidate_c, speed=0.7)

    matched = compare_at_matched_load(primary, primary_c, candidate, candidate_c)
    assert matched.significantly_better and not matched.significantly_worse
    assert matched.p_value is not None and matched.p_value < 1e-50
    assert matched.relative_shift is not None and -0.36 < matched.relative_shift < -0.24
    assert matched.effect_size is not None and matched.effect_size < -0.3


def test_backends_never_seen_at_the_same_load_are_not_comparable() -> None:
    rng = np.random.default_rng(2)
    primary_c = rng.integers(20, 40, 300).astype(np.float64)
    candidate_c = rng.integers(1, 3, 300).astype(np.float64)
    matched = compare_at_matched_load(
        _latency(rng, primary_c), primary_c, _latency(rng, candidate_c), candidate_c
    )
    assert not matched.comparable
    assert "not comparable" in matched.reason
    assert matched.p_value is None and matched.shift is None
    assert not matched.significantly_better and not matched.significantly_worse
    assert matched.n_candidate_matched == matched.n_baseline_matched == 0
    assert all(not s.comparable for s in matched.strata)
    _plain_json(matched.to_dict())


def test_one_stratum_is_mann_whitney_and_hodges_lehmann() -> None:
    rng = np.random.default_rng(3)
    baseline = rng.normal(0.0, 1.0, 40)
    candidate = rng.normal(0.3, 1.0, 50)
    one = compare_strata(baseline, ["all"] * 40, candidate, ["all"] * 50, higher_is_better=False)
    scipy_p = stats.mannwhitneyu(
        candidate, baseline, use_continuity=False, method="asymptotic"
    ).pvalue
    assert one.p_value == pytest.approx(scipy_p, rel=1e-9)
    assert one.shift == pytest.approx(hodges_lehmann(baseline, candidate).shift, abs=1e-9)
    u = stats.mannwhitneyu(candidate, baseline).statistic
    assert one.effect_size == pytest.approx(2.0 * u / (40 * 50) - 1.0)
    assert one.shift is not None
    assert one.shift_ci_low is not None and one.shift_ci_high is not None
    assert one.shift_ci_low < one.shift < one.shift_ci_high


def test_strata_below_the_minimum_are_listed_but_not_compared() -> None:
    baseline = [1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 10.0, 11.0]
    candidate = [1.5, 2.5, 3.5, 4.5, 5.5, 20.0]
    result = compare_strata(
        baseline,
        ["a"] * 6 + ["b"] * 2,
        candidate,
        ["a"] * 5 + ["b"],
        higher_is_better=False,
    )
    assert result.comparable
    a, b = result.strata
    assert a.comparable and a.weight == 1.0 and (a.n_baseline, a.n_candidate) == (6, 5)
    assert not b.comparable and b.weight == 0.0 and b.shift is None
    assert (b.n_baseline, b.n_candidate, b.median_candidate) == (2, 1, 20.0)
    assert (result.n_baseline_matched, result.n_candidate_matched) == (6, 5)


def test_concurrency_bins_are_named_half_open_intervals() -> None:
    assert bin_labels([0, 1, 4, 5, 9, 2000], [1, 2, 4, 8, 1024]) == [
        "<1",
        "[1, 2)",
        "[4, 8)",
        "[4, 8)",
        "[8, 1024)",
        ">=1024",
    ]
    with pytest.raises(ValueError):
        bin_labels([1], [2, 1])


def test_the_load_curve_recovers_the_load_model() -> None:
    rng = np.random.default_rng(4)
    concurrency = _primary_concurrency(rng, 4000)
    curve = load_curve(_latency(rng, concurrency), concurrency)
    assert curve.fitted_points == 2000  # Theil-Sen on a seeded subset
    assert curve.slope is not None and curve.slope_ci_low is not None
    assert curve.slope_ci_high is not None
    assert curve.slope_ci_low <= curve.slope <= curve.slope_ci_high
    assert PER_REQUEST_S * 0.9 < curve.slope < PER_REQUEST_S * 1.1  # 0.0296
    assert curve.intercept is not None and abs(curve.intercept - BASE_S) < 0.03
    busy = [p for p in curve.points if p.n >= 50]
    assert len(busy) >= 8
    assert all(p.p90 > p.median for p in busy)
    medians = [p.median for p in busy]
    assert medians == sorted(medians)  # latency grows with load
    _plain_json(curve.to_dict())


def test_one_load_level_has_no_slope() -> None:
    curve = load_curve([0.2, 0.3, 0.25], [4, 4, 4])
    assert curve.slope is None and [p.concurrency for p in curve.points] == ["[4, 5)"]


# --- cache strata -----------------------------------------------------------------------


def _cache_traffic(
    rng: np.random.Generator, n: int, cold_later_turns: float, speed: float = 1.0
) -> tuple[FloatArray, list[int | None], list[int | None]]:
    """70 % later turns (1500-6000 tokens, warm: 75-95 % cached, cold: 0-10 %); first
    turns (300-900 tokens) have nothing cached, and 30 % of them do not report it."""
    later = rng.random(n) < 0.7
    prompt = np.where(later, rng.integers(1500, 6000, n), rng.integers(300, 900, n))
    cold = later & (rng.random(n) < cold_later_turns)
    warm_share = rng.uniform(0.75, 0.95, n)
    share = np.where(~later, 0.0, np.where(cold, rng.uniform(0.0, 0.1, n), warm_share))
    cached = np.floor(prompt * share).astype(np.int64)
    ttft = speed * (0.03 + 1e-4 * (prompt - cached)) * rng.lognormal(0.0, 0.2, n)
    unreported = ~later & (rng.random(n) < 0.3)
    cached_tokens = [None if u else int(c) for u, c in zip(unreported, cached, strict=True)]
    return ttft, [int(p) for p in prompt], cached_tokens


def test_a_cold_cache_on_later_turns_is_not_judged_slower_within_cache_strata() -> None:
    rng = np.random.default_rng(0)
    primary, primary_prompt, primary_cached = _cache_traffic(rng, 1500, 0.1)
    candidate, candidate_prompt, candidate_cached = _cache_traffic(rng, 1500, 0.7)

    pooled = stats.mannwhitneyu(candidate, primary)
    assert pooled.pvalue < 1e-80  # pooled, the cold candidate looks ~1.9x slower
    assert np.median(candidate) > 1.5 * np.median(primary)

    within = compare_within_cache_strata(
        primary, primary_prompt, primary_cached, candidate, candidate_prompt, candidate_cached
    )
    assert within.comparable
    assert within.p_value is not None and within.p_value > 0.3  # 0.963
    assert not within.significantly_worse
    assert within.relative_shift is not None and abs(within.relative_shift) < 0.02
    labels = {s.label for s in within.strata}
    assert "prompt [4096, 8192) cached >=75%" in labels
    assert "prompt [2048, 4096) cached [0%, 25%)" in labels
    assert f"prompt [512, 1024) cached {UNKNOWN}" in labels

    primary_rate = cache_hit_rate(primary_prompt, primary_cached)
    candidate_rate = cache_hit_rate(candidate_prompt, candidate_cached)
    assert primary_rate.hit_rate is not None and candidate_rate.hit_rate is not None
    assert primary_rate.hit_rate > 0.6 > 0.35 > candidate_rate.hit_rate  # 0.71 vs 0.27
    assert primary_rate.unknown > 0 and primary_rate.known + primary_rate.unknown == 1500
    _plain_json(within.to_dict())
    _plain_json(candidate_rate.to_dict())


def test_a_candidate_slower_at_equal_cache_warmth_is_judged_slower() -> None:
    rng = np.random.default_rng(1)
    primary, primary_prompt, primary_cached = _cache_traffic(rng, 1500, 0.1)
    candidate, candidate_prompt, candidate_cached = _cache_traffic(rng, 1500, 0.7, 1.3)
    within = compare_within_cache_strata(
        primary, primary_prompt, primary_cached, candidate, candidate_prompt, candidate_cached
    )
    assert within.significantly_worse
    assert within.relative_shift is not None and 0.2 < within.relative_shift < 0.4


def test_an_unknown_cached_count_is_its_own_stratum_never_zero() -> None:
    labels = cache_strata([1000, 1000, 1000, None, 3000], [None, 0, 900, 10, 3000])
    assert labels == [
        "prompt [512, 1024) cached unknown",
        "prompt [512, 1024) cached [0%, 25%)",
        "prompt [512, 1024) cached >=75%",
        "prompt unknown cached unknown",
        "prompt [2048, 4096) cached >=75%",
    ]
    rate = cache_hit_rate([1000, 1000, None, 1000], [None, 0, 5, 500])
    assert (rate.known, rate.unknown, rate.requests_with_hit) == (2, 2, 1)
    assert rate.hit_rate == pytest.approx(0.25)
    assert cache_hit_rate([None], [None]).hit_rate is None


# --- sample bias ------------------------------------------------------------------------


def _traffic(rng: np.random.Generator, n: int) -> tuple[FloatArray, list[str], list[str]]:
    tokens = np.round(rng.lognormal(np.log(800.0), 1.0, n))
    route = [str(x) for x in rng.choice(["chat", "completions"], n, p=[0.8, 0.2])]
    streamed = [str(x) for x in rng.choice(["true", "false"], n, p=[0.6, 0.4])]
    return tokens, route, streamed


def _byte_bounded_buffer(
    tokens: FloatArray, budget_bytes: float, window: int = 64
) -> tuple[list[int], list[int]]:
    """Each window of arrivals shares a byte budget; when over it, drop the largest held
    request first (4 bytes a token)."""
    kept: list[int] = []
    dropped: list[int] = []
    for start in range(0, tokens.size, window):
        held: list[int] = []
        for i in range(start, min(start + window, tokens.size)):
            held.append(i)
            while 4.0 * sum(tokens[j] for j in held) > budget_bytes:
                largest = max(held, key=lambda j: tokens[j])
                held.remove(largest)
                dropped.append(largest)
        kept += held
    return sorted(kept), dropped


def _bias_of(
    tokens: FloatArray, features: dict[str, list[str]], kept: list[int], dropped: list[int]
) -> SampleBias:
    """The check over all ``tokens`` and ``features`` against the ``kept`` requests, the
    ``dropped`` ones dropped for a full buffer."""
    return check_sample_bias(
        tokens,
        tokens[kept],
        seen_features=features,
        evaluated_features={name: [seen[i] for i in kept] for name, seen in features.items()},
        drops=[("buffer_full", float(tokens[i])) for i in dropped],
    )


def test_a_byte_bounded_buffer_that_drops_long_prompts_first_is_flagged() -> None:
    rng = np.random.default_rng(3)
    tokens, route, streamed = _traffic(rng, 4000)
    kept, dropped = _byte_bounded_buffer(tokens, 150_000)  # ~44 % of a window's bytes
    bias = _bias_of(tokens, {"route": route, "streamed": streamed}, kept, dropped)

    assert bias.skew and not bias.refuse
    assert bias.ks_statistic is not None and bias.ks_p_value is not None
    assert bias.ks_statistic > 0.15 and bias.ks_p_value < 1e-20  # D = 0.198
    assert bias.median_evaluated is not None and bias.median_seen is not None
    assert bias.median_evaluated < bias.median_seen
    assert bias.drops_by_reason == (("buffer_full", len(dropped)),)
    rates = [b.drop_rate for b in bias.buckets]
    assert rates[0] == 0.0 and rates[-1] == 1.0  # the short all kept, the longest all lost
    assert [b.weight for b in bias.buckets[:2]] == pytest.approx([0.79, 0.79], abs=0.01)
    long = next(b for b in bias.buckets if b.prompt_tokens == "[1024, 4096)")
    assert long.weight is not None and 1.3 < long.weight < MAX_IMPORTANCE_WEIGHT
    assert bias.weight_for(2000.0) == long.weight
    assert bias.weight_for(50_000.0) is None  # no evaluated request that long
    assert 0.0 < bias.uncovered_share < 0.05
    assert all(c.total_variation < 0.05 for c in bias.categories)  # size-blind features
    assert any("prompt tokens (KS D)" in r for r in bias.reasons)
    _plain_json(bias.to_dict())


def test_a_buffer_that_keeps_few_long_prompts_refuses_a_verdict() -> None:
    rng = np.random.default_rng(3)
    tokens, route, streamed = _traffic(rng, 4000)
    kept, dropped = _byte_bounded_buffer(tokens, 60_000)
    bias = _bias_of(tokens, {"route": route, "streamed": streamed}, kept, dropped)
    assert bias.skew and bias.refuse
    assert bias.max_weight is not None and bias.max_weight > MAX_IMPORTANCE_WEIGHT
    assert any(r.startswith("refuse: importance weight") for r in bias.reasons)


def test_an_unbiased_sample_is_not_flagged() -> None:
    rng = np.random.default_rng(3)
    tokens, route, streamed = _traffic(rng, 4000)
    kept = [int(i) for i in np.flatnonzero(rng.random(4000) < 0.3)]
    bias = _bias_of(tokens, {"route": route, "streamed": streamed}, kept, [])
    assert not bias.skew and not bias.refuse
    assert bias.ks_statistic is not None and bias.ks_statistic < 0.05
    assert bias.max_weight is not None and bias.max_weight < 1.2
    assert bias.reasons == ("the evaluated requests look like the traffic",)


def test_a_categorical_skew_is_flagged_by_total_variation() -> None:
    rng = np.random.default_rng(5)
    tokens, route, _ = _traffic(rng, 3000)
    kept = [i for i in range(3000) if route[i] == "chat" or i % 10 == 0]
    depth = [turn_depth_bucket(1 + i % 6) for i in range(3000)]
    bias = _bias_of(tokens, {"route": route, "turn_depth": depth}, kept, [])
    shift = next(c for c in bias.categories if c.feature == "route")
    assert shift.total_variation > 0.1 and shift.p_value is not None and shift.p_value < 0.01
    assert bias.skew and any(r.startswith("skew: route") for r in bias.reasons)
    assert set(next(c for c in bias.categories if c.feature == "turn_depth").categories) == {
        "[1, 2)",
        "[2, 4)",
        "[4, 8)",
    }


def test_too_few_requests_are_not_tested_for_skew() -> None:
    bias = check_sample_bias([100.0] * 50, [100.0] * 5)
    assert not bias.skew and bias.ks_statistic is None and "too few" in bias.reasons[0]


# --- how many more samples ---------------------------------------------------------------

SHIFT_SD = 0.5
EARLY_PER_SIDE = 60
STREAMS = 25
LOOK_EVERY = 10
LAST_LOOK = 400


def _empirical_turning_point(rng_seed: int, replicates: int = 400) -> int:
    """Smallest n per side at which Mann-Whitney rejects at the gates' alpha in at least
    80 % of simulated windows, by bisection over n."""

    def power(n: int) -> float:
        rng = np.random.default_rng(rng_seed + n)
        baseline = rng.normal(0.0, 1.0, (replicates, n))
        candidate = rng.normal(SHIFT_SD, 1.0, (replicates, n))
        p = stats.mannwhitneyu(candidate, baseline, axis=1).pvalue
        return float(np.mean(p < ALPHA))

    low, high = 8, 1024
    while high - low > 1:
        middle = (low + high) // 2
        if power(middle) >= 0.8:
            high = middle
        else:
            low = middle
    return high


def test_the_sample_estimate_is_within_a_factor_of_two_of_where_the_verdict_turns() -> None:
    # True effect: the candidate's values are half a standard deviation larger
    # (Cliff's delta 0.276; Noether's size with this delta: 88 per side).
    estimates = []
    turns = []
    for stream in range(STREAMS):
        rng = np.random.default_rng(1000 + stream)
        baseline = rng.normal(0.0, 1.0, LAST_LOOK)
        candidate = rng.normal(SHIFT_SD, 1.0, LAST_LOOK)
        early_b, early_c = baseline[:EARLY_PER_SIDE], candidate[:EARLY_PER_SIDE]
        u = float(stats.mannwhitneyu(early_c, early_b).statistic)
        delta = 2.0 * u / EARLY_PER_SIDE**2 - 1.0  # Cliff's delta, as the judge reports it
        estimate = samples_needed_for_location(
            delta, PowerQuery(EARLY_PER_SIDE, EARLY_PER_SIDE, min_samples=30)
        )
        if estimate.needed_per_side is not None:
            assert estimate.more_needed == max(0, estimate.needed_per_side - EARLY_PER_SIDE)
        estimates.append(estimate.needed_per_side or 10**9)
        # Where this window's verdict turns for good: the first look (every 10 values)
        # after which Mann-Whitney stays significant.
        looks = np.arange(LOOK_EVERY, LAST_LOOK + 1, LOOK_EVERY)
        significant = np.array(
            [stats.mannwhitneyu(candidate[:n], baseline[:n]).pvalue < ALPHA for n in looks]
        )
        not_yet = looks[~significant]
        turns.append(int(not_yet[-1]) + LOOK_EVERY if not_yet.size else int(looks[0]))

    estimate_median = float(np.median(estimates))  # 62
    turning_point = _empirical_turning_point(7)  # 92: power 0.8 reached by simulation
    stream_turn = float(np.median(turns))  # 40: windows turn for good, median
    assert turning_point / 2 <= estimate_median <= turning_point * 2
    assert stream_turn / 2 <= estimate_median <= stream_turn * 2


def test_noether_matches_its_closed_form_and_floors_at_min_samples() -> None:
    z = stats.norm.ppf(0.99) + stats.norm.ppf(0.8)
    estimate = samples_needed_for_location(0.2, PowerQuery(40, 50))
    assert estimate.needed_per_side == math.ceil(2 * z**2 / (3 * 0.04))  # 168
    assert estimate.have_per_side == 40 and estimate.more_needed == estimate.needed_per_side - 40
    big = samples_needed_for_location(-0.9, PowerQuery(10, 10, min_samples=30))
    assert big.needed_per_side == 30 and big.more_needed == 20
    none = samples_needed_for_location(0.0, PowerQuery(100, 100))
    assert none.needed_per_side is None and none.more_needed is None
    assert "no effect observed" in none.reason
    tiny = samples_needed_for_location(1e-5, PowerQuery(100, 100))
    assert tiny.needed_per_side is None
    _plain_json(estimate.to_dict())


def test_rate_and_mean_estimates_match_textbook_values() -> None:
    # Two proportions 5 % vs 10 %, alpha 0.05, power 0.8: 435 per side (Fleiss, no
    # continuity correction). Two means, difference 1, sd 2 each: 63 per side.
    rate = samples_needed_for_rate(0.05, 0.10, PowerQuery(100, 120, confidence=0.95))
    assert rate.needed_per_side == 435 and rate.more_needed == 335
    assert rate.effect == pytest.approx(0.05)
    mean = samples_needed_for_mean(1.0, 2.0, 2.0, PowerQuery(70, 70, confidence=0.95))
    assert mean.needed_per_side == 63 and mean.more_needed == 0
    with pytest.raises(ValueError):
        samples_needed_for_rate(0.1, 1.2, PowerQuery(10, 10))


# --- reweighting a skewed sample (the judge's rule 9) --------------------------------


def test_resampling_follows_the_weights_at_their_effective_size() -> None:
    weights = np.array([1.0] * 60 + [3.0] * 40)
    keep = resample_indices(weights, seed=1)
    kish = weights.sum() ** 2 / np.square(weights).sum()
    assert keep.size == round(kish) and np.all(np.diff(keep) >= 0)
    share_heavy = float(np.mean(keep >= 60))
    assert share_heavy == pytest.approx(120.0 / 180.0, abs=1.0 / keep.size)
    assert np.array_equal(keep, resample_indices(weights, seed=1))  # seeded
    assert np.array_equal(resample_indices(np.ones(7), seed=5), np.arange(7))


def _judged_ttft(
    tokens: FloatArray, kept: list[int] | range, bias: SampleBias | None
) -> MetricVerdict:
    """TTFT of a primary and a candidate whose prefill costs twice as much per token,
    both at concurrency 1, judged on the requests ``kept`` (the same exchanges a side)."""
    noise = np.random.default_rng(4)
    primary = 0.02 + 2e-5 * tokens + noise.normal(0.0, 0.003, tokens.size)
    candidate = 0.02 + 4e-5 * tokens + noise.normal(0.0, 0.003, tokens.size)
    idx = list(kept)
    n, prompt = len(idx), tuple(int(tokens[i]) for i in idx)
    size = tuple(float(t) for t in prompt)
    samples = MetricSamples(
        candidate=[float(candidate[i]) for i in idx], baseline=[float(primary[i]) for i in idx],
        conditions=LoadConditions((1,) * n, (1,) * n, prompt, (None,) * n, prompt, (None,) * n,
                                  cache=True, candidate_prompt_size=size,
                                  baseline_prompt_size=size))
    verdict = judge({"latency.ttft_s": samples}, Gates(min_samples=10),
                    {"latency.ttft_s": "lower"}, sample_bias=bias)
    return verdict.metric("latency.ttft_s")


def test_a_skewed_sample_reweighted_recovers_the_traffic_s_latency_shift() -> None:
    rng = np.random.default_rng(3)
    tokens, route, streamed = _traffic(rng, 4000)
    kept, dropped = _byte_bounded_buffer(tokens, 150_000)
    bias = _bias_of(tokens, {"route": route, "streamed": streamed}, kept, dropped)
    assert bias.skew and not bias.refuse
    # The truth: every request of the traffic judged, in the buckets the sample covers
    # (the uncovered share, under 5 %, is what no weighting can answer for).
    covered = [i for i in range(tokens.size) if bias.weight_for(float(tokens[i])) is not None]
    truth = _judged_ttft(tokens, covered, None).matched
    everything = _judged_ttft(tokens, range(tokens.size), None).matched
    judged = _judged_ttft(tokens, kept, bias)
    assert truth is not None and everything is not None and judged.matched is not None
    assert judged.reweighting is not None and judged.reweighting.unweighted is not None
    unweighted = judged.reweighting.unweighted
    reweighted = judged.matched
    assert truth.shift is not None and everything.shift is not None
    assert reweighted.shift is not None and reweighted.shift_ci_low is not None
    assert reweighted.shift_ci_high is not None
    print(f"TTFT shift at matched load and cache: traffic {truth.shift * 1e3:.2f} ms "
          f"(all traffic {everything.shift * 1e3:.2f} ms); evaluated unweighted "
          f"{unweighted['shift'] * 1e3:.2f} ms [{unweighted['shift_ci_low'] * 1e3:.2f}, "
          f"{unweighted['shift_ci_high'] * 1e3:.2f}]; reweighted {reweighted.shift * 1e3:.2f}"
          f" ms [{reweighted.shift_ci_low * 1e3:.2f}, {reweighted.shift_ci_high * 1e3:.2f}] "
          f"on {judged.reweighting.effective_candidate} of {len(kept)} values")
    # Unweighted the long prompts are missing and the shift looks smaller than it is ...
    assert not unweighted["shift_ci_low"] <= truth.shift <= unweighted["shift_ci_high"]
    assert unweighted["shift_ci_high"] < truth.shift
    # ... reweighted, the interval holds the traffic's shift.
    assert reweighted.shift_ci_low <= truth.shift <= reweighted.shift_ci_high
    assert judged.basis.endswith("reweighted to the traffic's prompt sizes")
    assert dict(judged.reweighting.weights)["[1024, 4096)"] == pytest.approx(1.42, abs=0.01)
    assert judged.reweighting.effective_candidate < len(kept)
    _plain_json(judged.to_dict())
