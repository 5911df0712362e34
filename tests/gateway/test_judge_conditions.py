"""The judge compares like with like, end to end (issue 13): simulators whose latency grows
with their requests in flight, mirrored through the real gateway on 127.0.0.1, scored and
stored in SQLite, judged over the admin endpoint.

Each test is bounded: a few hundred short requests at most, over loopback.
"""

from __future__ import annotations

import asyncio
import random
import subprocess
import sys
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
import pytest

from gateway._sampler import mirror_sampled
from tests.utils import RunningGateway, eventually, run_gateway, run_sim

# The load model both backends share in the like-for-like tests: TTFT grows by 10 ms and
# each inter-token gap by 1 ms per other request in flight. Latencies are tens of ms so
# that the test process's own event-loop lag (the sims and the gateway share it, on a
# busy machine) stays small beside them.
LOAD = {"ttft_ms": 30.0, "ttft_per_inflight_ms": 10.0, "itl_ms": 5.0,
        "itl_per_inflight_ms": 1.0, "tokens": 6}
SCORERS = ["reliability", "latency", "cache"]
PHASES = ((1, 200), (2, 200), (8, 120), (16, 240))
"""(clients in flight, requests): closed-loop phases, so the primary runs at each load.
Each request carries the id ``judge-N`` (N counts from 0 over the phases), so which ones a
candidate is sent is fixed: "twin" gets 19 and 17 of the first two phases, "quick" 19
and 24. The candidate runs at one or two requests in flight, so those are the primary's
values its latencies are matched with; with random ids a run could draw fewer than the
gate's minimum of 10 there and be judged INCONCLUSIVE, rightly."""


def _evaluation(tmp_path: Any, min_samples: int = 10) -> dict[str, Any]:
    return {"enabled": True, "scorers": SCORERS,
            "store": {"url": f"sqlite+aiosqlite:///{tmp_path / 'u.db'}"},
            "gates": {"min_samples": min_samples}}


async def _chat(http: aiohttp.ClientSession, gw: RunningGateway,
                messages: list[dict[str, str]], session: str,
                request_id: str | None = None) -> str:
    body = {"model": "sim-model", "messages": messages, "stream": True, "user": session}
    headers = {} if request_id is None else {"X-Request-Id": request_id}
    text = []
    async with http.post(gw.base_url + "/chat/completions", json=body,
                         headers=headers) as resp:
        assert resp.status == 200
        async for line in resp.content:
            if line.startswith(b"data: {") and b'"content":"' in line:
                text.append(line.split(b'"content":"')[1].split(b'"')[0].decode())
    return "".join(text)


async def _phases(http: aiohttp.ClientSession, gw: RunningGateway,
                  phases: tuple[tuple[int, int], ...] = PHASES) -> int:
    """Closed-loop load: in each phase ``clients`` clients send ``n`` requests in all."""
    sent = 0
    for clients, n in phases:
        queue = list(range(sent, sent + n))
        await asyncio.gather(*(_client(http, gw, queue) for _ in range(clients)))
        sent += n
    return sent


async def _client(http: aiohttp.ClientSession, gw: RunningGateway, queue: list[int]) -> None:
    while queue:
        i = queue.pop()
        await _chat(http, gw, [{"role": "user", "content": f"question {i}"}], f"s{i}",
                    request_id=f"judge-{i}")


async def _report(http: aiohttp.ClientSession, gw: RunningGateway, name: str) -> dict[str, Any]:
    async with http.get(f"{gw.admin_url}/candidates/{name}/report") as resp:
        assert resp.status == 200, await resp.text()
        report: dict[str, Any] = await resp.json()
    return report


def _metric(report: dict[str, Any], name: str) -> dict[str, Any]:
    found: dict[str, Any] = {m["metric"]: m for m in report["metrics"]}[name]
    return found


async def _mirrored(gw: RunningGateway, candidate: str,
                    traffic: Callable[[], Awaitable[int]]) -> None:
    await traffic()
    joined = gw.metric("understudy_mirror_joined_total", candidate=candidate)
    await eventually(lambda: gw.written_records >= int(joined), within_s=60)


