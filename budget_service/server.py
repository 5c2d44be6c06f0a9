"""HTTP face of the budget: `GET /status` (JSON), `GET /metrics` (Prometheus text),
`POST /cap` (change a cap while the run goes on; needs the bearer token).

Binds 127.0.0.1 unless told otherwise. Without a token configured, state-changing calls
are refused outright.
"""

from __future__ import annotations

import hmac
import json
import logging
import threading
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from budget_service.budget import Budget

log = logging.getLogger(__name__)

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8321
MAX_BODY_BYTES = 4096
METRIC_FIELDS = (
    ("cap", "tokencap_cap_tokens", "Token cap per category"),
    ("used", "tokencap_used_tokens", "Tokens counted per category"),
    ("reserved", "tokencap_reserved_tokens", "Tokens reserved by in-flight samples"),
    ("samples", "tokencap_samples_committed", "Samples committed"),
    ("skipped", "tokencap_samples_skipped", "Samples skipped (category closed)"),
    ("failed", "tokencap_samples_failed", "Samples dead-lettered"),
    ("rejected", "tokencap_samples_rejected", "Samples rejected"),
    ("waste_tokens", "tokencap_waste_tokens", "Tokens of truncated outputs"),
    ("overshoot", "tokencap_overshoot_tokens", "Tokens past the cap"),
    ("in_flight", "tokencap_in_flight", "Samples being generated"),
    ("pending", "tokencap_pending", "Samples fed and not final"),
)


def render_engine_metrics(counts: dict[str, int], workers: int) -> list[str]:
    """Per-engine requests by outcome and latency histograms (from workers' counters)."""
    lines = ["# HELP tokencap_workers Consumers registered on the run's queues",
             "# TYPE tokencap_workers gauge", f"tokencap_workers {workers}",
             "# HELP tokencap_engine_requests_total Requests by engine and outcome",
             "# TYPE tokencap_engine_requests_total counter"]
    hist: dict[str, dict[str, int]] = {}
    sums: dict[str, int] = {}
    for key, value in sorted(counts.items()):
        engine, kind, rest = (key.split("|") + ["", ""])[:3]
        if kind == "requests":
            lines.append(f'tokencap_engine_requests_total{{engine="{engine}",'
                         f'outcome="{rest}"}} {value}')
        elif kind == "latency_le":
            hist.setdefault(engine, {})[rest] = value
        elif kind == "latency_sum_ms":
            sums[engine] = value
    lines += ["# HELP tokencap_engine_latency_seconds Request latency by engine",
              "# TYPE tokencap_engine_latency_seconds histogram"]
    for engine, buckets in sorted(hist.items()):
        ordered = sorted(buckets.items(), key=lambda kv: float(kv[0]))
        for le, n in ordered:
            le_text = "+Inf" if le == "inf" else le
            lines.append(f'tokencap_engine_latency_seconds_bucket{{engine="{engine}",'
                         f'le="{le_text}"}} {n}')
        total = buckets.get("inf", 0)
        lines.append(f'tokencap_engine_latency_seconds_count{{engine="{engine}"}} {total}')
        lines.append(f'tokencap_engine_latency_seconds_sum{{engine="{engine}"}} '
                     f'{sums.get(engine, 0) / 1000:.3f}')
    return lines


def render_metrics(status: dict[str, Any], engine_counts: dict[str, int] | None = None,
                   workers: int | None = None) -> str:
    run = status["run"]
    lines: list[str] = []
    for field, metric, help_text in METRIC_FIELDS:
        lines.append(f"# HELP {metric} {help_text}")
        lines.append(f"# TYPE {metric} gauge")
        for cat, st in status["categories"].items():
            lines.append(f'{metric}{{run="{run}",category="{cat}"}} {st[field]}')
    lines.append("# HELP tokencap_category_open 1 if the category is open")
    lines.append("# TYPE tokencap_category_open gauge")
    for cat, st in status["categories"].items():
        lines.append(f'tokencap_category_open{{run="{run}",category="{cat}"}} '
                     f'{int(st["state"] == "open")}')
    if engine_counts is not None:
        lines += render_engine_metrics(engine_counts, workers or 0)
    return "\n".join(lines) + "\n"


def engine_counts(budget: Budget) -> tuple[dict[str, int], int]:
    """Workers' per-engine counters and the number of workers on the run's queues."""
    from rq import Queue, Worker

    from consumers.stats import engines_key

    raw = budget.redis.hgetall(engines_key(budget.keys.prefix))
    counts = {k.decode(): int(v) for k, v in raw.items()}
    cfg = budget.load_config()
    workers = 0
    if cfg and cfg.category:
        q = Queue(budget.keys.queue_name(cfg.category[0].name), connection=budget.redis)
        workers = Worker.count(connection=budget.redis, queue=q)
    return counts, workers


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
            if self.path == "/status":
                self._json(200, budget.status())
            elif self.path == "/metrics":
                counts, workers = engine_counts(budget)
                body = render_metrics(budget.status(), counts, workers)
                self._send(200, body.encode(), "text/plain; version=0.0.4")
            elif self.path == "/health":
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
                cat, cap = str(body["category"]), int(body["cap_tokens"])
                if cap < 0:
                    raise ValueError("cap_tokens must be >= 0")
            except (ValueError, KeyError, TypeError) as exc:
                self._json(400, {"error": f"expected {{category, cap_tokens}}: {exc}"})
                return
            if cat not in budget.status()["categories"]:
                self._json(404, {"error": f"no category {cat!r}"})
                return
            closed, _exhausted, old = budget.close(cat, "cap", cap)
            log.warning("cap of %s changed from %d to %d over HTTP", cat, old, cap)
            self._json(200, {"category": cat, "old_cap": old, "cap": cap, "closed": closed})

    return ThreadingHTTPServer((host, port), Handler)


def serve_in_thread(server: ThreadingHTTPServer) -> threading.Thread:
    t = threading.Thread(target=server.serve_forever, daemon=True, name="budget-http")
    t.start()
    return t
