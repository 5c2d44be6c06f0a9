"""HTTP face of the budget: `GET /` (a live page of the run: `web/index.html`, no external
asset), `GET /status` (JSON), `GET /series?after=ID&count=N` (the run's time series, JSON),
`GET /metrics` (Prometheus text, made by `prometheus_client`), `POST /cap` (change a cap
while the run goes on; needs the bearer token).

With `record_s`, a recorder thread appends a point of the run's time series every `record_s`
seconds (`TelemetryLedger.record_point`, the last 8,640 kept): per category used, samples, cap and
state; per engine running and queued requests (its `/v1/loads` or `/metrics`); workers;
results not yet written. The page's rates and ETAs, and the report's charts, come from it.

Binds 127.0.0.1 unless told otherwise. Without a token configured, state-changing calls
are refused outright.

Metrics (every series has a `run` label; per category also `category`):

| metric | type | meaning |
|---|---|---|
| `tokencap_cap_tokens` | gauge | the category's cap (no series while it is uncapped) |
| `tokencap_used_tokens` | gauge | tokens counted against the cap (corrections may lower it) |
| `tokencap_reserved_tokens` | gauge | tokens reserved by samples in flight |
| `tokencap_overshoot_tokens` | gauge | used past the cap |
| `tokencap_samples_pending` | gauge | fed and not final |
| `tokencap_samples_in_flight` | gauge | being generated |
| `tokencap_samples_parked` | gauge | waiting until they fit the budget |
| `tokencap_samples_held` | gauge | held back by the closed category (a raised cap sends them) |
| `tokencap_conversations_waiting` | gauge | conversations whose next turn waits to be fed |
| `tokencap_results_unwritten` | gauge | results and dead letters not yet on disk |
| `tokencap_category_open` | gauge | 1 while the category is fed |
| `tokencap_samples_total{outcome}` | counter | committed, failed, rejected |
| `tokencap_waste_tokens_total` | counter | tokens of outputs cut at max_new_tokens |
| `tokencap_failure_reasons_total{reason}` | counter | rejected and dead samples by reason |
| `tokencap_out_of_vocab_samples_total` | counter | samples with ids past the vocabulary |
| `tokencap_prompt_tokens_total{engine}` | counter | prompt tokens of committed samples |
| `tokencap_cached_tokens_total{engine}` | counter | of them, from the engine's prefix cache |
| `tokencap_reusable_tokens_total{engine}` | counter | of them, shared with the turn before |
| `tokencap_engine_requests_total{engine,outcome}` | counter | requests the workers sent |
| `tokencap_engine_request_duration_seconds{engine}` | histogram | their latency |
| `tokencap_engine_gate_waits_total{engine}` | counter | waits at the adaptive gate |
| `tokencap_workers` | gauge | workers registered on the run's queues |
| `tokencap_writer_up` / `_error` | gauge | a writer holds the run / it cannot write |
"""

from __future__ import annotations

import hmac
import json
import logging
import os
import threading
from collections.abc import Iterator
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

import requests
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)

from budget_service import jobs
from budget_service.budget import Budget
from budget_service.ledger import cap_text, now_ms, parse_cap
from foundation.config import DEFAULT_BUDGET_PORT
from foundation.engine import engine_specs
from foundation.engine_load import LoadReader

log = logging.getLogger(__name__)