async def _report_at_ten_percent(tmp_path: Any, name: str,
                                 candidate_load: dict[str, Any]) -> dict[str, Any]:
    """The report on ``name`` (a simulator with ``candidate_load``) mirrored at 10 % of the
    requests of PHASES sent to a primary with LOAD."""
    async with run_sim(**LOAD) as primary, run_sim(**candidate_load) as candidate, \
            run_gateway(primary.url, candidates=[
                {"name": name, "url": candidate.url, "sample_rate": 0.1,
                 "sampling_unit": "request"}],
                evaluation=_evaluation(tmp_path)) as gw, aiohttp.ClientSession() as http:
        await _mirrored(gw, name, lambda: _phases(http, gw))
        return await _report(http, gw, name)


async def test_identical_candidate_at_ten_percent_is_not_judged_faster(tmp_path: Any) -> None:
    report = await _report_at_ten_percent(tmp_path, "twin", LOAD)
    ttft = _metric(report, "latency.ttft_s")
    pooled, matched = ttft["statistics"], ttft["matched"]
    print(f"identical at 10%: pooled TTFT shift {pooled['relative_shift']:+.1%} "
          f"(p={pooled['p_value']:.2g}); matched {matched['relative_shift']:+.1%} "
          f"(p={matched['p_value']:.2g}), verdict {ttft['verdict']} on {ttft['basis']}")
    # Pooled, the twin looks much faster: it ran at a tenth of the primary's load.
    assert pooled["relative_shift"] < -0.2 and pooled["p_value"] < 0.01
    # At matched load it is not faster: no more than 5 % either way, and the interval
    # does not rule out "no faster" beyond that (a 98 % interval misses 0 one time in 50
    # for identical backends, so the test reads magnitudes, not the bare sign).
    assert ttft["basis"] == "primary at matched load and cache"
    assert matched["comparable"]
    assert matched["relative_shift"] > -0.05, matched
    assert matched["relative_ci_high"] > -0.05, matched
    curves = report["conditions"]["load_curves"]["latency.ttft_s"]
    assert curves["primary"]["slope"] > 0.001  # ~3 ms per request in flight
    assert {"candidate", "primary"} <= set(curves)
    printed = (await asyncio.to_thread(
        subprocess.run, [sys.executable, "-m", "gateway.cli", "report", "twin", "--db",
                         _evaluation(tmp_path)["store"]["url"]],
        capture_output=True, text=True, check=True)).stdout
    print(printed)
    assert "latency and throughput at matched load" in printed
    assert "latency and throughput vs concurrency" in printed


async def test_truly_faster_candidate_is_judged_faster_at_equal_load(tmp_path: Any) -> None:
    faster = {**LOAD, "ttft_ms": 10.0, "ttft_per_inflight_ms": 5.0}
    report = await _report_at_ten_percent(tmp_path, "quick", faster)
    ttft = _metric(report, "latency.ttft_s")
    matched = ttft["matched"]
    print(f"faster at 10%: matched TTFT shift {matched['relative_shift']:+.1%} "
          f"(p={matched['p_value']:.2g}), verdict {ttft['verdict']}")
    assert matched["comparable"] and matched["shift_ci_high"] < 0.0
    assert ttft["verdict"] == "PASS"


