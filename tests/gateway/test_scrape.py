"""The backend-load scraper (``gateway/_scrape.py``): parsing, staleness, failures counted."""

from __future__ import annotations

import socket

from gateway._metrics import GatewayMetrics
from gateway._scrape import MAX_RUNNING_COUNT, BackendLoad, parse_running
from tests.utils import run_sim

EXPOSITION = """# HELP vllm:num_requests_running Requests in the running batch.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 3.0
vllm:num_requests_running{engine="1",model_name="m"} 2.0
vllm:num_requests_running_total_fake 99
vllm:num_requests_waiting{engine="0",model_name="m"} 7.0
"""


def test_the_running_count_is_summed_over_engines_and_other_series_ignored() -> None:
    assert parse_running(EXPOSITION) == 5
    assert parse_running("vllm:num_requests_running 4\n") == 4
    assert parse_running("vllm:num_requests_waiting 4\n") is None
    assert parse_running("vllm:num_requests_running{a=\"b\"} nonsense\n") is None


def test_a_running_count_that_is_no_count_is_unknown() -> None:
    """Rule 2: +Inf raised OverflowError out of the scrape (a failed round, logged each
    interval), and 1e30 became an int no store column holds."""
    assert parse_running("vllm:num_requests_running 1e30\n") is None
    assert parse_running(f"vllm:num_requests_running {MAX_RUNNING_COUNT + 1}\n") is None
    for value in ("+Inf", "-Inf", "NaN"):
        assert parse_running(f"vllm:num_requests_running {value}\n") is None
        assert parse_running(f"{EXPOSITION}vllm:num_requests_running{{e=\"2\"}} {value}\n") == 5


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def test_a_backend_is_scraped_and_a_dead_one_counted_unknown() -> None:
    metrics = GatewayMetrics()
    async with run_sim() as sim:
        targets = {"sim": sim.url, "dead": f"http://127.0.0.1:{_closed_port()}"}
        load = BackendLoad(lambda: targets, metrics)
        await load.start()
        try:
            await load.scrape_once()
            assert load.running("sim") == 0
            assert load.running("dead") is None
            assert load.running("never") is None
        finally:
            await load.stop()
    def scrapes(backend: str, outcome: str) -> float:
        found = metrics.registry.get_sample_value(
            "understudy_backend_scrapes_total", {"backend": backend, "outcome": outcome})
        return found or 0.0

    assert scrapes("sim", "ok") >= 1
    assert scrapes("dead", "error") >= 1
