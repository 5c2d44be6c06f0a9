"""What tokencap reads from an engine besides `/generate`: the URL list, the context
length, health, and the load gauges of its Prometheus `/metrics` page (the one parser of it,
for the workers' engine choice and the status board)."""

from __future__ import annotations

import logging
import math
import re
from collections.abc import Callable

import requests

log = logging.getLogger(__name__)

INFO_TIMEOUT_S = (3.05, 10.0)


def parse_urls(value: str | None) -> list[str]:
    """`SGLANG_URL` style: one or several URLs, comma separated."""
    return [u.strip().rstrip("/") for u in (value or "").split(",") if u.strip()]


def context_length(urls: list[str]) -> int | None:
    """The smallest context length the engines report, or None if none says."""
    found: list[int] = []
    for url in urls:
        n = _one(url)
        if n:
            found.append(n)
    return min(found) if found else None


def _one(url: str) -> int | None:
    try:
        r = requests.get(f"{url}/v1/models", timeout=INFO_TIMEOUT_S)
        if r.ok:
            data = r.json().get("data") or []
            if data and data[0].get("max_model_len"):
                return int(data[0]["max_model_len"])
        r = requests.get(f"{url}/server_info", timeout=INFO_TIMEOUT_S)
        if r.status_code == 404:
            r = requests.get(f"{url}/get_server_info", timeout=INFO_TIMEOUT_S)
        if r.ok:
            info = r.json()
            if info.get("context_length"):
                return int(info["context_length"])
    except (requests.RequestException, ValueError) as exc:
        log.warning("could not read the context length from %s: %s", url, exc)
    return None


def healthy(url: str, timeout_s: float = 5.0) -> bool:
    try:
        return requests.get(f"{url}/health", timeout=(timeout_s, timeout_s)).status_code == 200
    except requests.RequestException:
        return False


# SGLang metric name -> key of `parse_metrics`' result, and how series are combined when an
# engine exports several (one per DP rank or model): counts add up, usage is the max.
SGLANG_METRICS: dict[str, tuple[str, Callable[[list[float]], float]]] = {
    "sglang:num_running_reqs": ("running", sum),
    "sglang:num_queue_reqs": ("queued", sum),
    "sglang:token_usage": ("token_usage", max),
    "sglang:gen_throughput": ("gen_throughput", sum),
}
# One sample line: name, optional {labels} (quoted values may hold '}' or escaped quotes),
# value, optional timestamp.
_SAMPLE_RE = re.compile(
    r'^(?P<name>[a-zA-Z_:][a-zA-Z0-9_:]*)'
    r'(?:\{(?:[^"}]|"(?:[^"\\]|\\.)*")*\})?'
    r'\s+(?P<value>\S+)(?:\s+-?\d+)?\s*$'
)


def parse_metrics(text: str) -> dict[str, float | None]:
    """Running and queued requests, KV-cache usage (0..1) and generation tok/s from `text`.

    `text` is a Prometheus exposition page as SGLang serves at `/metrics`. Comments, other
    metrics and unparsable lines are ignored; labels are allowed; a metric that is missing (or
    only NaN) is None. Several series of one metric are summed, except `token_usage` (max).
    """
    found: dict[str, list[float]] = {}
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        m = _SAMPLE_RE.match(line)
        if m is None or m["name"] not in SGLANG_METRICS:
            continue
        try:
            value = float(m["value"])
        except ValueError:
            continue
        if not math.isnan(value):
            found.setdefault(m["name"], []).append(value)
    out: dict[str, float | None] = {}
    for metric, (key, combine) in SGLANG_METRICS.items():
        values = found.get(metric)
        out[key] = float(combine(values)) if values else None
    return out