@pytest.mark.parametrize(("name", "candidate_load", "verdicts"), [
    ("twin", LOAD, ("PASS", "MARGINAL")),
    ("slow", {**LOAD, "itl_ms": 7.5}, ("FAIL",)),  # decodes a third slower at any load
])
async def test_throughput_at_a_half_canary_is_compared_at_matched_load(
        tmp_path: Any, name: str, candidate_load: dict[str, Any],
        verdicts: tuple[str, ...]) -> None:
    """At a canary step the candidate serves its share of the sessions live and is sent the
    rest as replays: at 50 % it runs at about twice the primary's load. Its decode
    throughput is compared at matched load, as its latencies are: pooled, the identical
    simulator read about 20 % slower, a FAIL of the 10 % gate that rolled the canary back.
    Matched on the load a request started under, it reads within a few per cent (MARGINAL
    where significant: more requests arrive during the candidate's decodes than during the
    primary's). A candidate that is slower at every load still fails."""
    evaluation = {**_evaluation(tmp_path), "scorers": [*SCORERS, "throughput"]}
    async with run_sim(**LOAD) as primary, run_sim(**candidate_load) as candidate, \
            run_gateway(primary.url, candidates=[{"name": name, "url": candidate.url}],
                        evaluation=evaluation) as gw, aiohttp.ClientSession() as http:
        async with http.post(f"{gw.admin_url}/candidates/{name}/canary",  # judged here
                             json={"steps": [50, 100], "interval_s": 3600}) as resp:
            assert resp.status == 202, await resp.text()
        await _mirrored(gw, name, lambda: _phases(http, gw, ((1, 60), (2, 120), (4, 160))))
        report = await _report(http, gw, name)
    tps = _metric(report, "throughput.output_tps")
    pooled, matched = tps["statistics"], tps["matched"]
    at_load = matched and f"{matched['relative_shift']:+.1%} (p={matched['p_value']:.2g})"
    print(f"{name} at a 50 % canary: pooled tokens/s shift {pooled['relative_shift']:+.1%} "
          f"(p={pooled['p_value']:.2g}); matched {at_load}, verdict {tps['verdict']}")
    assert tps["basis"] == "primary at matched load"
    assert tps["verdict"] in verdicts, tps["reasons"]
    if name == "twin":
        assert abs(matched["relative_shift"]) < 0.1, tps["reasons"]  # within the gate
    assert "throughput.output_tps" in report["conditions"]["load_curves"]


async def test_a_canary_is_not_judged_against_a_replica_at_the_mirrors_load(
        tmp_path: Any) -> None:
    """A replica mirrored at the candidate's rate runs at the mirror's load; the canary's
    candidate serves half the sessions live besides, at about twice the primary's load.
    So the replica is not its baseline (the scorekeeper's rule 6): the primary at matched
    load is, for its latencies and throughput, and the primary for its rates. It was the
    replica, against which this identical engine read 18-19 % slower on tokens/s and
    57-59 % on TTFT (FAIL, twice); at matched load it reads -4 to -6 % and +2 %."""
    evaluation = {**_evaluation(tmp_path), "scorers": [*SCORERS, "throughput"]}
    async with run_sim(**LOAD) as primary, run_sim(**LOAD) as candidate, \
            run_sim(**LOAD) as replica, \
            run_gateway(primary.url, candidates=[
                {"name": "twin", "url": candidate.url},
                {"name": "replica", "url": replica.url, "role": "secondary"}],
                evaluation=evaluation) as gw, aiohttp.ClientSession() as http:
        async with http.post(f"{gw.admin_url}/candidates/twin/canary",
                             json={"steps": [50, 100], "interval_s": 3600}) as resp:
            assert resp.status == 202, await resp.text()
        await _mirrored(gw, "twin", lambda: _phases(http, gw, ((1, 40), (2, 80), (4, 100))))
        await eventually(lambda: gw.written_records >= int(
            gw.metric("understudy_mirror_joined_total", candidate="twin")
            + gw.metric("understudy_mirror_joined_total", candidate="replica")), within_s=60)
        report = await _report(http, gw, "twin")
        async with http.delete(f"{gw.admin_url}/canary") as resp:
            assert resp.status == 200, await resp.text()
        after = await _report(http, gw, "twin")
    for metric in ("throughput.output_tps", "latency.ttft_s"):
        m = _metric(report, metric)
        shift = (m.get("matched") or m["statistics"] or {}).get("relative_shift")
        print(f"twin at a 50 % canary, {metric}: {m['basis']}, shift {shift}, "
              f"{m['verdict']}; {m['reasons'][:2]}")
    for metric in ("throughput.output_tps", "latency.ttft_s"):
        assert _metric(report, metric)["basis"].startswith("primary at matched load"), metric
    assert _metric(report, "reliability.success")["basis"] == "primary"
    # The canary stopped, the same candidate is mirrored as the replica is again.
    assert _metric(after, "throughput.output_tps")["basis"] == "replica at the same rate"


