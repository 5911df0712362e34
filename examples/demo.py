"""The demo behind scripts/demo.sh: the whole loop on one machine, no external server.

Three simulators play the primary (port 8100), a faster candidate "fast" (8101) and a
second replica of the primary "replica" (8102, the noise floor); the gateway
(examples/understudy.toml) fronts them, mirrors traffic, scores it into SQLite
(understudy.db) and the judge's report is printed.
"""

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
SIMS = {  # port: (TTFT ms, inter-token ms) -- the candidate answers alike, only faster
    8100: (60, 12),
    8101: (30, 8),
    8102: (60, 12),
}


def wait_healthy(url: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url, timeout=1) as resp:
                if resp.status == 200:
                    return
        except OSError:
            time.sleep(0.2)
    raise SystemExit(f"demo: {url} did not become healthy in {timeout:.0f}s")


def traffic(client: openai.OpenAI, sessions: int, turns: int) -> None:
    for session in range(sessions):
        history = [{"role": "system", "content": "You are a concise assistant."}]
        for turn in range(turns):
            history.append({"role": "user", "content": f"Session {session}, question {turn}."})
            pieces = []
            for chunk in client.chat.completions.create(
                    model="sim-model", messages=history, stream=True,
                    extra_headers={"X-Session-Id": f"demo-{session}"}):
                if chunk.choices and chunk.choices[0].delta.content:
                    pieces.append(chunk.choices[0].delta.content)
            history.append({"role": "assistant", "content": "".join(pieces)})
        print(f"  session {session}: {turns} turns, last answer: {''.join(pieces)[:60]}...")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--once", action="store_true", help="stop after the report")
    args = parser.parse_args()
    procs = [subprocess.Popen([*UNDERSTUDY, "--log-level", "WARNING", "sim", "--port", str(port),
                               "--ttft-ms", str(ttft), "--itl-ms", str(itl), "--tokens", "24"])
             for port, (ttft, itl) in SIMS.items()]
    procs.append(subprocess.Popen([*UNDERSTUDY, "--log-level", "WARNING", "serve",
                                   "--config", str(CONFIG)]))
    try:
        for port in (*SIMS, 8080):
            wait_healthy(f"http://127.0.0.1:{port}/health")
        client = openai.OpenAI(base_url="http://127.0.0.1:8080/v1", api_key="demo")
        print("demo: 40 streamed requests (8 sessions x 5 turns) through the gateway")
        traffic(client, sessions=8, turns=5)
        time.sleep(2)  # let the last candidate answers be joined, scored and written
        print("\ndemo: the judge on candidate 'fast' (understudy report fast --config ...):")
        subprocess.run([*UNDERSTUDY, "report", "fast", "--config", str(CONFIG)], check=True)
        with urllib.request.urlopen("http://127.0.0.1:8080/metrics") as resp:
            shown = ("understudy_requests_total", "understudy_mirror_joined_total",
                     "understudy_memory_budget_used_bytes", "understudy_store_written_rows")
            lines = [ln for ln in resp.read().decode().splitlines() if ln.startswith(shown)]
        print("gateway metrics:\n  " + "\n  ".join(lines))
        if not args.once:
            print("\ngateway: http://127.0.0.1:8080/v1   admin: http://127.0.0.1:8081/admin/v1"
                  "   (Ctrl-C stops)")
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
