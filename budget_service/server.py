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
(`budget_service.telemetry` lists the metrics.)
"""

from __future__ import annotations

import hmac
import json
import logging
import os
import threading
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

import msgspec
import requests

from budget_service.budget import Budget
from budget_service.ledger import cap_text, now_ms, parse_cap
from budget_service.telemetry import PointCategory, PointEngine, SeriesPoint, render_metrics
from foundation.config import DEFAULT_BUDGET_PORT
from foundation.engine.api import engine_specs
from foundation.engine.load import LoadReader

log = logging.getLogger(__name__)

PAGE = Path(__file__).with_name("web") / "index.html"
LOAD_TIMEOUT_S = (1.0, 2.0)
SERIES_MAX_COUNT = 8640
DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = DEFAULT_BUDGET_PORT
MAX_BODY_BYTES = 4096
CONTENT_TYPE_METRICS = "text/plain; version=0.0.4; charset=utf-8"


def take_point(budget: Budget, loads: LoadReader | None = None) -> SeriesPoint:
    """One point of the run's time series, as the recorder appends it (`loads`: the
    recorder's reader, which remembers the engines without /v1/loads)."""
    loads = loads or LoadReader()
    snap = budget.telemetry.snapshot()
    cats = {name: PointCategory(used=c.used, samples=c.samples, cap=c.cap, state=c.state)
            for name, c in snap.categories.items()}
    keyed = {s.url: s for s in engine_specs(os.environ.get("SGLANG_URL"))}
    engines: dict[str, PointEngine] = {}
    for url in snap.engines:
        spec = keyed.get(url) or engine_specs([url])[0]
        try:
            load, _ = loads.read(url, spec.headers(), LOAD_TIMEOUT_S)
        except requests.RequestException:
            load = None
        engines[url] = PointEngine(running=load["running"], queued=load["queued"]) if load \
            else PointEngine()
    return SeriesPoint(at=now_ms(), categories=cats, engines=engines,
                       workers=budget.telemetry.workers(), unwritten=snap.writer.unwritten)


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

        def do_GET(self) -> None:
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
                self._json(200, msgspec.to_builtins(points))
            elif url.path == "/metrics":
                self._send(200, render_metrics(budget.telemetry), CONTENT_TYPE_METRICS)
            elif url.path == "/health":
                self._json(200, {"ok": True})
            else:
                self._json(404, {"error": f"no route {self.path}"})

        def do_POST(self) -> None:
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
            if cat not in budget.telemetry.snapshot().categories:
                self._json(404, {"error": f"no category {cat!r}"})
                return
            closed, old = budget.operating.set_cap(
                cat, cap, by=f"POST /cap from {self.client_address[0]}")
            log.warning("cap of %s changed from %s to %s over HTTP", cat, cap_text(old),
                        cap_text(cap))
            self._json(200, {"category": cat, "old_cap": old, "cap": cap, "closed": closed})

    return ThreadingHTTPServer((host, port), Handler)