async def test_cold_cache_candidate_is_compared_within_cache_strata(tmp_path: Any) -> None:
    # Two-turn conversations: a first turn of varied length, then a one-word follow-up.
    # The primary saw every first turn, so its second turns are served from its prefix
    # cache; the candidate, mirrored 30 % of requests, mostly missed the first turn.
    # Turn t of session s carries the id ``cold-s-t``, so the candidate's sample is the
    # same on every run: 44 first turns and 24 second turns, 10 of those after a first
    # turn it was sent (a warm cache), as asserted below.
    cached = {"ttft_ms": 2.0, "itl_ms": 0.5, "tokens": 4, "cache": "prefix",
              "prefill_ms_per_token": 1.0}  # well above a loaded machine's jitter
    sessions = 120
    sent = [[mirror_sampled("cold", f"cold-{s}-{turn}", 0.3) for turn in (0, 1)]
            for s in range(sessions)]
    assert sum(first for first, _ in sent) == 44 and sum(second for _, second in sent) == 24
    assert sum(first and second for first, second in sent) == 10
    async with run_sim(**cached) as primary, run_sim(**cached) as candidate, \
            run_gateway(primary.url, candidates=[
                {"name": "cold", "url": candidate.url, "sample_rate": 0.3,
                 "sampling_unit": "request"}],
                evaluation=_evaluation(tmp_path)) as gw, aiohttp.ClientSession() as http:

        async def conversations() -> int:
            words = random.Random(7)
            for s in range(sessions):
                text = " ".join(f"w{words.randrange(1000)}" for _ in range(words.randrange(
                    30, 200)))
                messages = [{"role": "user", "content": f"s{s} {text}"}]
                answer = await _chat(http, gw, messages, f"session-{s}",
                                     request_id=f"cold-{s}-0")
                messages += [{"role": "assistant", "content": answer},
                             {"role": "user", "content": "more"}]
                await _chat(http, gw, messages, f"session-{s}", request_id=f"cold-{s}-1")
            return 2 * sessions

        await _mirrored(gw, "cold", conversations)
        report = await _report(http, gw, "cold")
    ttft = _metric(report, "latency.ttft_s")
    pooled, matched = ttft["statistics"], ttft["matched"]
    hit = report["conditions"]["cache"]["hit_rates"]
    print(f"cold cache: pooled TTFT shift {pooled['relative_shift']:+.1%} "
          f"(p={pooled['p_value']:.2g}); within cache strata {matched['relative_shift']:+.1%} "
          f"(p={matched['p_value']:.2g}); hit rates candidate "
          f"{hit['candidate']['hit_rate']:.2f}, primary {hit['primary']['hit_rate']:.2f}")
    assert hit["candidate"]["hit_rate"] < hit["primary"]["hit_rate"]
    # Pooled it looks slower. Its p rests on 68 values, and a loaded machine's jitter
    # moves it about 0.05 (it read 0.051 at a +30.5 % shift once, two test runs sharing
    # the two cores): the shift is what misleads, its p only backs it.
    assert pooled["relative_shift"] > 0.2 and pooled["p_value"] < 0.1  # looks slower
    assert matched["comparable"]
    assert any("cached" in s["label"] and s["comparable"] for s in matched["strata"])
    # Not slower like for like (magnitudes, as in the identical-candidate test).
    assert matched["relative_shift"] < 0.1 and matched["relative_ci_low"] < 0.1, matched
    strata = report["conditions"]["cache"]["ttft_within_cache_strata"]
    assert strata["comparable"]


WAVES = 16


