"""The demo behind scripts/demo.sh: simulator + gateway, a few requests, a summary."""

from __future__ import annotations

import argparse
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import openai

ROOT = Path(__file__).resolve().parent.parent
CONFIG = ROOT / "examples" / "understudy.toml"
UNDERSTUDY = [sys.executable, "-m", "gateway.cli"]


def wait_healthy(url: str, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url, timeout=1) as resp:
                if resp.status == 200:
                    return
        except OSError:
            time.sleep(0.1)
    raise SystemExit(f"demo: {url} did not become healthy in {timeout:.0f}s")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--once", action="store_true", help="stop after the demo requests")
    args = parser.parse_args()
    procs = [
        subprocess.Popen([*UNDERSTUDY, "sim", "--port", "8100", "--ttft-ms", "40",
                          "--itl-ms", "10", "--tokens", "24", "--cached-tokens", "16"]),
        subprocess.Popen([*UNDERSTUDY, "serve", "--config", str(CONFIG)]),
    ]
    try:
        wait_healthy("http://127.0.0.1:8100/health")
        wait_healthy("http://127.0.0.1:8080/health")
        client = openai.OpenAI(base_url="http://127.0.0.1:8080/v1", api_key="demo")
        messages = [{"role": "user", "content": "What does an understudy do?"}]
        answer = client.chat.completions.create(model="sim-model", messages=messages)
        print("non-streamed answer:", answer.choices[0].message.content)
        print("usage:", answer.usage)
        print("streamed answer: ", end="", flush=True)
        for chunk in client.chat.completions.create(model="sim-model", messages=messages,
                                                    stream=True):
            if chunk.choices and chunk.choices[0].delta.content:
                print(chunk.choices[0].delta.content, end="", flush=True)
        print()
        with urllib.request.urlopen("http://127.0.0.1:8080/metrics") as resp:
            shown = ("understudy_requests_total", "understudy_primary_ttft_seconds_sum")
            lines = [ln for ln in resp.read().decode().splitlines() if ln.startswith(shown)]
        print("gateway metrics:\n  " + "\n  ".join(lines))
        if not args.once:
            print("gateway: http://127.0.0.1:8080/v1  (primary: simulator on :8100). Ctrl-C stops.")
            signal.signal(signal.SIGTERM, signal.default_int_handler)
            try:
                while True:
                    time.sleep(3600)
            except KeyboardInterrupt:
                pass
    finally:
        for proc in procs:
            proc.send_signal(signal.SIGTERM)
        for proc in procs:
            try:
                proc.wait(timeout=35)
            except subprocess.TimeoutExpired:
                proc.kill()


if __name__ == "__main__":
    main()
