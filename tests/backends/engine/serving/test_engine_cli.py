"""`understudy engine` handed bad KV settings: a broken or hostile plan file, sizes that are not
numbers, a KV memory the engine cannot build.  Each is one line, ``Error: <role>.<field>:
<message>``, and exit status 2 (``openai_wire._config_error``), never a traceback; what the plan
file and the model's metadata tell is refused before the model loads."""

from __future__ import annotations

import json
import os
import signal
import socket
import threading
import time
import urllib.request
from pathlib import Path

import pytest
from click.testing import CliRunner, Result
from prometheus_client.parser import text_string_to_metric_families

from backends.engine import KVPlan, LlamaModel, engine_command
from backends.engine.kv._planner import block_bytes as encoded_block_bytes
from backends.engine.kv._store import DEFAULT_BLOCK_SIZE
from backends.engine.kv.codecs._codec import ROLES
from tests.fixtures_engine import serve_engine
from tests.utils import free_port

LAYERS = 30  # SmolLM2-135M's
FP8 = {"k": "fp8", "v": "fp8"}
ROUTER = ["--role", "router", "--prefill", "http://127.0.0.1:1", "--decode", "http://127.0.0.1:2"]


def _plan(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "plan.json"
    path.write_text(text)
    return path


def _refused(result: Result, problem: str) -> None:
    assert result.exit_code == 2, result.output
    assert result.stderr.splitlines() == [f"Error: {problem}"]
    assert result.exception is None or isinstance(result.exception, SystemExit)


@pytest.mark.usefixtures("no_model_load")
@pytest.mark.parametrize(
    ("text", "problem"),
    [
        ("[" * 100_000 + "]" * 100_000, "not a KV plan: nested too deeply"),
        ("{not json", "not a KV plan: Expecting property name enclosed in double quotes"),
        (
            json.dumps({"layers": [{"k": "int3", "v": "fp8"}] * LAYERS}),
            "not a KV plan: the engine does not serve KV codec 'int3'",
        ),
        (json.dumps({"layers": [FP8] * 29}), "a KV plan of 29 layers for a 30-layer model"),
        (
            json.dumps({"layers": [FP8] * LAYERS, "window_tokens": 17}),
            "window_tokens 17 is not a multiple of the engine's 16-token block",
        ),
        (
            json.dumps({"layers": [FP8] * LAYERS, "heavy_tokens": 16}),
            "heavy_tokens 16 is not below the engine's 16-token block",
        ),
        (
            json.dumps({"layers": [FP8] * LAYERS, "heavy_tokens": 10**30}),
            f"heavy_tokens {10**30} is not below the engine's 16-token block",
        ),
    ],
    ids=["nested", "not-json", "unknown-codec", "layers", "window", "heavy", "heavy-huge"],
)
def test_a_plan_the_engine_cannot_serve_is_one_line_before_the_model_loads(
    tmp_path: Path, text: str, problem: str
) -> None:
    path = _plan(tmp_path, text)
    result = CliRunner().invoke(engine_command, ["--port", "0", "--kv-plan", str(path)])
    assert result.exit_code == 2, result.output
    (line,) = result.stderr.splitlines()
    assert line.startswith(f"Error: unified.kv_plan: {path}: {problem}"), line


@pytest.mark.usefixtures("no_model_load")
@pytest.mark.timeout(60)
def test_a_plan_file_that_is_a_pipe_is_refused_not_waited_on(tmp_path: Path) -> None:
    """A named pipe passes click's exists/not-a-directory check; reading it blocked the engine's
    start until some writer came (forever, here)."""
    pipe = tmp_path / "plan.json"
    os.mkfifo(pipe)
    result = CliRunner().invoke(engine_command, ["--port", "0", "--kv-plan", str(pipe)])
    _refused(result, f"unified.kv_plan: {pipe}: not a KV plan: not a regular file")


@pytest.mark.usefixtures("no_model_load")
@pytest.mark.parametrize(
    ("args", "problem"),
    [
        (["--kv-gib", "nan"], "unified.kv_limit_bytes: --kv-gib is a finite number, got nan"),
        (["--kv-gib", "inf"], "unified.kv_limit_bytes: --kv-gib is a finite number, got inf"),
        (
            ["--role", "decode", "--kv-decoded-cache-mib", "nan"],
            "decode.kv_decoded_cache_bytes: --kv-decoded-cache-mib is a finite number, got nan",
        ),
        (
            ["--kv-codec", "fp32", "--kv-plan", "PLAN"],
            "unified: --kv-plan and --kv-codec are exclusive (a uniform plan is a codec)",
        ),
        # Taken before: the decode node wrote expires_in_s null, which the router reads as
        # nothing retained; a router with no timeout never asked a silent node's health.
        (
            ["--role", "decode", "--kv-retain-s", "inf"],
            "decode.kv_retain_s: Input should be a finite number",
        ),
        (
            [*ROUTER, "--node-read-timeout-s", "inf"],
            "router.node_read_timeout_s: Input should be a finite number",
        ),
    ],
    ids=[
        "kv-gib-nan",
        "kv-gib-inf",
        "decoded-cache-nan",
        "plan-and-default-codec",
        "retain-inf",
        "node-timeout-inf",
    ],
)
def test_kv_settings_that_mean_nothing_are_one_line(
    tmp_path: Path, args: list[str], problem: str
) -> None:
    plan = _plan(tmp_path, json.dumps({"layers": [FP8] * LAYERS}))
    args = [str(plan) if arg == "PLAN" else arg for arg in args]
    _refused(CliRunner().invoke(engine_command, ["--port", "0", *args]), problem)


@pytest.mark.parametrize(
    ("args", "block_bytes"),
    [
        (["--kv-gib", "0.001"], 737280),  # fp32: one 16-token block is 720 KiB
        # kivi-4's codes with a 512-token window of float16 rows held per running sequence
        (["--kv-plan", "WINDOWED", "--kv-gib", "0.01"], None),
    ],
    ids=["fp32", "windowed-plan"],
)
def test_a_kv_memory_the_engine_cannot_build_is_one_line(
    engine_model: LlamaModel,
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    args: list[str],
    block_bytes: int | None,
) -> None:
    """Only the engine knows what one block of its codec or plan costs besides what it reserves;
    it refuses before it listens, and that refusal is the setting's."""
    monkeypatch.setattr(LlamaModel, "load", lambda *_, **__: engine_model)
    windowed = {"layers": [{"k": "kivi-4", "v": "kivi-4"}] * LAYERS, "window_tokens": 512}
    plan = _plan(tmp_path, json.dumps(windowed))
    args = [str(plan) if arg == "WINDOWED" else arg for arg in args]
    result = CliRunner().invoke(engine_command, ["--port", "0", *args])
    assert result.exit_code == 2, result.output
    (line,) = result.stderr.splitlines()
    assert line.startswith("Error: unified.kv_limit_bytes: kv_limit_bytes="), line
    if block_bytes is not None:
        assert line.endswith(f"holds fewer than 2 blocks of {block_bytes} bytes"), line


def _metric(text: str, name: str) -> tuple[dict[str, str], float]:
    """The one sample of ``name`` in a Prometheus exposition: its labels and its value."""
    (family,) = (f for f in text_string_to_metric_families(text) if f.name == name)
    (sample,) = (s for s in family.samples if s.name == name)
    return sample.labels, sample.value


def _answer_scrape_then_stop(root: str, scraped: list[str], done: threading.Event) -> None:
    """Once the engine listens, one completion, then ``GET /metrics``, then SIGTERM this
    process: the engine's stop signal, whose handler is installed before it listens."""
    completion = urllib.request.Request(
        root + "/v1/completions",
        data=json.dumps({"prompt": "Hi", "max_tokens": 1}).encode(),
        headers={"Content-Type": "application/json"},
    )
    deadline = time.monotonic() + 120
    while not done.is_set() and time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(completion, timeout=60) as response:
                response.read()
        except OSError:
            time.sleep(0.1)
            continue
        try:
            with urllib.request.urlopen(root + "/metrics", timeout=10) as response:
                scraped.append(response.read().decode())
        finally:
            os.kill(os.getpid(), signal.SIGTERM)
        return


def test_the_engine_serves_the_plan_it_checked_and_names_it_in_its_metrics(
    engine_model: LlamaModel, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The --kv-plan file was read twice, once to check it and once to build the engine, with
    the model's load between: a plan rewritten meanwhile (plan-kv writing the next candidate's
    plan over it) was served instead of the one checked.  Now it is read once; /metrics says
    which codec, and which plan file, the engine serves, and so does the line it prints."""
    path = _plan(tmp_path, json.dumps({"layers": [FP8] * LAYERS}))
    port = free_port()
    scraped: list[str] = []
    done = threading.Event()

    def load(*_: object, **__: object) -> LlamaModel:
        KVPlan.uniform("kivi-2", LAYERS).dump(path)  # after the check, before the build
        threading.Thread(
            target=_answer_scrape_then_stop,
            args=(f"http://127.0.0.1:{port}", scraped, done),
            daemon=True,
        ).start()
        return engine_model

    monkeypatch.setattr(LlamaModel, "load", load)
    try:
        result = CliRunner().invoke(
            engine_command, ["--port", str(port), "--kv-gib", "0.125", "--kv-plan", str(path)]
        )
    finally:
        done.set()
    assert result.exit_code == 0, result.output
    (text,) = scraped
    fp8 = LAYERS * sum(
        encoded_block_bytes("fp8", role, 3, 64, DEFAULT_BLOCK_SIZE) for role in ROLES
    )
    assert _metric(text, "understudy_kv_bytes_per_token")[1] == fp8 / DEFAULT_BLOCK_SIZE
    labels, value = _metric(text, "understudy_engine_kv_codec_info")
    assert (labels["codec"], labels["plan"], value) == ("fp8", "plan.json", 1.0)
    assert "KV codec fp8" in result.stdout


@pytest.mark.parametrize(
    ("args", "problem"),
    [
        (
            ["--max-model-len", "9000"],
            "9000 is more than the model's context window (8192 tokens)",
        ),
        (
            ["--max-model-len", "4096", "--kv-gib", "0.02"],
            "4096 tokens is more than the KV pool holds: ",
        ),
    ],
    ids=["past-the-model", "past-the-pool"],
)
def test_a_context_window_the_engine_cannot_hold_is_refused_not_shrunk(
    engine_model: LlamaModel, monkeypatch: pytest.MonkeyPatch, args: list[str], problem: str
) -> None:
    """An explicit --max-model-len past the model's window or past what the KV pool holds was
    served silently shorter (the describe line's max_model_len), so a candidate refused the long
    prompts its primary served; vLLM refuses both at start.  Unset, the window is still the
    model's capped by the pool."""
    monkeypatch.setattr(LlamaModel, "load", lambda *_, **__: engine_model)
    port = free_port()
    done = threading.Event()
    # Were it served after all, the engine would wait for its stop signal: send it.
    threading.Thread(target=_stop_once_listening, args=(port, done), daemon=True).start()
    try:
        result = CliRunner().invoke(engine_command, ["--port", str(port), *args])
    finally:
        done.set()
    assert result.exit_code == 2, result.output
    (line,) = result.stderr.splitlines()
    assert line.startswith(f"Error: unified.max_model_len: {problem}"), line


def _stop_once_listening(port: int, done: threading.Event) -> None:
    """SIGTERM this process (the engine's stop signal) if the engine comes to listen."""
    deadline = time.monotonic() + 120
    while not done.is_set() and time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
        except OSError:
            time.sleep(0.1)
            continue
        os.kill(os.getpid(), signal.SIGTERM)
        return


async def test_a_context_window_the_engine_holds_is_served_as_asked(
    engine_model: LlamaModel,
) -> None:
    async with serve_engine(engine_model, max_model_len=1000) as asked, serve_engine(
        engine_model, kv_limit_bytes=20 << 20
    ) as capped:
        assert asked.max_model_len == 1000
        assert capped.max_model_len == capped.engine.pool.num_blocks * capped.engine.block_size
        assert capped.max_model_len < engine_model.max_model_len