async def test_byte_bounded_buffer_dropping_long_prompts_flags_a_skew(tmp_path: Any) -> None:
    async with run_sim(ttft_ms=1, itl_ms=0.5, tokens=4) as primary, \
            run_sim(ttft_ms=10, itl_ms=1, tokens=4) as candidate, \
            run_gateway(primary.url, candidates=[
                {"name": "narrow", "url": candidate.url, "max_concurrency": 2,
                 "buffer_bytes": 4000, "buffer_items": 64}],
                evaluation=_evaluation(tmp_path)) as gw, aiohttp.ClientSession() as http:

        async def mixed() -> int:
            shapes = random.Random(3)

            async def one(i: int) -> None:
                long = shapes.random() < 0.5
                words = 300 if long else 5
                content = f"q{i} " + " ".join("word" for _ in range(words))
                await _chat(http, gw, [{"role": "user", "content": content}], f"s{i}")

            for wave in range(WAVES):
                await asyncio.gather(*(one(wave * 16 + i) for i in range(16)))
                await asyncio.sleep(0.05)
            return WAVES * 16

        await _mirrored(gw, "narrow", mixed)
        report = await _report(http, gw, "narrow")
    bias = report["sample_bias"]
    assert bias is not None and bias["ks_statistic"] is not None, bias
    print(f"byte-bounded buffer: seen median {bias['median_seen']}, evaluated median "
          f"{bias['median_evaluated']}, KS D {bias['ks_statistic']:.2f} "
          f"(p={bias['ks_p_value']:.2g}); drops {bias['drops_by_reason']}; "
          f"verdict {report['verdict']}: {bias['reasons']}")
    assert bias["skew"], bias["reasons"]
    assert bias["drops_by_reason"].get("buffer_full", 0) > 0
    # The long prompts were dropped first: their bucket is under-represented.
    longest = max(bias["buckets"], key=lambda b: b["seen"] and float(
        b["prompt_tokens"].strip("[<>=").split(",")[0]))
    assert longest["evaluated_share"] < longest["seen_share"]
    assert longest["drop_rate"] > 0.5
    reasons = " ".join(report["reasons"])
    assert "sample skew" in reasons
    ttft = _metric(report, "latency.ttft_s")
    print(f"TTFT basis {ttft['basis']!r}; reweighting {ttft['reweighting']}")
    if not bias["refuse"]:  # below the refusal bound the latencies are reweighted
        assert ttft["basis"].endswith("reweighted to the traffic's prompt sizes")
        assert ttft["reweighting"]["weights"] and ttft["reweighting"]["unweighted"]
        assert "reweighted to the traffic's prompt sizes" in reasons


@pytest.mark.parametrize("rate", [0.1])
async def test_replica_at_the_same_rate_is_the_latency_baseline(tmp_path: Any,
                                                                rate: float) -> None:
    async with run_sim(**LOAD) as primary, run_sim(**LOAD) as twin, \
            run_sim(**LOAD) as replica, \
            run_gateway(primary.url, candidates=[
                {"name": "twin", "url": twin.url, "sample_rate": rate,
                 "sampling_unit": "request"},
                {"name": "replica", "url": replica.url, "sample_rate": rate,
                 "sampling_unit": "request", "role": "secondary"}],
                evaluation=_evaluation(tmp_path, min_samples=10)) as gw, \
            aiohttp.ClientSession() as http:
        await _mirrored(gw, "twin", lambda: _phases(http, gw, ((4, 200), (12, 200))))
        await eventually(lambda: gw.written_records >= int(
            gw.metric("understudy_mirror_joined_total", candidate="twin")
            + gw.metric("understudy_mirror_joined_total", candidate="replica")), within_s=60)
        report = await _report(http, gw, "twin")
    ttft = _metric(report, "latency.ttft_s")
    print(f"against the replica: TTFT shift {ttft['statistics']['relative_shift']:+.1%} "
          f"(p={ttft['statistics']['p_value']:.2g}), verdict {ttft['verdict']}")
    assert ttft["basis"] == "replica at the same rate"
    success = _metric(report, "reliability.success")  # a rate too, on the replica's counts
    assert success["basis"] == "replica at the same rate", success
    assert ttft["statistics"]["hl_ci_low"] <= 0.0 <= ttft["statistics"]["hl_ci_high"] or abs(
        ttft["statistics"]["relative_shift"]) < 0.25


