"""Telemetry: the run's state as status, `/status`, `/metrics` and the live page read it,
and the points and counters recorded for them.

`TelemetryLedger.snapshot` reads the typed state once (`RunStatus`: each category's
`CategoryState`, the writer, the engines, a hidden-state stage's bytes per token): what the
producer hands its boards (progress lines, summary, watch, report). Its one JSON face, the
status document (`status_document`, what `tokencap status --json` and `/status` give), and
the `/metrics` page (`render_metrics`) are both made from it here, so a field shows the same
in both. A run whose hidden-state stage exists (the run `<run>.hs`: `TelemetryLedger.stage`)
shows it beside: the status document under `hidden_states`, its bytes in `/metrics`. The
run's time series is typed too (`SeriesPoint`), stored and read as JSON.

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
| `tokencap_waste_tokens_total` | counter | output tokens of replies kept out of training |
| `tokencap_kept_tokens_total` | counter | output tokens of training rows |
| `tokencap_rejected_reply_tokens_total{reason}` | counter | their output tokens, by reason |
| `tokencap_rejected_replies_total{reason}` | counter | replies the reply gate kept out, by reason |
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
| `tokencap_hidden_state_bytes` | gauge | bytes of states kept (a stage's, or its run's `.hs`) |
| `tokencap_engine_down{engine}` | gauge | 1 while the engine does not answer (engine watch) |
| `tokencap_engine_down_since_seconds{engine}` | gauge | since when (Unix time) |
| `tokencap_mode_rows_total{mode}` | counter | committed rows per decode mode (`modes`) |
| `tokencap_mode_tokens_total{mode}` | counter | their counted tokens |
| `tokencap_mode_weight{mode}` | gauge | the mode's weight, as a share of its category's |

A category with `modes` also has a `modes` table in the status document: per category as the
config names it (the budgets `<category>.<mode>` of a `share = "tokens"` category added up
under it), each mode's rows and tokens, their shares, and the mode's weight (`mode_table`).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any, NamedTuple, cast

import msgspec
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)

from budget_service import jobs
from budget_service.keys import Keys
from budget_service.ledger import (
    SERIES_POINTS,
    CategoryState,
    Ledger,
    as_str,
    cache_by_engine,
    run_ended,
)
from foundation.config import STATES_RUN_SUFFIX, RunConfig, mode_shares
from foundation.engine.info import EngineInfo
from foundation.wire import encode

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


class WriterState(msgspec.Struct, frozen=True):
    """The run's writer: who holds its lease, its trouble (since `error_at_ms`), and what it
    has not written."""

    holder: str | None
    error: str | None
    unwritten: int
    error_at_ms: int | None = None


class EngineTrouble(msgspec.Struct, frozen=True):
    """Why an engine of the run does not answer (or, in `RunStatus.disk_trouble`, why a
    hidden-state stage's workers pause on its states folder), since when (ms since the
    epoch)."""

    why: str
    since_ms: int


class StateBytes(NamedTuple):
    """A hidden-state stage's category in bytes of states: kept, and its cap (None:
    uncapped)."""

    used: int
    cap: int | None


class RunStatus(msgspec.Struct, frozen=True):
    """One read of the run's state (`TelemetryLedger.snapshot`); `cache` (per category, per
    engine URL: samples, prompt, cached and reusable tokens) only when asked for;
    `bytes_per_token` only for a hidden-state stage (its categories count tokens, and keep
    that many bytes of states per token)."""

    run: str
    categories: dict[str, CategoryState]
    writer: WriterState
    engines: dict[str, EngineInfo]
    cache: dict[str, dict[str, dict[str, int]]] = {}
    trouble: dict[str, EngineTrouble] = {}
    bytes_per_token: int | None = None
    # a hidden-state stage's states folders too full for the next row: its workers pause
    disk_trouble: dict[str, EngineTrouble] = {}
    # per category with modes, as the config names it: each mode's weight (a share of 1),
    # and which of `categories` hold its rows (itself, or its `<category>.<mode>` budgets)
    mode_weights: dict[str, dict[str, float]] = {}
    mode_parts: dict[str, list[str]] = {}

    @property
    def simulated(self) -> bool:
        return any(e.simulated for e in self.engines.values())

    @property
    def ended(self) -> bool:
        """The run's end (`budget_service.ledger.run_ended`): every category ended and
        everything written."""
        return run_ended(self.categories, self.writer.unwritten)

    def state_bytes(self, st: CategoryState) -> StateBytes | None:
        """`st` (one of this run's categories) in bytes of states; None but for a
        hidden-state stage."""
        bpt = self.bytes_per_token
        if not bpt:
            return None
        return StateBytes(st.used * bpt, None if st.cap is None else st.cap * bpt)


class PointCategory(msgspec.Struct, frozen=True):
    """A category in a point of the time series."""

    used: int
    samples: int
    cap: int | None
    state: str


class PointEngine(msgspec.Struct, frozen=True):
    """An engine's load in a point of the time series: running and queued requests (both
    absent: the engine gave no reading)."""

    running: float | None | msgspec.UnsetType = msgspec.UNSET
    queued: float | None | msgspec.UnsetType = msgspec.UNSET


class SeriesPoint(msgspec.Struct, frozen=True):
    """One point of the run's time series (`budget_service.server.take_point`): when (ms
    since the epoch), each category's budget, each engine's load, the workers, the results
    not yet written; `id`, its stream id, once read back (`TelemetryLedger.series`)."""

    at: int
    categories: dict[str, PointCategory]
    engines: dict[str, PointEngine]
    workers: int
    unwritten: int
    id: str | msgspec.UnsetType = msgspec.UNSET


_POINT = msgspec.json.Decoder(SeriesPoint)


class TelemetryLedger(Ledger):
    """What status, `/metrics` and the live page read, and the points and counters
    recorded for them."""

    def snapshot(self, categories: Sequence[str] | None = None,
                 by_engine: bool = False) -> RunStatus:
        """The run's state in one round trip, after the stored config's (every category of
        it unless `categories`; a hidden-state stage's bytes per token); with `by_engine`,
        each category's prefix cache counters per engine."""
        cfg = self.load_config()  # read once: the categories, and a stage's bytes per token
        if categories is None:
            categories = [c.name for c in cfg.category] if cfg else []
        states, (caches, holder, wstate, engines_raw, trouble_raw, disk_raw) = \
            self._states(categories, by_engine)
        error = as_str(wstate[b"error"]) if b"error" in wstate else None
        writer = WriterState(holder=None if holder is None else as_str(holder), error=error,
                             unwritten=sum(st.unwritten for st in states.values()),
                             error_at_ms=int(wstate[b"error_at_ms"])
                             if error and b"error_at_ms" in wstate else None)
        engines = {as_str(k): msgspec.json.decode(v, type=EngineInfo)
                   for k, v in engines_raw.items()}
        cache = ({name: cache_by_engine(raw) for name, raw in zip(categories, caches,
                                                                   strict=True)}
                 if by_engine else {})
        trouble, disk = ({as_str(k): msgspec.json.decode(v, type=EngineTrouble)
                          for k, v in raw.items()} for raw in (trouble_raw, disk_raw))
        weights, parts = _modes_of(cfg, categories)
        return RunStatus(self.keys.run, states, writer, engines, cache, trouble,
                         _bytes_per_token(cfg), disk, weights, parts)

    def status(self, categories: list[str] | None = None,
               by_engine: bool = False) -> dict[str, Any]:
        """The `tokencap status --json` document: `status_document` of `snapshot`, with the
        run's hidden-state stage's under `hidden_states` when it exists (`stage`)."""
        doc = status_document(self.snapshot(categories, by_engine))
        stage = self.stage()
        if stage is not None:
            doc["hidden_states"] = status_document(stage.snapshot(by_engine=by_engine))
        return doc

    def stage(self) -> TelemetryLedger | None:
        """The telemetry of the run's hidden-state stage, the run `<run>.hs`, when it exists
        in Redis (None for a stage itself)."""
        if self.keys.run.endswith(STATES_RUN_SUFFIX):
            return None
        stage = TelemetryLedger(self.redis, Keys(self.keys.prefix,
                                                 self.keys.run + STATES_RUN_SUFFIX),
                                self.scripts)
        return stage if stage.has_run() else None

    def workers(self) -> int:
        """Workers registered on the run's queues (RQ's registry)."""
        cfg = self.load_config()
        if not cfg or not cfg.category:
            return 0
        return jobs.worker_count(self.redis, self.keys, cfg.category[0].name)

    def series(self, after: str = "", count: int | None = None) -> list[SeriesPoint]:
        """The time series' points, oldest first, each with its stream `id`: those after
        the point `after` (an id), or with `count` the last ones only."""
        key = self.keys.series
        if count is not None:
            entries = cast(list[Any], self.redis.xrevrange(key, count=count))[::-1]
        else:
            entries = cast(list[Any], self.redis.xrange(key, min=f"({after}" if after else "-"))
        return [msgspec.structs.replace(_POINT.decode(fields[b"p"]), id=as_str(eid))
                for eid, fields in entries]

    def record_point(self, point: SeriesPoint, keep: int = SERIES_POINTS) -> None:
        """Append one point of the run's time series (the budget service records them)."""
        self.scripts.series(keys=[self.keys.series], args=[keep, encode(point)])

    def engine_counts(self) -> dict[str, int]:
        raw = self.redis.hgetall(self.keys.engines)
        return {as_str(k): int(v) for k, v in raw.items()}

    def record_engines(self, infos: Sequence[EngineInfo]) -> None:
        """What the run's engines serve (the producer's preflight), for status and workers."""
        args: list[Any] = []
        for info in infos:
            args += [info.url, encode(info)]
        self.scripts.engine_info(keys=[self.keys.engine_info], args=args)

    def engine_trouble(self) -> dict[str, EngineTrouble]:
        """The engines recorded as not answering: url -> why, since when."""
        raw = self.redis.hgetall(self.keys.engine_trouble)
        return {as_str(k): msgspec.json.decode(v, type=EngineTrouble) for k, v in raw.items()}

    def record_engine_trouble(self, url: str, why: str | None, at_ms: int) -> int:
        """Engine `url` does not answer, for reason `why` (the first time seen is kept), or
        (`why` None) answers again. Returns since when (ms) while in trouble; when cleared,
        how long it lasted in ms (-1: it was not in trouble). The producer's engine watch
        is the one caller."""
        return int(self.scripts.engine_trouble(keys=[self.keys.engine_trouble],
                                               args=[url, why or "", at_ms]))



def _bytes_per_token(cfg: RunConfig | None) -> int | None:
    """A hidden-state stage's bytes per counted token (None for generation)."""
    if cfg is None or cfg.stage != "hidden_states":
        return None
    return cfg.states().bytes_per_token


def _modes_of(cfg: RunConfig | None, categories: Sequence[str]
              ) -> tuple[dict[str, dict[str, float]], dict[str, list[str]]]:
    """(weights, parts) of `RunStatus` from the stored config."""
    weights: dict[str, dict[str, float]] = {}
    parts: dict[str, list[str]] = {}
    for cat in cfg.category if cfg else []:
        if not cat.modes or cat.name not in categories:
            continue
        family = cat.split_of or cat.name
        weights[family] = mode_shares(cat)
        parts.setdefault(family, []).append(cat.name)
    return weights, parts


def mode_table(snap: RunStatus) -> dict[str, dict[str, dict[str, Any]]]:
    """Per category with modes (as the config names it): each mode's committed rows and
    counted tokens, their shares of the category's, and its weight."""
    out: dict[str, dict[str, dict[str, Any]]] = {}
    for family, weights in snap.mode_weights.items():
        counts: dict[str, dict[str, int]] = {m: {"rows": 0, "tokens": 0} for m in weights}
        for part in snap.mode_parts.get(family, []):
            for mode, c in snap.categories[part].modes.items():
                row = counts.setdefault(mode, {"rows": 0, "tokens": 0})
                row["rows"] += c.get("rows", 0)
                row["tokens"] += c.get("tokens", 0)
        rows = sum(c["rows"] for c in counts.values())
        tokens = sum(c["tokens"] for c in counts.values())
        out[family] = {m: {**c, "share_rows": c["rows"] / rows if rows else None,
                           "share_tokens": c["tokens"] / tokens if tokens else None,
                           "weight": weights.get(m)} for m, c in counts.items()}
    return out


def status_document(snap: RunStatus) -> dict[str, Any]:
    """The status document, the run's state as JSON: each category's `CategoryState` as a
    dict (with `engines`, its prefix cache counters per engine, when the snapshot has them;
    a hidden-state stage's with `bytes_used` and `bytes_cap`), the writer, the engines' info,
    and whether an engine is a simulator."""
    cats: dict[str, Any] = {}
    for name, st in snap.categories.items():
        cats[name] = msgspec.structs.asdict(st)
        if name in snap.cache:
            cats[name]["engines"] = snap.cache[name]
        size = snap.state_bytes(st)
        if size is not None:
            cats[name]["bytes_used"], cats[name]["bytes_cap"] = size
    return {"run": snap.run, "categories": cats,
            "writer": msgspec.structs.asdict(snap.writer),
            "engines": {url: msgspec.to_builtins(e) for url, e in snap.engines.items()},
            "engine_trouble": {url: msgspec.to_builtins(t) for url, t in snap.trouble.items()},
            "disk_trouble": {d: msgspec.to_builtins(t) for d, t in snap.disk_trouble.items()},
            "simulated": snap.simulated, "modes": mode_table(snap)}


class _Collector:
    """A `prometheus_client` collector that reads the run's state at each scrape."""

    def __init__(self, ledger: TelemetryLedger) -> None:
        self.ledger = ledger

    def collect(self) -> Iterator[Metric]:
        snap = self.ledger.snapshot(by_engine=True)
        stage = self.ledger.stage()
        yield from _category_metrics(snap)
        yield from _writer_metrics(snap.run, snap.writer)
        yield from _trouble_metrics(snap.run, snap.trouble)
        yield from _bytes_metrics([snap] + ([stage.snapshot()] if stage is not None else []))
        yield from _engine_metrics(snap.run, self.ledger.engine_counts(), self.ledger.workers())


def render_metrics(ledger: TelemetryLedger) -> bytes:
    """The `/metrics` page of the ledger's run (Prometheus text)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Collector(ledger))
    return bytes(generate_latest(registry))


def _category_metrics(snap: RunStatus) -> Iterator[Metric]:
    run, cats = snap.run, snap.categories
    labels = ["run", "category"]
    for field, name, help_text in CATEGORY_GAUGES:
        g = GaugeMetricFamily(name, help_text, labels=labels)
        for cat, st in cats.items():
            if getattr(st, field) is not None:  # an uncapped category has no cap
                g.add_metric([run, cat], getattr(st, field))
        yield g
    g = GaugeMetricFamily("tokencap_category_open", "1 while the category is fed, else 0",
                          labels=labels)
    for cat, st in cats.items():
        g.add_metric([run, cat], int(st.state == "open"))
    yield g
    c = CounterMetricFamily("tokencap_samples", "Samples by final outcome",
                            labels=[*labels, "outcome"])
    for cat, st in cats.items():
        for field, outcome in SAMPLE_OUTCOMES:
            c.add_metric([run, cat, outcome], getattr(st, field))
    yield c
    c = CounterMetricFamily("tokencap_waste_tokens",
                            "Output tokens of replies kept out of training", labels=labels)
    for cat, st in cats.items():
        c.add_metric([run, cat], st.waste_tokens)
    yield c
    c = CounterMetricFamily("tokencap_kept_tokens", "Output tokens of training rows",
                            labels=labels)
    for cat, st in cats.items():
        c.add_metric([run, cat], st.kept_tokens)
    yield c
    for name, field, help_text in (
            ("tokencap_rejected_reply_tokens", "rejected_tokens",
             "Output tokens of replies the reply gate kept out of training, by reason"),
            ("tokencap_rejected_replies", "rejected_replies",
             "Replies the reply gate kept out of training, by reason")):
        c = CounterMetricFamily(name, help_text, labels=[*labels, "reason"])
        for cat, st in cats.items():
            for reason, n in getattr(st, field).items():
                c.add_metric([run, cat, reason], n)
        yield c
    c = CounterMetricFamily("tokencap_out_of_vocab_samples",
                            "Committed samples with output ids past the tokenizer's vocabulary",
                            labels=labels)
    for cat, st in cats.items():
        c.add_metric([run, cat], st.out_of_vocab)
    yield c
    for field, name, help_text in CACHE_COUNTERS:
        c = CounterMetricFamily(name, help_text, labels=[*labels, "engine"])
        for cat in cats:
            for url, row in snap.cache.get(cat, {}).items():
                c.add_metric([run, cat, url], row[field])
        yield c
    for name, field, help_text in (
            ("tokencap_mode_rows", "rows", "Committed rows per decode mode"),
            ("tokencap_mode_tokens", "tokens", "Counted tokens of the rows per decode mode")):
        c = CounterMetricFamily(name, help_text, labels=[*labels, "mode"])
        for cat, st in cats.items():
            for mode, counts in st.modes.items():
                c.add_metric([run, cat, mode], counts.get(field, 0))
        yield c
    g = GaugeMetricFamily("tokencap_mode_weight",
                          "A decode mode's weight, as a share of its category's (the category "
                          "as the config names it)", labels=[*labels, "mode"])
    for family, weights in snap.mode_weights.items():
        for mode, w in weights.items():
            g.add_metric([run, family, mode], w)
    yield g
    c = CounterMetricFamily("tokencap_failure_reasons",
                            "Samples rejected or dead-lettered, by reason",
                            labels=[*labels, "reason"])
    for cat, st in cats.items():
        for reason, n in st.reasons.items():
            c.add_metric([run, cat, reason], n)
    yield c


def _writer_metrics(run: str, writer: WriterState) -> Iterator[Metric]:
    g = GaugeMetricFamily("tokencap_writer_up", "1 while a writer holds the run's lease",
                          labels=["run"])
    g.add_metric([run], int(bool(writer.holder)))
    yield g
    g = GaugeMetricFamily("tokencap_writer_error",
                          "1 while the writer cannot write (a full disk, ...)", labels=["run"])
    g.add_metric([run], int(bool(writer.error)))
    yield g


def _bytes_metrics(snaps: Sequence[RunStatus]) -> Iterator[Metric]:
    """The bytes of states kept, of each of `snaps` that is a hidden-state stage (a run's
    page has its stage's, under the stage's run label)."""
    g = GaugeMetricFamily("tokencap_hidden_state_bytes",
                          "Bytes of hidden states kept (a hidden-state stage)",
                          labels=["run", "category"])
    for snap in snaps:
        for name, st in snap.categories.items():
            size = snap.state_bytes(st)
            if size is not None:
                g.add_metric([snap.run, name], size.used)
    yield g


def _trouble_metrics(run: str, trouble: Mapping[str, EngineTrouble]) -> Iterator[Metric]:
    down = GaugeMetricFamily("tokencap_engine_down", "1 while the engine does not answer",
                             labels=["run", "engine"])
    since = GaugeMetricFamily("tokencap_engine_down_since_seconds",
                              "Since when the engine does not answer (Unix time)",
                              labels=["run", "engine"])
    for url, t in sorted(trouble.items()):
        down.add_metric([run, url], 1)
        since.add_metric([run, url], t.since_ms / 1000)
    yield down
    yield since


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
