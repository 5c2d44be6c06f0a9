"""Telemetry: the status document, the time series, the engines' counters and info."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, cast

import msgspec

from budget_service.ledger import (
    SERIES_POINTS,
    Ledger,
    as_str,
    cache_by_engine,
)
from foundation.engine_info import EngineInfo
from foundation.wire import (
    encode,
)


class TelemetryLedger(Ledger):
    """What status, `/metrics` and the live page read, and the points and counters
    recorded for them."""

    def status(self, categories: list[str] | None = None,
               by_engine: bool = False) -> dict[str, Any]:
        """The `tokencap status --json` document (each category's `CategoryState` as a dict);
        with `by_engine`, each category's prefix cache counters per engine (`engines`:
        samples, prompt, cached and reusable tokens)."""
        if categories is None:
            cfg = self.load_config()
            categories = [c.name for c in cfg.category] if cfg else []
        states, (caches, holder, wstate, engines_raw) = self._states(categories, by_engine)
        cats: dict[str, Any] = {name: msgspec.structs.asdict(st) for name, st in states.items()}
        if by_engine:
            for name, cache in zip(categories, caches, strict=True):
                cats[name]["engines"] = cache_by_engine(cache)
        writer = {"holder": None if holder is None else as_str(holder),
                  "error": as_str(wstate[b"error"]) if b"error" in wstate else None,
                  "unwritten": sum(c["unwritten"] for c in cats.values())}
        engines = {as_str(k): msgspec.to_builtins(msgspec.json.decode(v, type=EngineInfo))
                   for k, v in engines_raw.items()}
        return {"run": self.keys.run, "categories": cats, "writer": writer,
                "engines": engines, "simulated": any(e.get("simulated") for e in
                                                     engines.values())}

    def series(self, after: str = "", count: int | None = None) -> list[dict[str, Any]]:
        """The time series' points, oldest first, each with its stream `id`: those after
        the point `after` (an id), or with `count` the last ones only."""
        key = self.keys.series
        if count is not None:
            entries = cast(list[Any], self.redis.xrevrange(key, count=count))[::-1]
        else:
            entries = cast(list[Any], self.redis.xrange(key, min=f"({after}" if after else "-"))
        return [{**msgspec.json.decode(fields[b"p"]), "id": as_str(eid)} for eid, fields in entries]

    def record_point(self, point: Mapping[str, Any], keep: int = SERIES_POINTS) -> None:
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