async def test_replica_added_and_changed_through_the_admin_api_is_the_basis(
        tmp_path: Any) -> None:
    """The same-rate replica is read from the runtime candidates: one added over the admin
    API is the baseline, and once its rate is changed there it no longer is."""
    async with run_sim(**LOAD) as primary, run_sim(**LOAD) as twin, \
            run_sim(**LOAD) as replica, \
            run_gateway(primary.url, candidates=[
                {"name": "twin", "url": twin.url, "sample_rate": 0.25,
                 "sampling_unit": "request"}],
                evaluation=_evaluation(tmp_path, min_samples=10)) as gw, \
            aiohttp.ClientSession() as http:
        async with http.post(f"{gw.admin_url}/candidates", json={
                "name": "replica", "url": replica.url, "sample_rate": 0.25,
                "sampling_unit": "request", "role": "secondary"}) as resp:
            assert resp.status == 201, await resp.text()
        await _mirrored(gw, "twin", lambda: _phases(http, gw, ((4, 160),)))
        await eventually(lambda: gw.written_records >= int(
            gw.metric("understudy_mirror_joined_total", candidate="twin")
            + gw.metric("understudy_mirror_joined_total", candidate="replica")), within_s=60)
        before = _metric(await _report(http, gw, "twin"), "latency.ttft_s")
        async with http.patch(f"{gw.admin_url}/candidates/replica",
                              json={"sample_rate": 1.0}) as resp:
            assert resp.status == 200, await resp.text()
        after = _metric(await _report(http, gw, "twin"), "latency.ttft_s")
    print(f"admin-added replica: basis {before['basis']!r}; after its rate changed: "
          f"{after['basis']!r}")
    assert before["basis"] == "replica at the same rate"
    assert after["basis"] == "primary at matched load and cache"


async def test_scraped_running_count_reveals_load_the_gateway_does_not_see(
        tmp_path: Any) -> None:
    """Another client loads the candidate directly: the gateway's own in-flight count
    there stays ~1, the candidate's scraped ``vllm:num_requests_running`` shows the rest,
    and the judge matches load on the larger of the two."""
    hidden_clients = 8
    async with run_sim(**LOAD) as primary, run_sim(**LOAD) as candidate, \
            run_gateway(primary.url, candidates=[
                {"name": "shared", "url": candidate.url, "sample_rate": 1.0,
                 "sampling_unit": "request", "max_concurrency": 1}],
                evaluation=_evaluation(tmp_path)) as gw, aiohttp.ClientSession() as http:
        stop = asyncio.Event()

        async def direct() -> None:  # straight to the candidate, never via the gateway
            body = {"model": "sim-model", "stream": True,
                    "messages": [{"role": "user", "content": "elsewhere"}]}
            while not stop.is_set():
                async with http.post(candidate.url + "/v1/chat/completions",
                                     json=body) as resp:
                    await resp.read()

        load = gw.state.backend_load
        assert load is not None
        hidden = [asyncio.create_task(direct()) for _ in range(hidden_clients)]
        try:  # the mirrored traffic starts once a scrape has seen the hidden load
            await eventually(lambda: (load.running("shared") or 0) >= hidden_clients - 2,
                             within_s=10)
            await _mirrored(gw, "shared", lambda: _phases(http, gw, ((1, 80),)))
        finally:
            stop.set()
            await asyncio.gather(*hidden)
        scrapes = gw.metric("understudy_backend_scrapes_total", backend="shared",
                            outcome="ok")
        report = await _report(http, gw, "shared")
    curves = report["conditions"]["load_curves"]["latency.ttft_s"]

    def median_load(curve: dict[str, Any]) -> float:
        points = curve["points"]
        loads = [float(p["concurrency"].strip("[<>=)").split(",")[0]) for p in points
                 for _ in range(p["n"])]
        return loads[len(loads) // 2]

    seen_by_gateway = median_load(curves["candidate by the gateway's count"])
    own = median_load(curves["candidate by its own count"])
    primary_own = median_load(curves["primary by its own count"])
    ttft = _metric(report, "latency.ttft_s")
    print(f"hidden load: {scrapes:.0f} scrapes of the candidate; median concurrency at the "
          f"candidate by the gateway's count {seen_by_gateway:g}, by its own count {own:g} "
          f"(primary's own {primary_own:g}); TTFT verdict {ttft['verdict']} on "
          f"{ttft['basis']}: {ttft['reasons'][0]}; pooled shift "
          f"{ttft['statistics']['relative_shift']:+.0%}")
    assert scrapes >= 3
    assert seen_by_gateway <= 2
    assert own >= hidden_clients - 2 and own >= seen_by_gateway + 4  # revealed
    assert primary_own <= 2
    # The candidate ran at a load the primary never saw: not comparable at matched load,
    # rather than a FAIL for being slow under load it was not given by this gateway.
    assert ttft["verdict"] != "FAIL", ttft["reasons"]
