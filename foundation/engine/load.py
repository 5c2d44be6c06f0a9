"""An engine's load: running and queued requests, KV-cache usage and generation tok/s,
read from SGLang's ``/v1/loads`` (0.5.9 and later: read on request, one entry per DP rank;
`parse_loads`), else from the Prometheus ``/metrics`` page (`parse_metrics`, the one parser
of it; SGLang refreshes those gauges only every few dozen decode steps). `LoadReader`
remembers which engines have no ``/v1/loads``."""

from __future__ import annotations

import math
import re
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import requests

LOADS_PATH = "/v1/loads?include=core"


NO_LOAD_READINGS = ("no load readings (a router, or SGLang before 0.5.9 without "
                    "--enable-metrics): no load balancing across it")


def read_load(get: Callable[..., requests.Response], url: str,
              headers: dict[str, str] | None, timeout: tuple[float, float],
              try_loads: bool = True) -> tuple[dict[str, float | None] | None, str]:
    """An engine's load and where it was read: ``/v1/loads`` ("loads", unless `try_loads` is
    false), else ``/metrics`` ("metrics"); (None, "") when it has neither. `get` is
    `requests.get` or a session's; its errors (and an HTTP error status) are raised as
    `requests.RequestException`. `LoadReader` remembers which engines have no /v1/loads."""
    if try_loads:
        r = get(f"{url}{LOADS_PATH}", timeout=timeout, headers=headers)
        if r.status_code != 404:
            r.raise_for_status()
            try:
                return parse_loads(r.json()), "loads"
            except ValueError:
                pass
    r = get(f"{url}/metrics", timeout=timeout, headers=headers)
    if r.status_code == 404:
        return None, ""
    r.raise_for_status()
    return parse_metrics(r.text), "metrics"


class LoadReader:
    """One reader's view of engines' load (a worker's pool, the budget service's recorder, the
    board): ``/v1/loads`` is asked of an engine until one reading came from elsewhere (a 404:
    vLLM, SGLang before 0.5.9, a router), then only ``/metrics``."""

    def __init__(self, get: Callable[..., requests.Response] = requests.get) -> None:
        self.get = get
        self.without_loads: set[str] = set()

    def read(self, url: str, headers: dict[str, str] | None,
             timeout: tuple[float, float]) -> tuple[dict[str, float | None] | None, str]:
        """`read_load` of `url`, /v1/loads skipped where it was missing before."""
        load, source = read_load(self.get, url, headers, timeout,
                                 try_loads=url not in self.without_loads)
        if source != "loads":
            self.without_loads.add(url)
        return load, source


def parse_loads(doc: Any) -> dict[str, float | None]:
    """Running and queued requests and KV-cache usage from SGLang's ``/v1/loads`` JSON (one
    entry per DP rank: they add up; usage: the max); None for what it lacks."""
    loads = doc.get("loads") if isinstance(doc, dict) else None
    out: dict[str, float | None] = dict.fromkeys(
        ("running", "queued", "token_usage", "gen_throughput"))
    if not isinstance(loads, list):
        return out
    ranks = [d for d in loads if isinstance(d, dict)]
    for key, field, combine in (("running", "num_running_reqs", sum),
                                ("queued", "num_waiting_reqs", sum),
                                ("token_usage", "token_usage", max),
                                ("gen_throughput", "gen_throughput", sum)):
        values = [float(d[field]) for d in ranks if isinstance(d.get(field), int | float)]
        out[key] = float(combine(values)) if values else None
    return out


# metric name -> (key of `parse_metrics`' result, how the series of its ranks combine)
METRICS: dict[str, tuple[str, Callable[[list[float]], float]]] = {
    "sglang:num_running_reqs": ("running", sum),
    "sglang:num_queue_reqs": ("queued", sum),
    "sglang:token_usage": ("token_usage", max),
    "sglang:gen_throughput": ("gen_throughput", sum),
    "vllm:num_requests_running": ("running", sum),
    "vllm:num_requests_waiting": ("queued", sum),
    "vllm:kv_cache_usage_perc": ("token_usage", max),
    "vllm:gpu_cache_usage_perc": ("token_usage", max),
}
# labels that tell engines apart (their series add up); any other label (tp_rank, pp_rank,
# moe_ep_rank, ...) repeats one scheduler's value (the max of them is taken)
ENGINE_LABELS = ("dp_rank", "engine", "model_name")
# One sample line: name, optional {labels} (quoted values may hold '}' or escaped quotes),
# value, optional timestamp.
_SAMPLE_RE = re.compile(
    r'^(?P<name>[a-zA-Z_:][a-zA-Z0-9_:]*)'
    r'(?:\{(?P<labels>(?:[^"}]|"(?:[^"\\]|\\.)*")*)\})?'
    r'\s+(?P<value>\S+)(?:\s+-?\d+)?\s*$'
)
_LABEL_RE = re.compile(r'(\w+)\s*=\s*"((?:[^"\\]|\\.)*)"')


def parse_metrics(text: str) -> dict[str, float | None]:
    """Running and queued requests, KV-cache usage (0..1) and generation tok/s of an engine,
    from its Prometheus `/metrics` page (SGLang's or vLLM's names).

    With priority scheduling SGLang exports a total (``priority=""``) beside one series per
    priority: only the total is read. With several DP ranks (or vLLM engines) each has its
    series: they add up (usage: the max). Tensor-parallel ranks (all schedulers' metrics)
    repeat their group's value: one per group is read. Comments, other metrics and
    unparsable lines are ignored; a metric that is missing (or only NaN) is None.
    """
    series: dict[str, list[tuple[dict[str, str], float]]] = defaultdict(list)
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        m = _SAMPLE_RE.match(line)
        if m is None or m["name"] not in METRICS:
            continue
        try:
            value = float(m["value"])
        except ValueError:
            continue
        if not math.isnan(value):
            series[m["name"]].append((dict(_LABEL_RE.findall(m["labels"] or "")), value))
    out: dict[str, float | None] = dict.fromkeys(
        ("running", "queued", "token_usage", "gen_throughput"))
    for metric, (key, combine) in METRICS.items():
        found = series.get(metric)
        if not found or out[key] is not None:
            continue
        if any("priority" in labels for labels, _ in found):
            found = [(labels, v) for labels, v in found if labels.get("priority", "") == ""]
        groups: dict[tuple[str, ...], float] = {}
        for labels, value in found:
            group = tuple(labels.get(k, "") for k in ENGINE_LABELS)
            groups[group] = max(groups.get(group, value), value)
        out[key] = float(combine(list(groups.values()))) if groups else None
    return out
