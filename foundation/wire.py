"""Wire structs (frozen msgspec Structs): what crosses Redis and lands in the files.

Everything that crosses Redis is msgspec JSON. Structs evolve only by adding optional
fields. The RQ job itself carries only a `JobRef`; the prompt lives in the category's
ledger (`pending`) so a reaper can re-enqueue it and the payload stays small in the queue
(RQ's side of it: `budget_service.jobs`).
A `Result` is also one line of `<out>/<category>/part-*.jsonl` (a training row) or, when the
reply gate kept it out of training, of `rejected-replies.jsonl`; a `DeadLetter` one line of
`failed.jsonl` or `stopped.jsonl` (`foundation.outputs` says which, and reads them back).
"""

from __future__ import annotations

import enum
from typing import Annotated, Any

import msgspec
from msgspec import Meta, Struct

# `<conversation id>#t<turn>`: the sample id of one turn of a conversation
TURN_MARK = "#t"
# A token id as stored: non-negative, and within int32 (Parquet export stores int32).
TokenId = Annotated[int, Meta(ge=0, lt=2**31)]


class ErrorKind(enum.StrEnum):
    """Why a request failed; used for dead letters and retry decisions."""

    BAD_REQUEST = "bad_request"
    OVERLOAD = "overload"
    TIMEOUT = "timeout"
    SERVER_ERROR = "server_error"
    INVALID_RESPONSE = "invalid_response"
    UNREACHABLE = "unreachable"
    LOST = "lost"
    # a hidden-state file that fails its checks (`foundation.hsfile.check`)
    BAD_STATES = "bad_hidden_states"


class JobRef(Struct, frozen=True):
    """The RQ job argument: which sample, which attempt."""

    run: str
    category: str
    sample_id: str
    seq: int = 0
    prompt_tokens: int = 0


class Pending(Struct, frozen=True):
    """A fed sample waiting for a terminal state (stored in the category ledger). How often
    it was enqueued again lives beside it in the ledger (`seq`), not here."""

    sample_id: str
    ordinal: int
    prompt_ids: list[int]
    sampling: dict[str, Any]
    where: str = ""
    source_id: str | None = None
    failures: int = 0
    # a turn of a conversation regenerated turn by turn (turns = "all"): its sample id is
    # `<conversation_id>#t<turn>`, turn 1..turns_total
    conversation_id: str | None = None
    turn: int = 0
    turns_total: int = 0
    # turn j+1 of a conversation: does its prompt start with turn j's prompt + output ids,
    # and what its history holds that the model did not say (`producer.source.prefix`)
    prefix_consistent: bool | None = None
    history_notes: list[str] = []
    # the prompt tokens it shares with turn j's prompt + output: what the engine that served
    # turn j may still hold in its prefix cache (None on turn 1 and single samples)
    reusable_tokens: int | None = None
    # its history replays a tool result of the source for a call of the same function the
    # model made with other arguments (False); None when no result is replayed
    tool_args_match: bool | None = None
    # where to send it (`consumers.routing`): the engine that served the conversation's turn
    # before, and a key of its prompt's first tokens (samples sharing a long prefix share it)
    prefer_engine: str = ""
    affinity: str = ""
    fed_at_ms: int = 0  # when the producer fed it (Unix ms)
    # a hidden-state stage's sample: the training row whose states it extracts (the rows
    # file's `foundation.outputs.StatesRow.id`)
    row_id: str | None = None
    # the decode mode its conversation was drawn to ("" : its category has no modes), and
    # the chat-template kwargs its prompt was rendered with (None: not rendered, token ids)
    mode: str = ""
    chat_template_kwargs: dict[str, Any] | None = None


