"""The gate on a generated reply: why it is kept out of training, or None when it is kept.

A drafter learns what the target model says next; a reply that loops, says nothing, or
never closes its reasoning teaches it the wrong thing. The worker runs `check` on every reply
before it commits it (`consumers.job`), and `tokencap audit` runs the same function on rows
already written. The reasons, in the order they are tried:

- ``loop``: the reply's tail is one short span repeated: a span of at most LOOP_MAX_PERIOD
  tokens, repeated back to back at least LOOP_MIN_REPEATS times over at least LOOP_MIN_TOKENS
  tokens at the reply's end (its end-of-turn token, and up to LOOP_TAIL_SLACK last tokens,
  aside). A reply cut at max_new_tokens in
  the middle of a loop is a loop, not only a cut.
- ``length``: cut at max_new_tokens (finish_reason "length").
- ``unclosed_reasoning``: the reply is in a reasoning block (opened by its prompt, which ends
  in the family's start marker; by the reply itself; or assumed by the family's parser) and
  ended without closing it (nor a tool call interrupting it).
- ``empty``: after the reasoning, nothing: only tokens that decode to whitespace, and no
  tool call.

The gate reads token ids only (a worker has no tokenizer): the producer gives each category
its `ReplyMarkers`, the ids of the model family's reasoning and tool-call markers, its
end-of-turn ids and the ids that decode to whitespace (`producer.reply_parser`). Without markers
(token-id prompts and no tokenizer) only ``loop``, ``length`` and a reply of no token at all
(``empty``) are told.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence

from msgspec import Struct

# The loop thresholds, chosen on real model replies (docs/DATA.md, "The reply gate"): no healthy
# reply of the measured set repeats a span this short this often this long at its end.
LOOP_MAX_PERIOD = 256  # tokens in the repeated span, at most
LOOP_MIN_REPEATS = 4  # back-to-back repeats of it, at least
LOOP_MIN_TOKENS = 128  # tokens the repeats cover at the reply's end, at least
# last tokens a loop may leave out: a reply re-encoded from its text (`tokencap audit`) can
# end in a token the cycle never writes (a trailing space encoded alone)
LOOP_TAIL_SLACK = 2


class GateReason(enum.StrEnum):
    """Why a reply is kept out of training."""

    LOOP = "loop"
    LENGTH = "length"
    UNCLOSED_REASONING = "unclosed_reasoning"
    EMPTY = "empty"


class ReplyMarkers(Struct, frozen=True, forbid_unknown_fields=True):
    """A model family's markers as token id sequences, for `check`."""

    reasoning_start: list[int] = []  # empty: the family has no reasoning block
    reasoning_end: list[int] = []
    # sequences that end the reasoning where they start (a tool call begun inside it)
    reasoning_interrupts: list[list[int]] = []
    # the family's parser takes a reply for reasoning from its first token (DeepSeek-R1's,
    # gpt-oss's); else a reply is in a block when its prompt ends in `reasoning_start`
    reasoning_forced: bool = False
    call_starts: list[list[int]] = []  # any of these in the content: the reply makes a call
    end_ids: list[int] = []  # end-of-turn ids (cut from the reply's end)
    blank_ids: list[int] = []  # ids that decode to whitespace only


def find(ids: list[int], marker: Sequence[int], start: int = 0) -> int:
    """Where `marker` first occurs in `ids` at or after `start`, or -1."""
    n = len(marker)
    if n == 0:
        return -1
    want = list(marker)
    at = start
    while True:
        try:
            at = ids.index(want[0], at)  # a C loop: markers are rare in a reply
        except ValueError:
            return -1
        if ids[at:at + n] == want:
            return at
        at += 1


def loop_span(ids: Sequence[int], max_period: int = LOOP_MAX_PERIOD) -> tuple[int, int]:
    """The longest run of one repeated span at the end of `ids`: (period, tokens covered),
    over periods 1..max_period; (0, 0) when there is none. Only the periods at which the
    last token recurs are tried."""
    n = len(ids)
    if n < 2:
        return (0, 0)
    last = ids[-1]
    lo = max(0, n - 1 - min(max_period, n // 2))
    best = (0, 0)
    for j in range(n - 2, lo - 1, -1):
        if ids[j] != last:
            continue
        p = n - 1 - j
        run = 0
        i = n - 1
        while i - p >= 0 and ids[i] == ids[i - p]:
            run += 1
            i -= 1
        covered = run + p
        if run >= p and covered > best[1]:
            best = (p, covered)
    return best


def is_loop(ids: Sequence[int]) -> bool:
    for drop in range(min(LOOP_TAIL_SLACK, len(ids)) + 1):
        period, covered = loop_span(ids[: len(ids) - drop])
        if period > 0 and covered >= LOOP_MIN_TOKENS and covered >= LOOP_MIN_REPEATS * period:
            return True
    return False


def opened_by(prompt_ids: Sequence[int], m: ReplyMarkers, blank: set[int]) -> bool:
    """Whether `prompt_ids` end in an open reasoning block: the start marker, whitespace
    aside (Kimi-K2.5 and DeepSeek-V3.1 with thinking on open it on a user turn, and
    DeepSeek-V3.1 closes it again after a tool result)."""
    if m.reasoning_forced:
        return True
    start = list(m.reasoning_start)
    if not start:
        return False
    end = len(prompt_ids)
    while end > 0 and prompt_ids[end - 1] in blank:
        end -= 1
    return end >= len(start) and list(prompt_ids[end - len(start):end]) == start


def after_reasoning(ids: list[int], m: ReplyMarkers, blank: set[int], opened: bool
                    ) -> list[int] | None:
    """What follows the reply's reasoning block (all of it when it opened none); None when
    the block never closed. `opened`: its prompt opened the block."""
    start = 0
    if m.reasoning_start and not opened:
        at = find(ids, m.reasoning_start)
        # the reply opens its own block (a `<think>` at its start, whitespace aside)
        if at >= 0 and all(t in blank for t in ids[:at]):
            opened, start = True, at + len(m.reasoning_start)
    if not opened or not m.reasoning_end:
        return ids
    end = find(ids, m.reasoning_end, start)
    if end >= 0:
        return ids[end + len(m.reasoning_end):]
    cuts = [at for marker in m.reasoning_interrupts if (at := find(ids, marker, start)) >= 0]
    return ids[min(cuts):] if cuts else None


def check(output_ids: Sequence[int], finish_reason: str,
          markers: ReplyMarkers | None = None, prompt_ids: Sequence[int] = ()
          ) -> GateReason | None:
    """Why the reply `output_ids` (finished with `finish_reason`, answering `prompt_ids`)
    is kept out of training, or None (module docstring)."""
    m = markers or ReplyMarkers()
    ids = list(output_ids)
    while ids and ids[-1] in m.end_ids:
        ids.pop()
    if is_loop(ids):
        return GateReason.LOOP
    if finish_reason == "length":
        return GateReason.LENGTH
    blank = set(m.blank_ids)
    rest = after_reasoning(ids, m, blank, opened_by(prompt_ids, m, blank))
    if rest is None:
        return GateReason.UNCLOSED_REASONING
    if any(find(rest, marker) >= 0 for marker in m.call_starts):
        return None
    if all(t in blank for t in rest):
        return GateReason.EMPTY
    return None