PAGE = Path(__file__).with_name("web") / "index.html"
LOAD_TIMEOUT_S = (1.0, 2.0)
SERIES_MAX_COUNT = 8640
DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = DEFAULT_BUDGET_PORT
MAX_BODY_BYTES = 4096
CONTENT_TYPE_METRICS = "text/plain; version=0.0.4; charset=utf-8"
CATEGORY_GAUGES = (
    ("cap", "tokencap_cap_tokens", "Token cap of the category"),
    ("used", "tokencap_used_tokens", "Tokens counted against the cap"),
    ("reserved", "tokencap_reserved_tokens", "Tokens reserved by samples in flight"),
    ("overshoot", "tokencap_overshoot_tokens", "Tokens counted past the cap"),
    ("pending", "tokencap_samples_pending", "Samples fed and not final"),
    ("in_flight", "tokencap_samples_in_flight", "Samples being generated"),
    ("parked", "tokencap_samples_parked", "Samples waiting until they fit the budget"),
    ("skipped", "tokencap_samples_held",
     "Samples and conversation turns held back by the closed category (a raised cap sends "
     "them)"),
    ("followups", "tokencap_conversations_waiting",
     "Conversations waiting for their next turn to be fed"),
    ("unwritten", "tokencap_results_unwritten",
     "Results and dead letters committed but not yet on disk"),
)
CACHE_COUNTERS = (
    ("prompt_tokens", "tokencap_prompt_tokens", "Prompt tokens of committed samples"),
    ("cached_tokens", "tokencap_cached_tokens",
     "Prompt tokens the engine served from its prefix cache (as its replies say)"),
    ("reusable_tokens", "tokencap_reusable_tokens",
     "Prompt tokens shared with the conversation's turn before: what a prefix cache could "
     "have served"),
)
SAMPLE_OUTCOMES = (("samples", "committed"), ("failed", "failed"), ("rejected", "rejected"))


def worker_count(budget: Budget) -> int:
    """Workers registered on the run's queues (RQ's registry)."""
    cfg = budget.load_config()
    if not cfg or not cfg.category:
        return 0
    return jobs.worker_count(budget.redis, budget.keys, cfg.category[0].name)


def _category_metrics(status: dict[str, Any]) -> Iterator[Metric]:
    run, cats = status["run"], status["categories"]
    labels = ["run", "category"]
    for field, name, help_text in CATEGORY_GAUGES:
        g = GaugeMetricFamily(name, help_text, labels=labels)
        for cat, st in cats.items():
            if st[field] is not None:  # an uncapped category has no cap
                g.add_metric([run, cat], st[field])
        yield g
    g = GaugeMetricFamily("tokencap_category_open", "1 while the category is fed, else 0",
                          labels=labels)
    for cat, st in cats.items():
        g.add_metric([run, cat], int(st["state"] == "open"))
    yield g
    c = CounterMetricFamily("tokencap_samples", "Samples by final outcome",
                            labels=[*labels, "outcome"])
    for cat, st in cats.items():
        for field, outcome in SAMPLE_OUTCOMES:
            c.add_metric([run, cat, outcome], st[field])
    yield c
    c = CounterMetricFamily("tokencap_waste_tokens",
                            "Tokens of outputs cut at max_new_tokens", labels=labels)
    for cat, st in cats.items():
        c.add_metric([run, cat], st["waste_tokens"])
    yield c
    c = CounterMetricFamily("tokencap_out_of_vocab_samples",
                            "Committed samples with output ids past the tokenizer's vocabulary",
                            labels=labels)
    for cat, st in cats.items():
        c.add_metric([run, cat], st["out_of_vocab"])
    yield c
    for field, name, help_text in CACHE_COUNTERS:
        c = CounterMetricFamily(name, help_text, labels=[*labels, "engine"])
        for cat, st in cats.items():
            for url, row in (st.get("engines") or {}).items():
                c.add_metric([run, cat, url], row[field])
        yield c
    c = CounterMetricFamily("tokencap_failure_reasons",
                            "Samples rejected or dead-lettered, by reason",
                            labels=[*labels, "reason"])
    for cat, st in cats.items():
        for reason, n in st["reasons"].items():
            c.add_metric([run, cat, reason], n)
    yield c