class Result(Struct, frozen=True):
    """One committed sample, as written to `<out>/<category>/part-*.jsonl`."""

    id: str
    category: str
    prompt_ids: list[TokenId]
    output_ids: list[TokenId]
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
    # when the producer fed it, when a worker sent it (Unix ms; + latency_s: when it came back)
    fed_at_ms: int = 0
    sent_at_ms: int = 0
    conversation_id: str | None = None
    turn: int = 0
    turns_total: int = 0
    # what generated it: the served model's name, the engine's version, and whether the
    # engine was a simulator (synthetic outputs, not training data)
    model: str = ""
    engine_version: str = ""
    simulated: bool = False
    # turns of conversations (turn >= 2): the prompt extends the previous turn's prompt and
    # output exactly (what a drafter trains on), and notes on how its history was built
    prefix_consistent: bool | None = None
    history_notes: list[str] = []
    # the prompt's prefix the engine served from its cache (None: it does not say), and what
    # it could have: the prompt tokens shared with the turn before (`Pending.reusable_tokens`)
    cached_tokens: int | None = None
    reusable_tokens: int | None = None
    # output ids at or past the tokenizer's vocabulary (a model's padding rows): a sign the
    # engine serves another model, or a model that emits ids no text has
    out_of_vocab: int = 0
    # why the reply gate kept it out of training (`foundation.gate.GateReason`: loop, length,
    # unclosed_reasoning, empty), "" for a training row
    gate: str = ""
    # `Pending.tool_args_match`: False when its history pairs a replayed tool result with a
    # call of the same function and other arguments
    tool_args_match: bool | None = None
    # the run that made it: `<run>@<digest>` of its manifest (`<out>/<run>-manifest.json`:
    # tokenizer, template, config, engines, tokencap version)
    made_by: str = ""
    # the stage that extracts hidden states (`RunConfig.stage`): the row's states file,
    # relative to the output folder, with its shape, dtype, layer ids and size
    hidden_states: dict[str, Any] | None = None
    # `Pending.mode` and `Pending.chat_template_kwargs`: the decode mode it was made in ("":
    # none, and every row written before modes) and the kwargs its prompt was rendered with
    # (`sampling` holds the params it was sampled with)
    mode: str = ""
    chat_template_kwargs: dict[str, Any] | None = None


class Outcome(enum.StrEnum):
    """How a dead letter ended its sample."""

    REJECTED = "rejected"  # refused before it reached an engine (bad input, too long)
    DEAD = "dead"  # failed on every try
    # not an end: a conversation's next turn was held back because its category closed (a
    # raised cap sends it, and a row with the same id then follows)
    CUT = "cut"
    # a conversation's next turn not generated, by policy: the model's turn before it
    # diverged from the source's tool calls (tool_divergence), or does not parse
    # (unparsed_reply), or the source changed under the run (source_changed)
    STOPPED = "stopped"


# reasons the producer's intake screens refuse a prompt with (producer/intake.py)
NEAR_DUPLICATE = "near_duplicate"
CONTAMINATED = "contaminated"


def contaminated_by(letter: DeadLetter) -> str | None:
    """The benchmark a `contaminated` dead letter names (its message starts "<benchmark>
    item <id>:"), else None."""
    if letter.reason != CONTAMINATED or " item " not in letter.message:
        return None
    return letter.message.split(" item ", 1)[0]


class DeadLetter(Struct, frozen=True):
    """A sample that ended rejected or dead, written to `<out>/<category>/failed.jsonl`; or a
    conversation's turn cut (`Outcome.CUT`) or stopped (`Outcome.STOPPED`), written to
    `stopped.jsonl`."""

    id: str
    category: str
    outcome: Outcome
    reason: str
    message: str = ""
    where: str = ""
    attempts: int = 0
    conversation_id: str | None = None
    turn: int = 0
    turns_total: int = 0

    @classmethod
    def of(cls, p: Pending, category: str, outcome: Outcome, reason: str, message: str = "",
           attempts: int = 0) -> DeadLetter:
        """The dead letter that ends the sample `p`: its id, where its record is, its place
        in its conversation."""
        return cls(id=p.sample_id, category=category, outcome=outcome, reason=reason,
                   message=message, where=p.where, attempts=attempts,
                   conversation_id=p.conversation_id, turn=p.turn, turns_total=p.turns_total)


def turn_id(conversation_id: str, turn: int) -> str:
    """The sample id of turn `turn` (1-based) of a conversation."""
    return f"{conversation_id}{TURN_MARK}{turn}"


def split_turn_id(sample_id: str) -> tuple[str, int] | None:
    """(conversation id, turn) of a turn's sample id, or None for a plain sample id."""
    conv, mark, n = sample_id.rpartition(TURN_MARK)
    return (conv, int(n)) if mark and n.isdigit() and int(n) > 0 else None


_encoder = msgspec.json.Encoder()


def encode(obj: Any) -> bytes:
    return _encoder.encode(obj)
