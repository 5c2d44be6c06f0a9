"""Wire structs (frozen msgspec Structs) and the RQ serializer.

Everything that crosses Redis is msgspec JSON. Structs evolve only by adding optional
fields. The RQ job itself carries only a `JobRef`; the prompt lives in the category's
ledger (`pending`) so a reaper can re-enqueue it and the payload stays small in the queue.
"""

from __future__ import annotations

import enum
from typing import Any

import msgspec
from msgspec import Struct


class ErrorKind(enum.StrEnum):
    """Why a request failed; used for dead letters and retry decisions."""

    BAD_REQUEST = "bad_request"
    OVERLOAD = "overload"
    TIMEOUT = "timeout"
    SERVER_ERROR = "server_error"
    INVALID_RESPONSE = "invalid_response"
    UNREACHABLE = "unreachable"
    LOST = "lost"


class JobRef(Struct, frozen=True):
    """The RQ job argument: which sample, which attempt."""

    run: str
    category: str
    sample_id: str
    seq: int = 0
    prompt_tokens: int = 0


class Pending(Struct, frozen=True):
    """A fed sample waiting for a terminal state (stored in the category ledger)."""

    sample_id: str
    ordinal: int
    prompt_ids: list[int]
    sampling: dict[str, Any]
    where: str = ""
    source_id: str | None = None
    seq: int = 0
    failures: int = 0


class Result(Struct, frozen=True):
    """One committed sample, as written to `<out>/<category>/part-*.jsonl`."""

    id: str
    category: str
    prompt_ids: list[int]
    output_ids: list[int]
    prompt_tokens: int
    completion_tokens: int
    finish_reason: str
    text: str
    sampling: dict[str, Any]
    counted_tokens: int
    ordinal: int = 0
    source_id: str | None = None
    where: str = ""
    finish: dict[str, Any] | None = None
    engine: str = ""
    latency_s: float = 0.0


class DeadLetter(Struct, frozen=True):
    """A sample that ended rejected or dead, as written to `<out>/<category>/dead-letter.jsonl`."""

    id: str
    category: str
    outcome: str
    reason: str
    message: str = ""
    where: str = ""
    attempts: int = 0


_encoder = msgspec.json.Encoder()


def encode(obj: Any) -> bytes:
    return _encoder.encode(obj)


class PayloadRefused(ValueError):
    """A job payload that is not tokencap's msgspec JSON (pickle, garbage, wrong shape)."""


class MsgspecSerializer:
    """RQ serializer: msgspec JSON only. Loading anything else (pickle included) raises."""

    @staticmethod
    def dumps(obj: Any) -> bytes:
        return _encoder.encode(obj)

    @staticmethod
    def loads(data: bytes) -> Any:
        try:
            return msgspec.json.decode(data)
        except (msgspec.DecodeError, UnicodeDecodeError) as exc:
            raise PayloadRefused(f"job payload is not msgspec JSON: {exc}") from None
