"""``/metrics`` in Prometheus text format, with SGLang's metric names.

Gauges are read from the engine when scraped. The token and request counters count finished
requests (aborted ones included), as SGLang increments them on completion. Throughput and
latency are wall-clock figures, as a client would measure them against this server; the
simulated-time figures are in ``/_sim/stats``.
"""

from __future__ import annotations

import bisect
from typing import Any

# Buckets of SGLang's e2e latency histogram, seconds.
E2E_LATENCY_BUCKETS_S = (
    0.1, 0.2, 0.4, 0.6, 0.8, 1.0, 2.0, 4.0, 6.0, 8.0, 10.0, 20.0, 40.0, 60.0, 80.0, 100.0,
    200.0, 400.0, 800.0,
)  # fmt: skip


class LatencyHistogram:
    """A cumulative Prometheus histogram of request latencies in seconds."""

    def __init__(self, buckets_s: tuple[float, ...] = E2E_LATENCY_BUCKETS_S) -> None:
        self.buckets_s = buckets_s
        self.counts = [0] * (len(buckets_s) + 1)  # last one is +Inf
        self.sum_s = 0.0
        self.count = 0

    def observe(self, value_s: float) -> None:
        self.counts[bisect.bisect_left(self.buckets_s, value_s)] += 1
        self.sum_s += value_s
        self.count += 1


def _fmt(value: float) -> str:
    return repr(float(value)) if not float(value).is_integer() else f"{float(value):.1f}"


def split(total: float, parts: int) -> list[float]:
    """`total` requests (or tokens) spread over `parts` ranks, as evenly as whole numbers go."""
    if parts == 1 or not float(total).is_integer():
        return [total / parts] * parts
    n = int(total)
    return [float(n // parts + (1 if i < n % parts else 0)) for i in range(parts)]


def render(
    stats: dict[str, Any],
    *,
    model_name: str,
    gen_throughput_tok_s: float,
    e2e: LatencyHistogram,
    flavor: str = "sglang",
    dp_ranks: int = 1,
    tp_ranks: int = 1,
    priority: bool = False,
) -> str:
    """The ``/metrics`` page from engine stats, the wall-clock decode rate and latencies.

    SGLang's gauges carry `model_name`, `engine_type`, `tp_rank`, `pp_rank` and `moe_ep_rank`
    (and `dp_rank` with several DP ranks): one series per DP rank, the requests split across
    them, each repeated per TP rank with `tp_ranks` > 1 (--enable-metrics-for-all-schedulers);
    with
    `priority`, a ``priority=""`` total beside per-priority series. vLLM's flavour has its own
    names, labelled `model_name` and `engine`."""
    label = f'model_name="{model_name}"'
    lines: list[str] = []

    def metric(name: str, kind: str, help_text: str, value: float) -> None:
        lines.append(f"# HELP {name} {help_text}")
        lines.append(f"# TYPE {name} {kind}")
        lines.append(f"{name}{{{label}}} {_fmt(value)}")

    def gauge(name: str, help_text: str, value: float, shared: bool = False) -> None:
        lines.append(f"# HELP {name} {help_text}")
        lines.append(f"# TYPE {name} gauge")
        for dp, part in enumerate([value] * dp_ranks if shared else split(value, dp_ranks)):
            for tp in range(tp_ranks):
                rank = dp * tp_ranks + tp  # TP ranks numbered across DP groups
                base = (f'{label},engine_type="unified",tp_rank="{rank}",pp_rank="0",'
                        f'moe_ep_rank="{rank}"' + (f',dp_rank="{dp}"' if dp_ranks > 1 else ""))
                if not priority:
                    lines.append(f"{name}{{{base}}} {_fmt(part)}")
                    continue
                lines.append(f'{name}{{{base},priority=""}} {_fmt(part)}')
                for prio, share in enumerate([part, part] if shared else split(part, 2)):
                    lines.append(f'{name}{{{base},priority="{prio}"}} {_fmt(share)}')

    if flavor == "vllm":
        vlabel = f'{label},engine="0"'
        for name, help_text, value in (
                ("vllm:num_requests_running", "Number of requests in model execution batches.",
                 stats["running"]),
                ("vllm:num_requests_waiting", "Number of requests waiting to be processed.",
                 stats["queued"]),
                ("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.",
                 stats["token_usage"])):
            lines += [f"# HELP {name} {help_text}", f"# TYPE {name} gauge",
                      f"{name}{{{vlabel}}} {_fmt(value)}"]
        for name, help_text, value in (
                ("vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of "
                 "queried tokens.", stats.get("prefix_cache_queries", 0)),
                ("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached "
                 "tokens.", stats.get("prefix_cache_hits", 0)),
                ("vllm:prompt_tokens", "Number of prefill tokens processed.",
                 stats.get("prompt_tokens", 0)),
                ("vllm:generation_tokens", "Number of generation tokens processed.",
                 stats.get("generation_tokens", 0))):
            lines += [f"# HELP {name}_total {help_text}", f"# TYPE {name}_total counter",
                      f"{name}_total{{{vlabel}}} {_fmt(value)}"]
        return "\n".join(lines) + "\n"
    gauge("sglang:num_running_reqs", "The number of running requests.", stats["running"])
    gauge("sglang:num_queue_reqs", "The number of requests in the waiting queue.",
          stats["queued"])
    gauge("sglang:num_used_tokens", "The number of used tokens.", stats["kv_used_tokens"])
    gauge("sglang:token_usage", "The token usage.", stats["token_usage"], shared=True)
    gauge("sglang:gen_throughput", "The generation throughput (token/s).",
          gen_throughput_tok_s)
    metric("sglang:prompt_tokens_total", "counter", "Number of prefill tokens processed.",
           stats["finished_prompt_tokens_total"])  # fmt: skip
    metric("sglang:generation_tokens_total", "counter", "Number of generation tokens processed.",
           stats["finished_completion_tokens_total"])  # fmt: skip
    metric("sglang:num_requests_total", "counter", "Number of requests processed.",
           stats["finished_total"])  # fmt: skip
    metric("sglang:num_aborted_requests_total", "counter", "Number of requests aborted.",
           stats["aborted_total"])  # fmt: skip

    name = "sglang:e2e_request_latency_seconds"
    lines.append(f"# HELP {name} Histogram of End-to-end request latency in seconds")
    lines.append(f"# TYPE {name} histogram")
    cumulative = 0
    for bound, count in zip((*e2e.buckets_s, float("inf")), e2e.counts, strict=True):
        cumulative += count
        le = "+Inf" if bound == float("inf") else _fmt(bound)
        lines.append(f'{name}_bucket{{le="{le}",{label}}} {_fmt(cumulative)}')
    lines.append(f"{name}_count{{{label}}} {_fmt(e2e.count)}")
    lines.append(f"{name}_sum{{{label}}} {_fmt(e2e.sum_s)}")
    return "\n".join(lines) + "\n"
