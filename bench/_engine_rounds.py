"""The rounds of bench/engine.py: what one measurement sends, what it reads, in which order.

A measurement is one request (TTFT) or one burst of streams (decode) to one server, timed by
``_stream_timing``; ``measured`` adds the CPU that went to the measured server, to the idle
one and to everything else on the machine while it ran (from /proc). ``run_rounds`` alternates
the servers as bench/engine.py's rule 1 says.
"""

from __future__ import annotations

import asyncio
import os
import random
import secrets
import statistics
import sys
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _procs import CLOCK_TICKS, cpu_ticks, machine_ticks
from _stream_timing import StreamError, StreamTiming, steady_rate, timed_stream

__all__ = [
    "LABELS",
    "SERVERS",
    "STREAMS",
    "Metric",
    "Plan",
    "Server",
    "run_rounds",
]

MODEL = "SmolLM2-135M-Instruct"  # the served name both servers default to
SERVERS = ("engine", "vllm")
LABELS = {"engine": "engine", "vllm": "vLLM"}
STREAMS = 8
WARM_UP_PROMPT_TOKENS = 128

TARGET_TTFT_RATIO = 1.2
TARGET_DECODE_RATIO = 1.0
TARGET_AGGREGATE_RATIO = 0.6

# vLLM answers 4k fresh tokens in ~12.6 s on two idle cores, but threads that spin-wait for
# each other on a shared machine have been seen 20x slower than that.
TTFT_TIMEOUT_S = 600.0
DECODE_TIMEOUT_S = 600.0
MAX_RUN_S = 20 * 60.0  # no round starts later than this after the first
# Prompt token ids are drawn from here: above SmolLM2's special and byte tokens, below its
# vocabulary size (49152), so every id is an ordinary piece of text.
PROMPT_IDS = (1_000, 48_000)
DECODE_PROMPT = "Write a long story about a lighthouse keeper who finds a message in a bottle."


@dataclass(frozen=True, slots=True)
class Metric:
    key: str
    title: str
    unit: str  # "s" (lower is better) or "tok/s" (higher is better)
    target: float
    prompt_tokens: int = 0  # ttft: the fresh prompt's length
    streams: int = 0  # decode: concurrent streams

    @property
    def lower_is_better(self) -> bool:
        return self.unit == "s"

    @property
    def target_text(self) -> str:
        return f"{'<=' if self.lower_is_better else '>='} {self.target:.2f}"

    def met(self, ratio: float) -> bool:
        return ratio <= self.target if self.lower_is_better else ratio >= self.target


@dataclass(frozen=True, slots=True)
class Plan:
    threads: int
    rounds: int
    lengths: tuple[int, ...]
    decode_tokens: int
    quick: bool

    @property
    def metrics(self) -> list[Metric]:
        ttft = [
            Metric(f"ttft@{n}", f"TTFT, {n} fresh tokens", "s", TARGET_TTFT_RATIO, prompt_tokens=n)
            for n in self.lengths
        ]
        return [
            *ttft,
            Metric("decode-1", "decode, 1 stream", "tok/s", TARGET_DECODE_RATIO, streams=1),
            Metric(
                f"decode-{STREAMS}",
                f"decode, {STREAMS} streams",
                "tok/s",
                TARGET_AGGREGATE_RATIO,
                streams=STREAMS,
            ),
        ]


@dataclass(frozen=True, slots=True)
class Server:
    name: str
    url: str
    pids: tuple[int, ...]  # billed for CPU: the engine process; vLLM's whole process tree


# --- one measurement --------------------------------------------------------------------


def chat_request(tag: str, tokens: int) -> dict[str, Any]:
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": f"[{tag}] {DECODE_PROMPT}"}],
        "max_tokens": tokens,
        "ignore_eos": True,
        "temperature": 0,
    }


async def ttft_sample(
    session: aiohttp.ClientSession, server: Server, prompt: list[int]
) -> dict[str, Any]:
    base = {"model": MODEL, "prompt": prompt, "max_tokens": 1, "temperature": 0}
    timing = await timed_stream(
        session, server.url + "/v1/completions", base, timeout_s=TTFT_TIMEOUT_S
    )
    if timing.prompt_tokens != len(prompt):
        raise StreamError(f"{timing.prompt_tokens} prompt tokens counted, {len(prompt)} sent")
    return {"value": timing.ttft_s, "cached_tokens": timing.cached_tokens}


async def decode_sample(
    session: aiohttp.ClientSession, server: Server, tag: str, tokens: int, streams: int
) -> dict[str, Any]:
    url = server.url + "/v1/chat/completions"
    tasks = [
        asyncio.ensure_future(
            timed_stream(
                session, url, chat_request(f"{tag}-{i}", tokens), timeout_s=DECODE_TIMEOUT_S
            )
        )
        for i in range(streams)
    ]
    try:
        timings: list[StreamTiming] = await asyncio.gather(*tasks)
    finally:  # one failed stream must not leave the others loading the next measurement
        for task in tasks:
            task.cancel()
    short = [t.completion_tokens for t in timings if t.completion_tokens != tokens]
    if short:
        raise StreamError(f"ignore_eos not honoured: {short} tokens, {tokens} asked")
    steps = [s for t in timings if (s := t.tokens_per_step) is not None]
    figures: dict[str, Any] = {
        "tokens_per_step": statistics.median(steps) if steps else None,
        "ttft_s": statistics.median(t.ttft_s for t in timings),
    }
    if streams == 1:
        rate = timings[0].decode_tokens_per_s
        if rate is None:
            raise StreamError("all tokens arrived at once")
        return {"value": rate, **figures}
    steady = steady_rate(timings)
    if steady is None:
        raise StreamError("the streams never decoded all at once")
    return {"value": steady[0], "window_s": steady[1], **figures}


