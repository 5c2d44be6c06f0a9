"""The budget service: status JSON, Prometheus metrics, and the token-guarded cap change."""

from __future__ import annotations

import json
import shutil
import subprocess

import pytest
import requests

from budget_service.budget import Budget
from budget_service.keys import Keys
from budget_service.server import DEFAULT_HOST, make_server
from budget_service.telemetry import render_metrics
from tests.helpers import feed, make_cfg, result, serve_in_thread

TOKEN = "t0ken-for-tests"


@pytest.fixture
def service(redis):
    budget = Budget(redis, Keys("tokencap", "t"))
    budget.feeding.init_run(make_cfg(cats=("code", "math")))
    feed(budget, "a")
    budget.samples.admit("code", "a", 50, 30_000)
    budget.samples.commit(result("a", 123), 0, 0.0)
    server = make_server(budget, port=0, token=TOKEN)
    serve_in_thread(server)
    yield budget, f"http://127.0.0.1:{server.server_address[1]}", server
    server.shutdown()
    server.server_close()


def test_binds_loopback_by_default(service) -> None:
    _budget, _url, server = service
    assert DEFAULT_HOST == "127.0.0.1"
    assert server.server_address[0] == "127.0.0.1"


def test_status_is_the_cli_document(service) -> None:
    budget, url, _ = service
    body = requests.get(f"{url}/status", timeout=5).json()
    assert body == json.loads(json.dumps(budget.telemetry.status(by_engine=True)))
    assert body["categories"]["code"]["used"] == 123


def test_metrics_parse_with_prometheus_client(service) -> None:
    parser = pytest.importorskip("prometheus_client.parser")
    budget, url, _ = service
    text = requests.get(f"{url}/metrics", timeout=5).text
    used = {s.labels["category"]: s.value
            for fam in parser.text_string_to_metric_families(text)
            for s in fam.samples if s.name == "tokencap_used_tokens"}
    assert used == {c: st["used"] for c, st in budget.telemetry.status()["categories"].items()}


def test_cap_change_needs_the_token(service) -> None:
    budget, url, _ = service
    body = {"category": "code", "cap_tokens": 50}
    assert requests.post(f"{url}/cap", json=body, timeout=5).status_code == 401
    bad = {"Authorization": "Bearer nope"}
    assert requests.post(f"{url}/cap", json=body, headers=bad, timeout=5).status_code == 401
    assert budget.telemetry.status()["categories"]["code"]["cap"] == 1000
    ok = requests.post(f"{url}/cap", json=body, timeout=5,
                       headers={"Authorization": f"Bearer {TOKEN}"})
    assert ok.status_code == 200 and ok.json()["closed"] is True
    assert budget.telemetry.status()["categories"]["code"]["state"] == "closed"


def test_no_token_configured_refuses_every_change(redis) -> None:
    budget = Budget(redis, Keys("tokencap", "t"))
    budget.feeding.init_run(make_cfg())
    server = make_server(budget, port=0, token=None)
    serve_in_thread(server)
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        r = requests.post(f"{url}/cap", json={"category": "code", "cap_tokens": 1}, timeout=5,
                          headers={"Authorization": "Bearer "})
        assert r.status_code == 401
    finally:
        server.shutdown()
        server.server_close()


def _page(budget: Budget) -> str:
    budget.samples.add_engine_counts({
        'http://gpu-a:30000/"quoted"\\path|requests|ok': 2,
        "http://gpu-b:30000|requests|timeout": 1,
        "http://gpu-b:30000|latency_le|1": 1, "http://gpu-b:30000|latency_le|inf": 1,
        "http://gpu-b:30000|latency_sum_ms": 800, "http://gpu-b:30000|gate_waits": 3,
    })
    return render_metrics(budget.telemetry).decode()


def test_metrics_follow_prometheus_naming(service) -> None:
    budget, _url, _ = service
    from prometheus_client.parser import text_string_to_metric_families

    families = list(text_string_to_metric_families(_page(budget)))
    assert families
    for fam in families:
        assert fam.name.startswith("tokencap_"), fam.name
        if fam.type == "counter":
            assert all(s.name == fam.name + "_total" for s in fam.samples), fam.name
        if fam.name.endswith(("_tokens", "_seconds")) or "_tokens_" in fam.name:
            assert fam.type in ("gauge", "counter", "histogram")
        for s in fam.samples:
            assert s.labels.get("run") == "t", (s.name, s.labels)
    engines = {s.labels["engine"] for fam in families for s in fam.samples
               if "engine" in s.labels}
    assert 'http://gpu-a:30000/"quoted"\\path' in engines  # escaped on the page, read back whole


def test_metrics_pass_promtool(service) -> None:
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool not installed (Debian package prometheus; .ci/run installs it)")
    budget, _url, _ = service
    out = subprocess.run([promtool, "check", "metrics"], input=_page(budget),
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and not out.stdout.strip() and not out.stderr.strip(), \
        out.stdout + out.stderr


def test_a_cap_of_none_uncaps_and_leaves_no_cap_series(service) -> None:
    parser = pytest.importorskip("prometheus_client.parser")
    budget, url, _ = service
    auth = {"Authorization": f"Bearer {TOKEN}"}
    r = requests.post(f"{url}/cap", json={"category": "math", "cap_tokens": "none"},
                      headers=auth, timeout=5)
    assert r.status_code == 200 and r.json()["cap"] is None
    assert budget.telemetry.status()["categories"]["math"]["cap"] is None
    bad = requests.post(f"{url}/cap", json={"category": "math", "cap_tokens": "lots"},
                        headers=auth, timeout=5)
    assert bad.status_code == 400
    page = render_metrics(budget.telemetry).decode()
    caps = {s.labels["category"]: s.value
            for fam in parser.text_string_to_metric_families(page)
            for s in fam.samples if s.name == "tokencap_cap_tokens"}
    assert caps == {"code": 1000}  # an uncapped category has no cap series
