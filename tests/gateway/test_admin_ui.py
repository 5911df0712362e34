"""The scorecard page at /admin/ui, in Debian's headless Chromium against a running gateway.

A real gateway (evaluation on, SQLite) in front of simulators plays the primary, a noise-floor
replica, a slower candidate that answers differently, and a paused candidate whose drops are
counted. Chromium loads the page with the token in the URL's fragment, runs its script
(``--virtual-time-budget`` lets its fetches finish before the DOM is dumped or the screenshot
taken), and the dumped DOM and the screenshot are checked.
"""

from __future__ import annotations

import asyncio
import re
import shutil
import uuid
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
import openai
import pytest
from PIL import Image, ImageStat

from gateway._scorecard import CDF_POINTS, HISTOGRAM_BINS, SCORECARD_PATH, scorecard_files
from tests.utils import RunningGateway, eventually, run_gateway, run_sim

TOKEN = "scorecard-admin-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
INSTALL_HINT = ("Debian's headless chromium is needed for the scorecard page's tests: "
                "apt-get install -y chromium (scripts/setup-browser.sh does it; scripts/test.sh "
                "runs it)")
CHROMIUM_TIMEOUT_S = 90.0
VIRTUAL_TIME_BUDGET_MS = 20_000
WINDOW = (1280, 3200)
PRIMARY_BLUE = (0x1F, 0x6F, 0xEB)
CANDIDATE_ORANGE = (0xE8, 0x59, 0x0C)

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]


def _chromium() -> str:
    found = shutil.which("chromium") or shutil.which("chromium-browser")
    if found is None:
        pytest.fail(INSTALL_HINT)
    return found


