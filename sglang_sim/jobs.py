"""What goes into and comes out of the engine, and how it refuses work."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# Abort finish reasons, exactly as SGLang's tokenizer manager and scheduler write them.
ABORT_WAITING: dict[str, Any] = {"type": "abort", "message": "Abort in waiting queue"}
ABORT_RUNNING: dict[str, Any] = {
    "type": "abort",
    "message": "Aborted",
    "status_code": None,
    "err_type": None,
}


class QueueFullError(Exception):
    """The waiting queue holds ``max_queued_requests`` already."""


class DuplicateRidError(Exception):
    """A request with this rid is already in flight."""


@dataclass(frozen=True)
class Job:
    """What the engine needs to know about one request.

    ``max_new_tokens`` is the effective cap (after SGLang's context clamp); ``target_tokens``
    (<= cap) is how many tokens it will produce, and ``finish_reason`` is the reason reported
    when it gets there.
    """

    rid: str
    prompt_tokens: int
    max_new_tokens: int
    target_tokens: int
    finish_reason: dict[str, Any]
    cached_tokens: int = 0  # the prompt's prefix served from the prefix cache: no prefill


@dataclass(frozen=True)
class Completion:
    """How a request ended: tokens generated, reason, and timing."""

    rid: str
    prompt_tokens: int
    completion_tokens: int
    finish_reason: dict[str, Any]
    e2e_latency_s: float
    sim_latency_s: float
    num_retractions: int
