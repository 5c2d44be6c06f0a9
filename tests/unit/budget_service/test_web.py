"""The budget service's live page (`GET /`) in a real headless Chromium (Debian's package),
during a running pipeline: every category is shown, and its progress grows between two
reads; the run's time series (`GET /series`) it computes rates from (its Lua: test_telemetry)."""

from __future__ import annotations

import re
import shutil
import subprocess
import threading
from pathlib import Path

import pytest
import requests

from budget_service.server import Recorder, make_server
from sglang_sim.testing import SimServer
from testing.harness import started, wait_until
from tests.faults.common import two_category_config
from tests.helpers import serve_in_thread

CHROMIUM = next((b for b in ("chromium", "chromium-browser", "google-chrome")
                 if shutil.which(b)), None)
CATEGORY_RE = re.compile(r'data-category="([^"]+)"\s+data-used="(\d+)"')


def _chromium(*args: str) -> str:
    assert CHROMIUM is not None
    done = subprocess.run([CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu",
                           "--no-first-run", "--disable-dev-shm-usage", *args],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


def _page(url: str) -> tuple[dict[str, int], str]:
    """What the page shows once its script has run: category -> used, and the page."""
    dom = _chromium("--virtual-time-budget=4000", "--dump-dom", url)
    return {name: int(used) for name, used in CATEGORY_RE.findall(dom)}, dom


@pytest.mark.skipif(CHROMIUM is None, reason="no Chromium (Debian: apt install chromium)")
def test_the_live_page_shows_every_category_and_its_progress(tmp_path, redis_url) -> None:
    cfg = two_category_config(tmp_path, cap_a=40_000, cap_b=30_000)
    with SimServer(time_scale=20.0) as sim, started(cfg, redis_url, [sim.url], 4) as pipe:
        server = make_server(pipe.budget, port=0)
        serve_in_thread(server)
        recorder = Recorder(pipe.budget, 0.2)
        recorder.start()
        url = f"http://127.0.0.1:{server.server_address[1]}/"
        stop = threading.Event()
        run = threading.Thread(target=pipe.run, kwargs={"should_stop": stop.is_set},
                               daemon=True)
        run.start()
        try:
            wait_until(lambda: pipe.budget.telemetry.status()["categories"]["a"]["used"] > 0,
                       what="a first commit")
            first, _ = _page(url)
            seen = first["a"] + first["b"]
            wait_until(lambda: sum(c["used"] for c in pipe.budget.telemetry.status()[
                "categories"].values()) > seen, what="more tokens")
            second, _ = _page(url)
            # an engine the producer's watch found away shows with since when
            pipe.budget.telemetry.record_engine_trouble("http://gpu-7:30000",
                                                        "connection refused", 1_700_000_000_000)
            _, dom = _page(url)
            st = pipe.budget.telemetry.status(by_engine=True)["categories"]
            shot = tmp_path / "page.png"
            _chromium("--window-size=1000,700", "--virtual-time-budget=4000",
                      f"--screenshot={shot}", url)
            page = requests.get(url, timeout=10)
            series = requests.get(url + "series?count=5", timeout=10).json()
        finally:
            stop.set()
            run.join(60)
            recorder.stop()
            server.shutdown()
            server.server_close()
    assert set(first) == set(second) == {"a", "b"}
    assert second["a"] + second["b"] > first["a"] + first["b"]
    # the prefix cache: per category, and per engine over the categories
    assert st["a"]["prompt_tokens"] > 0 and 'class="cache">prefix cache' in dom
    assert f"{sim.url} · " in dom and " prompt tokens (" in dom
    assert re.search(r"<div>http://gpu-7:30000 [^<]*<b>\?</b>[^<]*<b class=\"down\">does not "
                     r"answer: connection refused, since [^<]+ s ago\)</b></div>", dom), \
        dom[dom.find('id="engines"'):][:1500]
    assert shot.stat().st_size > 10_000 and shot.read_bytes()[:4] == b"\x89PNG"
    # served from the package, with no external asset
    assert page.headers["Content-Type"].startswith("text/html")
    assert not re.search(r'(src|href)="(https?:)?//', page.text)
    assert 1 <= len(series) <= 5 and set(series[-1]["categories"]) == {"a", "b"}


def test_the_page_is_the_packaged_file() -> None:
    from budget_service import server

    assert server.PAGE.is_file() and server.PAGE.parent == Path(server.__file__).parent / "web"


@pytest.mark.skipif(CHROMIUM is None, reason="no Chromium (Debian: apt install chromium)")
def test_the_live_page_shows_each_mode_against_its_weight(redis) -> None:
    from tests.helpers import modes_budget

    server = make_server(modes_budget(redis, "web"), port=0)
    serve_in_thread(server)
    try:
        _, dom = _page(f"http://127.0.0.1:{server.server_address[1]}/")
    finally:
        server.shutdown()
        server.server_close()
    assert '<div class="facts" data-modes="conv"><span><b>conv</b></span>' in dom
    assert ('<span data-mode="think" data-rows="2" data-tokens="60">think: 2 rows (66.7%), '
            "60 tok (60.0%), weight 75.0%</span>") in dom
    assert 'data-modes="tok"' in dom