async def _browse(url: str, tmp_path: Path, *args: str) -> str:
    """Run headless Chromium on ``url`` with ``args``; its stdout (the DOM with --dump-dom)."""
    profile = tmp_path / f"profile-{uuid.uuid4().hex}"
    process = await asyncio.create_subprocess_exec(
        _chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
        "--no-first-run", "--no-default-browser-check", "--disable-extensions",
        "--disable-background-networking", "--disable-sync", "--hide-scrollbars",
        "--mute-audio", f"--user-data-dir={profile}",
        f"--virtual-time-budget={VIRTUAL_TIME_BUDGET_MS}", *args, url,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    try:
        async with asyncio.timeout(CHROMIUM_TIMEOUT_S):
            out, err = await process.communicate()
    except TimeoutError:
        process.kill()
        await process.wait()
        raise
    assert process.returncode == 0, err.decode(errors="replace")[-2000:]
    return out.decode()


def _page(gw: RunningGateway, token: str | None = None) -> str:
    root = gw.admin_url.removesuffix("/admin/v1")
    return root + SCORECARD_PATH + (f"#token={token}" if token is not None else "")


def _plots(dom: str, kind: str) -> list[int]:
    """The data-points of each <svg> plot of ``kind`` in the dumped DOM."""
    found = []
    for tag in re.findall(r"<svg\b[^>]*>", dom):
        if f'data-kind="{kind}"' in tag:
            points = re.search(r'data-points="(\d+)"', tag)
            found.append(int(points.group(1)) if points else 0)
    return found


def _section(dom: str, candidate: str) -> str:
    """The dumped DOM of ``candidate``'s detail section."""
    start = dom.index(f'<section class="candidate" data-candidate="{candidate}">')
    end = dom.find("</section>", start)
    return dom[start:end]


def _body_state(dom: str) -> str:
    match = re.search(r'<body[^>]*data-state="([a-z]+)"', dom)
    assert match is not None, dom[:2000]
    return match.group(1)


async def _traffic(gw: RunningGateway, n: int) -> None:
    client = openai.AsyncOpenAI(base_url=gw.base_url, api_key="x", max_retries=0)
    try:
        for i in range(n):
            stream = await client.chat.completions.create(
                model="sim-model", stream=True,
                messages=[{"role": "user", "content": f"question {i}: " + "words " * (i % 7)}])
            async for _ in stream:
                pass
    finally:
        await client.close()


async def _get(http: aiohttp.ClientSession, url: str, **kwargs: Any) -> tuple[int, Any]:
    async with http.get(url, **kwargs) as resp:
        return resp.status, await resp.json()


def _colour_pixels(image: Image.Image, colour: tuple[int, int, int], tolerance: int = 24) -> int:
    pixels = np.asarray(image.convert("RGB"), dtype=np.int32)
    return int((np.abs(pixels - np.array(colour)) <= tolerance).all(axis=-1).sum())


async def test_the_scorecard_draws_its_plots_from_a_running_gateway(tmp_path: Path) -> None:
    _chromium()  # fail before the servers start when the browser is missing
    db = f"sqlite+aiosqlite:///{tmp_path / 'ui.db'}"
    evaluation = {"enabled": True, "store": {"url": db, "flush_interval_s": 0.05}}
    async with run_sim(ttft_ms=2, itl_ms=1, tokens=8) as primary, \
            run_sim(ttft_ms=2, itl_ms=1, tokens=8) as replica, \
            run_sim(ttft_ms=15, itl_ms=3, tokens=8, variant="other") as slower, \
            run_gateway(primary.url, admin={"token": TOKEN}, evaluation=evaluation,
                        candidates=[{"name": "floor", "url": replica.url, "role": "secondary"},
                                    {"name": "slower", "url": slower.url},
                                    {"name": "idle", "url": slower.url}]) as gw, \
            aiohttp.ClientSession(headers=AUTH) as http:
        async with http.post(gw.admin_url + "/candidates/idle/pause") as resp:
            assert resp.status == 200
        await _traffic(gw, 16)
        await eventually(lambda: gw.written_records >= 32, within_s=60)
        async with http.post(gw.admin_url + "/candidates/slower/canary",
                             json={"steps": [5, 50, 100], "interval_s": 3600}) as resp:
            assert resp.status == 202, await resp.text()

        # The data endpoints the plots are drawn from: bounded, binned, with the floor.
        status, dist = await _get(http, gw.admin_url + "/candidates/slower/distributions")
        assert status == 200 and dist["secondary"] == "floor"
        ttft = next(d for d in dist["latency"] if d["metric"] == "latency.ttft_s")
        assert len(ttft["quantiles"]) == CDF_POINTS
        assert len(ttft["candidate"]) == len(ttft["primary"]) == len(ttft["floor"]) == CDF_POINTS
        assert ttft["candidate"][CDF_POINTS // 2] > ttft["primary"][CDF_POINTS // 2]
        edit = next(q for q in dist["quality"] if q["metric"] == "quality.edit_similarity")
        assert len(edit["edges"]) == HISTOGRAM_BINS + 1 and sum(edit["candidate"]) >= 8
        assert edit["floor_mean"] > edit["candidate_mean"]  # the replica answers as the primary
        status, traffic = await _get(http, gw.admin_url + "/traffic")
        assert status == 200 and sum(traffic["seen"]) >= 16
        assert any(d["candidate"] == "idle" and d["reason"] == "paused" and sum(d["counts"]) >= 16
                   for d in traffic["drops"])

        dom = await _browse(_page(gw, TOKEN), tmp_path, "--dump-dom")
        assert _body_state(dom) == "ready", re.findall(r'<p id="message"[^>]*>[^<]*', dom)
        slower_section = _section(dom, "slower")
        cdfs, histograms = _plots(slower_section, "cdf"), _plots(slower_section, "histogram")
        # TTFT, ITL mean and p99, e2e: primary, candidate and floor, each CDF_POINTS quantiles.
        assert cdfs == [3 * CDF_POINTS] * 4, cdfs
        assert slower_section.count("<polyline") == 3 * 4
        assert histograms and all(n >= 2 for n in histograms), histograms
        assert _plots(_section(dom, "floor"), "cdf") == [2 * CDF_POINTS] * 4  # no floor of its own
        assert not _plots(_section(dom, "idle"), "cdf")  # paused throughout: nothing to draw
        assert "No latency scores stored yet" in _section(dom, "idle")
        assert _plots(dom, "drops") and _plots(dom, "drops")[0] >= 2
        assert _plots(dom, "canary") == [3]
        assert re.search(r'<tr data-candidate="slower">.*?class="verdict verdict-[A-Z]+"', dom,
                         re.S)
        assert "idle: paused" in dom
        assert TOKEN not in dom  # taken from the fragment, kept out of the page

        shot = tmp_path / "scorecard.png"
        await _browse(_page(gw, TOKEN), tmp_path, f"--screenshot={shot}",
                      f"--window-size={WINDOW[0]},{WINDOW[1]}")
        image = Image.open(shot)
        assert image.size == WINDOW
        assert max(ImageStat.Stat(image.convert("L")).stddev) > 10, "a blank screenshot"
        small = image.resize((WINDOW[0] // 2, WINDOW[1] // 2), Image.Resampling.NEAREST)
        assert _colour_pixels(small, PRIMARY_BLUE) > 100, "no primary series drawn"
        assert _colour_pixels(small, CANDIDATE_ORANGE) > 100, "no candidate series drawn"


async def test_a_wrong_or_missing_token_shows_a_clear_message(tmp_path: Path) -> None:
    _chromium()
    async with run_sim() as sim, \
            run_gateway(sim.url, admin={"token": TOKEN},
                        candidates=[{"name": "secret-candidate", "url": sim.url}]) as gw, \
            aiohttp.ClientSession() as http:
        # The shell is served without the token and holds no data; its data is behind it.
        async with http.get(_page(gw)) as resp:
            assert resp.status == 200 and resp.content_type == "text/html"
            assert "script-src 'self'" in resp.headers["Content-Security-Policy"]
            assert "secret-candidate" not in await resp.text()
        for path in ("/traffic", "/candidates/secret-candidate/distributions"):
            status, body = await _get(http, gw.admin_url + path)
            assert status == 401 and body["error"]["type"] == "authentication_error"

        dom = await _browse(_page(gw, "not-the-admin-token"), tmp_path, "--dump-dom")
        assert _body_state(dom) == "unauthorized"
        assert "The admin API refused this token (401" in dom
        assert "secret-candidate" not in dom and not _plots(dom, "cdf")

        dom = await _browse(_page(gw), tmp_path, "--dump-dom")
        assert _body_state(dom) == "unauthorized"
        assert "needs a token (401)" in dom


async def test_without_evaluation_the_page_says_so_and_still_shows_routing(
    tmp_path: Path,
) -> None:
    async with run_sim() as sim, \
            run_gateway(sim.url, admin={"token": TOKEN},
                        candidates=[{"name": "c", "url": sim.url}]) as gw, \
            aiohttp.ClientSession(headers=AUTH) as http:
        for path in ("/traffic", "/candidates/c/distributions"):
            status, body = await _get(http, gw.admin_url + path)
            assert status == 409 and "evaluation is disabled" in body["error"]["message"]
        status, body = await _get(http, gw.admin_url + "/traffic?window_s=-1")
        assert status == 422
        dom = await _browse(_page(gw, TOKEN), tmp_path, "--dump-dom")
        assert _body_state(dom) == "ready"
        assert "evaluation is disabled" in dom and 'id="no-canary"' in dom


async def test_markup_in_what_others_name_is_shown_as_text(tmp_path: Path) -> None:
    """A candidate's URL is admin API input and may hold markup (a path or query with ``<``,
    quotes); the page shows it, in the table, as text: no element, no attribute made of it."""
    _chromium()
    markup = "<img/src=x/onerror=document.body.dataset.pwned=1>\"'><b/id=injected>b</b>"
    async with run_sim() as sim, \
            run_gateway(sim.url, admin={"token": TOKEN}) as gw, \
            aiohttp.ClientSession(headers=AUTH) as http:
        async with http.post(gw.admin_url + "/candidates",
                             json={"name": "marked", "url": f"{sim.url}/{markup}"}) as resp:
            assert resp.status == 201, await resp.text()
        dom = await _browse(_page(gw, TOKEN), tmp_path, "--dump-dom")
        assert _body_state(dom) == "ready"
        assert "<img" not in dom and 'id="injected"' not in dom and "pwned" not in dom.split(
            "<body", 1)[1].split(">", 1)[0]
        assert "&lt;img/src=x/onerror=" in dom  # there, as text


class _FormFields(HTMLParser):
    """The names of the controls a form would send when submitted without the script."""

    def __init__(self) -> None:
        super().__init__()
        self.in_form = False
        self.forms: list[dict[str, Any]] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        attributes = dict(attrs)
        if tag == "form":
            self.in_form = True
            self.forms.append({"method": (attributes.get("method") or "get").lower(),
                               "names": []})
        elif self.in_form and tag in ("input", "select", "textarea") \
                and attributes.get("name"):
            self.forms[-1]["names"].append(attributes["name"])

    def handle_endtag(self, tag: str) -> None:
        if tag == "form":
            self.in_form = False


def test_the_token_form_sent_without_its_script_puts_no_token_in_the_url() -> None:
    """The token field had a name and the form no method: submitted before the deferred
    script had taken over (Enter pressed while it loads, a script blocked or failing),
    the browser sent ``GET /admin/ui?token=...``, the token in the history and in any
    access log on the way (the fragment the README promises never does that)."""
    parser = _FormFields()
    parser.feed(scorecard_files()[SCORECARD_PATH][0].decode())
    assert parser.forms, "no form on the page"
    for form in parser.forms:
        assert form["method"] != "get" or form["names"] == [], form
