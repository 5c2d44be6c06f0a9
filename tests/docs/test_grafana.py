"""docker/grafana/tokencap.json: valid, every panel queries Prometheus, every metric exists."""

from __future__ import annotations

import json
import re
from typing import Any

import pytest
import requests

from budget_service.budget import Budget
from budget_service.keys import Keys
from budget_service.telemetry import CATEGORY_GAUGES, render_metrics
from sglang_sim.testing import SimServer
from tests.conftest import ROOT
from tests.helpers import make_cfg

DASHBOARD = ROOT / "docker" / "grafana" / "tokencap.json"
DS_UID = "${DS_PROMETHEUS}"
TIMEOUT_S = 30.0
# Metric names in PromQL (Prometheus allows digits after the first character).
METRIC_RE = re.compile(r"(?:tokencap_|sglang:)[a-zA-Z0-9_:]*")
# The name at the start of a sample line of the exposition format.
EXPOSED_RE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)", re.MULTILINE)


@pytest.fixture(scope="module")
def dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text())


def all_panels(dash: dict[str, Any]) -> list[dict[str, Any]]:
    """Top-level panels and those nested in collapsed rows."""
    out = []
    for p in dash["panels"]:
        out.append(p)
        out.extend(p.get("panels", []))
    return out


def expressions(dash: dict[str, Any]) -> list[str]:
    return [t["expr"] for p in all_panels(dash) for t in p["targets"]]


def exposed_names(text: str) -> set[str]:
    return {m for m in EXPOSED_RE.findall(text) if not m.startswith("#")}


def test_dashboard_is_a_grafana_dashboard(dashboard: dict[str, Any]) -> None:
    assert dashboard["schemaVersion"] >= 36 and dashboard["title"] and dashboard["uid"]
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    ds = variables["DS_PROMETHEUS"]
    assert (ds["type"], ds["query"]) == ("datasource", "prometheus")
    ids = [p["id"] for p in all_panels(dashboard)]
    assert len(ids) == len(set(ids)), "panel ids must be unique"


def test_every_panel_has_a_datasource_and_a_target(dashboard: dict[str, Any]) -> None:
    panels = all_panels(dashboard)
    assert len(panels) >= 10
    for p in panels:
        assert p["datasource"] == {"type": "prometheus", "uid": DS_UID}, p["title"]
        assert p["targets"], f"{p['title']}: no target"
        for t in p["targets"]:
            assert t["expr"].strip() and t["refId"], p["title"]
            assert t.get("datasource", p["datasource"])["uid"] == DS_UID, p["title"]
        grid = p["gridPos"]
        assert grid["w"] > 0 and grid["h"] > 0 and grid["x"] + grid["w"] <= 24, p["title"]


def test_dashboard_covers_the_budget_and_the_engines(dashboard: dict[str, Any]) -> None:
    used = {m for e in expressions(dashboard) for m in METRIC_RE.findall(e)}
    wanted = {"tokencap_used_tokens", "tokencap_cap_tokens", "tokencap_samples_total",
              "tokencap_reserved_tokens", "tokencap_samples_in_flight",
              "tokencap_overshoot_tokens", "tokencap_category_open",
              "tokencap_engine_requests_total", "sglang:num_running_reqs",
              "sglang:num_queue_reqs", "sglang:token_usage", "sglang:gen_throughput"}
    assert wanted <= used, sorted(wanted - used)
    # tok/s from a gauge: deriv (rate is for counters only)
    assert any("deriv(tokencap_used_tokens" in e and "[1m]" in e for e in expressions(dashboard))
    rated = {m for e in expressions(dashboard) for m in re.findall(r"rate\((tokencap_\w+)", e)}
    assert rated and all(m.endswith(("_total", "_bucket")) for m in rated), rated


def test_every_metric_name_is_exported(dashboard: dict[str, Any], redis) -> None:
    """tokencap_* against the budget service's page for a real run; sglang:* against the
    simulator's page."""
    budget = Budget(redis, Keys("tokencap", "t"))
    budget.feeding.init_run(make_cfg(cats=("code", "math")))
    budget.samples.add_engine_counts({"http://e|requests|ok": 1, "http://e|latency_le|1": 1,
                              "http://e|latency_le|inf": 1, "http://e|latency_sum_ms": 300})
    tokencap_page = render_metrics(budget.telemetry).decode()
    with SimServer(time_scale=100) as sim:
        sglang_page = requests.get(f"{sim.url}/metrics", timeout=TIMEOUT_S).text
    exposed = exposed_names(tokencap_page) | exposed_names(sglang_page)
    assert {metric for _, metric, _ in CATEGORY_GAUGES} <= exposed  # the parser sees the page

    used = {m for e in expressions(dashboard) for m in METRIC_RE.findall(e)}
    assert used, "no metric names found in the dashboard"
    assert sorted(used - exposed) == []