def _writer_metrics(run: str, writer: dict[str, Any]) -> Iterator[Metric]:
    g = GaugeMetricFamily("tokencap_writer_up", "1 while a writer holds the run's lease",
                          labels=["run"])
    g.add_metric([run], int(bool(writer.get("holder"))))
    yield g
    g = GaugeMetricFamily("tokencap_writer_error",
                          "1 while the writer cannot write (a full disk, ...)", labels=["run"])
    g.add_metric([run], int(bool(writer.get("error"))))
    yield g


def _engine_metrics(run: str, counts: dict[str, int], workers: int) -> Iterator[Metric]:
    """Requests by engine and outcome, and their latency histogram, from the workers'
    counters (`consumers.stats`: `<engine>|requests|<outcome>`, `<engine>|latency_le|<s>`,
    `<engine>|latency_sum_ms`)."""
    g = GaugeMetricFamily("tokencap_workers", "Workers registered on the run's queues",
                          labels=["run"])
    g.add_metric([run], workers)
    yield g
    requests_ = CounterMetricFamily("tokencap_engine_requests", "Requests by engine and outcome",
                                    labels=["run", "engine", "outcome"])
    waits = CounterMetricFamily("tokencap_engine_gate_waits",
                                "Times a worker waited at the adaptive gate (engine queue at "
                                "adaptive_max_queue)", labels=["run", "engine"])
    buckets: dict[str, dict[float, int]] = {}
    sums_ms: dict[str, int] = {}
    for key, value in sorted(counts.items()):
        engine, kind, rest = (key.split("|") + ["", ""])[:3]
        if kind == "requests":
            requests_.add_metric([run, engine, rest], value)
        elif kind == "gate_waits":
            waits.add_metric([run, engine], value)
        elif kind == "latency_le":
            buckets.setdefault(engine, {})[float(rest)] = value
        elif kind == "latency_sum_ms":
            sums_ms[engine] = value
    yield requests_
    yield waits
    h = HistogramMetricFamily("tokencap_engine_request_duration_seconds",
                              "Latency of the requests the workers sent, by engine",
                              labels=["run", "engine"])
    for engine, by_le in sorted(buckets.items()):
        ordered = [("+Inf" if le == float("inf") else f"{le:g}", n)
                   for le, n in sorted(by_le.items())]
        if ordered[-1][0] != "+Inf":
            ordered.append(("+Inf", ordered[-1][1]))
        h.add_metric([run, engine], ordered, sums_ms.get(engine, 0) / 1000)
    yield h


class BudgetCollector:
    """A `prometheus_client` collector that reads the run's state at each scrape."""

    def __init__(self, budget: Budget) -> None:
        self.budget = budget

    def collect(self) -> Iterator[Metric]:
        status = self.budget.telemetry.status(by_engine=True)
        yield from _category_metrics(status)
        yield from _writer_metrics(status["run"], status["writer"])
        yield from _engine_metrics(status["run"], self.budget.telemetry.engine_counts(),
                                   worker_count(self.budget))


def render_metrics(budget: Budget) -> bytes:
    """The `/metrics` page of `budget`'s run."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(BudgetCollector(budget))
    return bytes(generate_latest(registry))


def take_point(budget: Budget, loads: LoadReader | None = None) -> dict[str, Any]:
    """One point of the run's time series, as the recorder appends it (`loads`: the
    recorder's reader, which remembers the engines without /v1/loads)."""
    loads = loads or LoadReader()
    st = budget.telemetry.status()
    cats = {name: {k: c[k] for k in ("used", "samples", "cap", "state")}
            for name, c in st["categories"].items()}
    keyed = {s.url: s for s in engine_specs(os.environ.get("SGLANG_URL"))}
    engines: dict[str, Any] = {}
    for url in st["engines"]:
        spec = keyed.get(url) or engine_specs([url])[0]
        try:
            load, _ = loads.read(url, spec.headers(), LOAD_TIMEOUT_S)
        except requests.RequestException:
            load = None
        engines[url] = {"running": load["running"], "queued": load["queued"]} if load else {}
    return {"at": now_ms(), "categories": cats, "engines": engines,
            "workers": worker_count(budget), "unwritten": st["writer"]["unwritten"]}