async def measured(
    server: Server, peer: Server, run: Coroutine[Any, Any, dict[str, Any]]
) -> dict[str, Any]:
    """The figures of ``run`` (a coroutine not yet awaited) or its error, with the CPU that
    went where while it ran."""
    own = (os.getpid(),)
    before = [cpu_ticks(list(pids)) for pids in (server.pids, peer.pids, own)]
    busy_before = machine_ticks()[0]
    started = time.monotonic()
    try:
        result = await run
    except (StreamError, aiohttp.ClientError, TimeoutError, ValueError) as exc:
        result = {"error": f"{type(exc).__name__}: {exc}"}
    elapsed = time.monotonic() - started
    after = [cpu_ticks(list(pids)) for pids in (server.pids, peer.pids, own)]
    busy = machine_ticks()[0] - busy_before
    spent = [a - b for a, b in zip(after, before, strict=True)]

    def cores(ticks: int) -> float:
        return max(0.0, ticks / CLOCK_TICKS / elapsed) if elapsed > 0 else 0.0

    return {
        **result,
        "elapsed_s": elapsed,
        "server_cores": cores(spent[0]),
        "peer_cores": cores(spent[1]),
        "outside_cores": cores(busy - sum(spent)),
    }


# --- rounds -----------------------------------------------------------------------------


async def warm_up(session: aiohttp.ClientSession, servers: dict[str, Server]) -> None:
    """One short request of each kind per server, not measured: first-call costs go here."""
    rng = random.Random()
    for server in servers.values():
        prompt = [rng.randrange(*PROMPT_IDS) for _ in range(WARM_UP_PROMPT_TOKENS)]
        try:
            await ttft_sample(session, server, prompt)
            await decode_sample(session, server, f"warm-up-{secrets.token_hex(4)}", 8, 1)
            await decode_sample(session, server, f"warm-up-{secrets.token_hex(4)}", 4, STREAMS)
        except (StreamError, aiohttp.ClientError, TimeoutError, ValueError) as exc:
            raise RuntimeError(f"{LABELS[server.name]} failed its warm-up: {exc}") from exc


async def run_rounds(
    servers: dict[str, Server], plan: Plan, seed: int, log: Callable[[str], None]
) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    samples: list[dict[str, Any]] = []
    connector = aiohttp.TCPConnector(limit=2 * STREAMS)
    async with aiohttp.ClientSession(connector=connector) as session:
        log("warm-up: one short request of each kind per server (not measured)")
        await warm_up(session, servers)
        began = time.monotonic()
        for index in range(plan.rounds):
            if index and time.monotonic() - began > MAX_RUN_S:
                log(f"stopped after {index} rounds: past the run's bound of {MAX_RUN_S:.0f} s")
                break
            log(f"round {index + 1}/{plan.rounds}")
            for position, metric in enumerate(plan.metrics):
                order = SERVERS if (index + position) % 2 == 0 else SERVERS[::-1]
                # One prompt per round and metric, sent to both servers: fresh for each.
                prompt = [rng.randrange(*PROMPT_IDS) for _ in range(metric.prompt_tokens)]
                tag = f"{seed:x}-{index}-{metric.key}"
                pair: dict[str, dict[str, Any]] = {}
                for name in order:
                    server, peer = servers[name], servers[_other(name)]
                    run = (
                        ttft_sample(session, server, prompt)
                        if metric.prompt_tokens
                        else decode_sample(session, server, tag, plan.decode_tokens, metric.streams)
                    )
                    sample = await measured(server, peer, run)
                    pair[name] = sample
                    samples.append(
                        {"round": index + 1, "metric": metric.key, "server": name, **sample}
                    )
                log("  " + _pair_line(metric, pair))
    return samples


def _other(name: str) -> str:
    return SERVERS[1 - SERVERS.index(name)]


def _value(sample: dict[str, Any], unit: str) -> str:
    if "error" in sample:
        return "ERROR"
    return f"{sample['value']:.3f} s" if unit == "s" else f"{sample['value']:.1f} tok/s"


def _pair_line(metric: Metric, pair: dict[str, dict[str, Any]]) -> str:
    engine, vllm = pair["engine"], pair["vllm"]
    line = (
        f"{metric.key:10s} engine {_value(engine, metric.unit):>12s}   "
        f"vLLM {_value(vllm, metric.unit):>12s}"
    )
    if "error" not in engine and "error" not in vllm and vllm["value"] > 0:
        line += f"   engine/vLLM {engine['value'] / vllm['value']:.2f}"
    for name in SERVERS:
        if "error" in pair[name]:
            line += f"\n    {LABELS[name]}: {pair[name]['error']}"
    return line
