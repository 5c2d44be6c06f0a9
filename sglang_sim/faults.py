"""Fault injection for ``/generate``: error statuses, bursts, stalls, resets, bad counts.

The knobs are a :class:`~sglang_sim.config.FaultConfig`, set at start and changed at runtime
through ``POST /_sim/faults``. Random draws come from one ``random.Random`` seeded with the
simulator seed, so a sequential run injects the same faults every time. Per request, in order:

1. ``poison_token_id`` in ``input_ids`` -> HTTP 500, on every attempt;
2. ``error_burst``: while a status has a count left, the request gets it and the count drops;
3. ``error_rates``: one uniform draw picks at most one status;
   then the request is generated normally, and
4. ``reset_rate``: the connection is dropped with no reply (the work was done);
5. ``bad_counts_rate``: ``completion_tokens`` is reported one higher than ``len(output_ids)``;
6. ``stall_s``: the reply waits this many wall-clock seconds;
   and, with ``extract_hidden_states``, before 4:
7. ``hs_*_rate``: the request's hidden-state file is damaged (`sglang_sim.hidden.Damage`).

Error bodies use SGLang's ErrorResponse envelope; 429 has ``type: "rate_limit_error"`` and a
``Retry-After: 0`` header.
"""

from __future__ import annotations

import logging
import random
from collections import Counter
from typing import Any

import msgspec

from sglang_sim.config import FaultConfig
from sglang_sim.hidden import Damage
from sglang_sim.protocol import ApiError, envelope

logger = logging.getLogger(__name__)

RATE_LIMIT_STATUS = 429
POISON_STATUS = 500
_SEED_SALT = "faults"


class FaultInjector:
    """Holds the fault knobs, their random stream and the count of injected faults."""

    def __init__(self, config: FaultConfig, seed: int) -> None:
        config.validate()
        self._config = config
        self._burst: dict[int, int] = dict(config.error_burst)
        self._rng = random.Random(f"{_SEED_SALT}:{seed}")
        self._counts: Counter[str] = Counter()

    @property
    def config(self) -> FaultConfig:
        """The current knobs; ``error_burst`` shows the counts still to inject."""
        return msgspec.structs.replace(self._config, error_burst=dict(self._burst))

    def update(self, changes: dict[str, Any]) -> FaultConfig:
        """Replace the given knobs, keep the others; raise ValueError when invalid."""
        merged = msgspec.to_builtins(self.config)
        merged.update(changes)
        try:
            new = msgspec.convert(merged, FaultConfig, strict=False)
        except msgspec.ValidationError as exc:
            raise ValueError(str(exc)) from exc
        new.validate()
        self._config = new
        self._burst = dict(new.error_burst)
        logger.info("simulated faults set: %s", msgspec.to_builtins(new))
        return self.config

    def counts(self) -> dict[str, int]:
        """Injected faults so far, by kind ("429", "500", ..., "reset", "stall", ...)."""
        return dict(sorted(self._counts.items()))

    def reset_counts(self) -> None:
        self._counts.clear()

    def reply_shape(self, seed: int) -> str:
        """The reply fault of a request's answer ("" for none), drawn from its seed: the same
        prompt gets the same answer every time (`FaultConfig.reply_rates`)."""
        rates = self._config.reply_rates
        if not rates:
            return ""
        draw = random.Random(f"reply:{seed}").random()
        for shape, p in sorted(rates.items()):
            if draw < p:
                self._counts[f"reply_{shape}"] += 1
                return shape
            draw -= p
        return ""

    def before_generate(self, input_ids: list[int]) -> ApiError | None:
        """The error to answer instead of generating, or None."""
        poison = self._config.poison_token_id
        if poison is not None and poison in input_ids:
            self._counts["poison"] += 1
            return ApiError(
                POISON_STATUS,
                envelope(
                    POISON_STATUS,
                    f"Simulated fault: poison token {poison} in input_ids",
                    "InternalServerError",
                ),
            )
        for status, left in self._burst.items():
            if left > 0:
                self._burst[status] = left - 1
                return self._error(status)
        if self._config.error_rates:
            draw = self._rng.random()
            cumulative = 0.0
            for status, probability in sorted(self._config.error_rates.items()):
                cumulative += probability
                if draw < cumulative:
                    return self._error(status)
        return None

    def should_reset(self) -> bool:
        return self._chance(self._config.reset_rate, "reset")

    def should_bad_count(self) -> bool:
        return self._chance(self._config.bad_counts_rate, "bad_counts")

    def hs_damage(self) -> Damage:
        """The faults of one hidden-state file, each drawn on its own (counted as
        "hs_zero_layer", "hs_nan", "hs_wrong_ids", "hs_truncate")."""
        c = self._config
        return Damage(
            zero_layer=self._chance(c.hs_zero_layer_rate, "hs_zero_layer"),
            nan=self._chance(c.hs_nan_rate, "hs_nan"),
            wrong_ids=self._chance(c.hs_wrong_ids_rate, "hs_wrong_ids"),
            truncate=self._chance(c.hs_truncate_rate, "hs_truncate"),
        )

    def stall_s(self) -> float:
        """Wall-clock seconds to wait before replying (counted when > 0)."""
        stall = self._config.stall_s
        if stall > 0:
            self._counts["stall"] += 1
        return stall

    def _chance(self, probability: float, kind: str) -> bool:
        if probability <= 0.0 or self._rng.random() >= probability:
            return False
        self._counts[kind] += 1
        return True

    def _error(self, status: int) -> ApiError:
        self._counts[str(status)] += 1
        if status == RATE_LIMIT_STATUS:
            return ApiError(
                status,
                envelope(status, "Too many requests (simulated fault)", "rate_limit_error"),
                headers={"Retry-After": "0"},
            )
        return ApiError(status, envelope(status, f"Simulated fault: HTTP {status}"))