class Recorder(threading.Thread):
    """Appends a point of the run's time series every `every_s` seconds until `stop`."""

    def __init__(self, budget: Budget, every_s: float) -> None:
        super().__init__(daemon=True, name="series-recorder")
        self.budget, self.every_s = budget, every_s
        self.stop_event = threading.Event()
        self.loads = LoadReader()

    def run(self) -> None:
        while not self.stop_event.is_set():
            try:
                self.budget.telemetry.record_point(take_point(self.budget, self.loads))
            except Exception as exc:  # Redis away, an engine odd: the next point will do
                log.debug("time series point not recorded: %s", exc)
            self.stop_event.wait(self.every_s)

    def stop(self) -> None:
        self.stop_event.set()


def make_server(budget: Budget, host: str = DEFAULT_HOST, port: int = DEFAULT_PORT,
                token: str | None = None) -> ThreadingHTTPServer:
    class Handler(BaseHTTPRequestHandler):
        server_version = "tokencap-budget"

        def log_message(self, fmt: str, *args: Any) -> None:
            log.debug("%s " + fmt, self.client_address[0], *args)

        def _send(self, code: int, body: bytes, ctype: str = "application/json") -> None:
            self.send_response(code)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def _json(self, code: int, obj: Any) -> None:
            self._send(code, json.dumps(obj).encode())

        def do_GET(self) -> None:  # noqa: N802
            url = urlsplit(self.path)
            if url.path == "/":
                self._send(200, PAGE.read_bytes(), "text/html; charset=utf-8")
            elif url.path == "/status":
                self._json(200, budget.telemetry.status(by_engine=True))
            elif url.path == "/series":
                query = parse_qs(url.query)
                count = query.get("count", [""])[0]
                points = budget.telemetry.series(query.get("after", [""])[0], min(
                    int(count), SERIES_MAX_COUNT) if count.isdigit() else None)
                self._json(200, points)
            elif url.path == "/metrics":
                self._send(200, render_metrics(budget), CONTENT_TYPE_METRICS)
            elif url.path == "/health":
                self._json(200, {"ok": True})
            else:
                self._json(404, {"error": f"no route {self.path}"})

        def do_POST(self) -> None:  # noqa: N802
            if self.path != "/cap":
                self._json(404, {"error": f"no route {self.path}"})
                return
            given = self.headers.get("Authorization", "").removeprefix("Bearer ").strip()
            if not token or not hmac.compare_digest(given.encode(), token.encode()):
                self._json(HTTPStatus.UNAUTHORIZED, {"error": "a valid bearer token is needed"})
                return
            length = int(self.headers.get("Content-Length") or 0)
            if length > MAX_BODY_BYTES:
                self._json(413, {"error": "body too large"})
                return
            try:
                body = json.loads(self.rfile.read(length) or b"{}")
                cat, cap = str(body["category"]), parse_cap(str(body["cap_tokens"]))
            except (ValueError, KeyError, TypeError) as exc:
                self._json(400, {"error": f"expected {{category, cap_tokens}}: {exc}"})
                return
            if cat not in budget.telemetry.status()["categories"]:
                self._json(404, {"error": f"no category {cat!r}"})
                return
            closed, old = budget.operating.set_cap(
                cat, cap, by=f"POST /cap from {self.client_address[0]}")
            log.warning("cap of %s changed from %s to %s over HTTP", cat, cap_text(old),
                        cap_text(cap))
            self._json(200, {"category": cat, "old_cap": old, "cap": cap, "closed": closed})

    return ThreadingHTTPServer((host, port), Handler)


def serve_in_thread(server: ThreadingHTTPServer) -> threading.Thread:
    t = threading.Thread(target=server.serve_forever, daemon=True, name="budget-http")
    t.start()
    return t
