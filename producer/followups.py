"""Follow-ups: what the producer feeds besides new records (what the ledger's `follow` set
holds): conversations' next turns and retried samples, and the cut records of conversations
a closed category holds back.

With ``turns = "all"`` a record is one generation per assistant turn. Once the writer wrote
turn j (`FeedingLedger.followups` lists it), turn j+1's prompt is the source up to that turn with
the model's own earlier turns (`producer.replay`, the copy the conversations export uses too),
rendered and checked against turn j's by `CategorySource.prepare`.
It goes to the queue's front: the engine that served turn j still holds its prefix. When
turn j's tool calls depart from the calls the source's next results answer (another
function, fewer, none, more: `Conversation.divergence`), turn j+1 is not fed: a result is
never handed to a call it does not answer; the conversation stops, `tool_divergence` in
`stopped.jsonl` naming both sides (with `on_tool_divergence = "replay"` only another
function stops it).

In a category of single samples, what waits there are dead samples `tokencap retry` sent
back; they are fed again from their records, found by id.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

from budget_service.budget import Budget
from budget_service.ledger import CategoryState, now_ms
from foundation.config import RunConfig
from foundation.wire import DeadLetter, Outcome, split_turn_id
from producer.formats.records import Rejected
from producer.readers.index import Sample
from producer.replay import Replay
from producer.reply_parser import Unparsed
from producer.source import CategorySource, NextTurn

if TYPE_CHECKING:
    from producer.render import Renderer

log = logging.getLogger(__name__)


class FollowUps:
    """Feeds next turns and retried samples, and reports cut conversations, per category.

    `enqueue(category, [(sample id, seq, prompt tokens)], at_front)` enqueues the jobs of
    what the ledger recorded; `affinity(ids)` gives a prompt's affinity key (None: off)."""

    def __init__(self, cfg: RunConfig, budget: Budget, renderer: Renderer | None,
                 enqueue: Callable[[str, list[tuple[str, int, int]], bool], None],
                 affinity: Callable[[list[int]], str] | None) -> None:
        self.cfg = cfg
        self.budget = budget
        self.renderer = renderer
        self.enqueue = enqueue
        self.affinity = affinity
        self.lease_ms = cfg.lease_ms
        self.replay = Replay(cfg, renderer)
        self._cut_marks: dict[str, tuple[int, int]] = {}  # `report_cut`: what was reported

    def follow(self, source: CategorySource, st: CategoryState, room: int) -> int:
        """Feed up to `room` next turns of conversations whose last turn the writer wrote.
        In a category of single samples, what waits there are dead samples sent again."""
        if room <= 0 or not st.followups:
            return 0
        name = source.cat.name
        waiting = self.budget.feeding.followups(name, room)
        if not source.turns:
            return self.feed_retried(source, [f.sample_id for f in waiting])
        stop_ids = source.cat.sampling.stop_token_ids or []
        samples: list[Sample] = []
        turns: list[NextTurn] = []
        rejected: list[DeadLetter] = []
        for f in waiting:
            conv_id, turn = split_turn_id(f.sample_id) or (f.sample_id, 1)
            try:
                s = source.read(f.ordinal)
            except Rejected as exc:
                s = None
                why = f"the record cannot be read any more: {exc}"
            else:
                why = "the source changed: the record at its position is another one"
            if s is None or s.sample_id != conv_id or s.conversation is None \
                    or turn > s.conversation.turns or any(o is None for o in f.outputs):
                if s is not None and any(o is None for o in f.outputs):
                    why = "the outputs of its earlier turns are gone from Redis"
                log.error("%s/%s: conversation cut: %s", name, f.sample_id, why)
                rejected.append(DeadLetter(
                    id=f.sample_id, category=name, outcome=Outcome.STOPPED,
                    reason="source_changed", message=why, where=source.where(f.ordinal),
                    conversation_id=conv_id, turn=turn))
                continue
            conv = s.conversation
            opened = self.replay.opened(source.cat, source.mode_of(conv_id))
            try:
                generated = self.replay.turns(f.outputs, conv.tools, conv_id, stop_ids,
                                              opened)
            except Unparsed as exc:
                # the turn stays as generated; there is no call to answer and no content
                log.warning("%s/%s: conversation stops: a reply does not parse (%s)", name,
                            f.sample_id, exc)
                rejected.append(DeadLetter(
                    id=f.sample_id, category=name, outcome=Outcome.STOPPED,
                    reason="unparsed_reply",
                    message=f"the reply of {exc}; kept as generated, the conversation cannot "
                            "go on from it", where=source.row_where(s.where),
                    conversation_id=conv_id, turn=turn,
                    turns_total=conv.turns))
                continue
            div = conv.divergence(generated)
            if div is not None and (self.cfg.on_tool_divergence == "stop"
                                    or div.kind == "other_name"):
                # the model's turn stays (what it said after a faithful history); the source's
                # results answer other calls, so the conversation cannot go on faithfully
                log.info("%s/%s: conversation stops: tool calls diverge (%s)", name,
                         f.sample_id, div.message)
                rejected.append(DeadLetter(
                    id=f.sample_id, category=name, outcome=Outcome.STOPPED,
                    reason="tool_divergence", message=f"{div.kind}: {div.message}",
                    where=source.row_where(s.where), conversation_id=conv_id, turn=turn,
                    turns_total=conv.turns))
                continue
            samples.append(s)
            turns.append(NextTurn(self.replay.history(conv, generated, conv_id), turn,
                                  self.replay.history(conv, generated[:-1], conv_id),
                                  list(f.outputs[-1] or []),
                                  generated[-1], conv.replay_notes(generated), f.engine,
                                  conv.args_match(generated)))
        prepared, bad = source.prepare(samples, turns, self.affinity)
        recorded = set(self.budget.feeding.feed_follow(name, now_ms() + self.lease_ms, prepared,
                                               rejected + bad))
        # ahead of the new samples waiting: the engine that served the turn before still
        # holds its prefix
        self.enqueue(name, [(p.sample_id, 0, len(p.prompt_ids)) for p in prepared
                            if p.sample_id in recorded], True)
        return len(waiting)

    def feed_retried(self, source: CategorySource, ids: list[str]) -> int:
        """Feed again the dead samples `tokencap retry` sent back, found by their ids."""
        name = source.cat.name
        samples: list[Sample] = []
        rejected: list[DeadLetter] = []
        for sid in ids:
            pos = source.locate(sid)
            try:
                if pos is None:
                    raise Rejected("source_changed", "no record has this id any more")
                samples.append(source.read(pos))
            except Rejected as exc:
                log.error("%s/%s: cannot be sent again: %s", name, sid, exc)
                rejected.append(DeadLetter(id=sid, category=name, outcome=Outcome.REJECTED,
                                           reason=exc.reason, message=str(exc)))
        prepared, bad = source.prepare(samples, None, self.affinity)
        ids_fed = set(self.budget.feeding.feed_follow(name, now_ms() + self.lease_ms, prepared,
                                              rejected + bad))
        self.enqueue(name, [(p.sample_id, 0, len(p.prompt_ids)) for p in prepared
                            if p.sample_id in ids_fed], False)
        if ids_fed:
            log.info("%s: %d dead sample(s) sent again", name, len(ids_fed))
        return len(ids)

    def report_cut(self, source: CategorySource, st: CategoryState) -> int:
        """A closed category holds back conversations' next turns: write one cut record for
        each (once), so the files say why those conversations stopped."""
        name = source.cat.name
        mark = (st.followups, st.parked)
        if mark == self._cut_marks.get(name) or not any(mark):
            return 0
        self._cut_marks[name] = mark
        turns = [(sid, ordinal, split) for sid, ordinal in self.budget.feeding.held(name)
                 if (split := split_turn_id(sid)) is not None and split[1] >= 2]
        parked = self.budget.entries(name, [sid for sid, ordinal, _ in turns if ordinal is None])
        pending = {e.pending.sample_id: e.pending for e in parked if e.pending is not None}
        letters = []
        for sid, ordinal, (conv, turn) in turns:  # turn 1 held: not a conversation yet
            p = pending.get(sid)
            where, total = (p.where, p.turns_total) if p is not None else ("", 0)
            if ordinal is not None and ordinal < len(source):
                where = source.where(ordinal)
                try:
                    conversation = source.read(ordinal).conversation
                    total = conversation.turns if conversation else 0
                except Rejected:
                    pass
            letters.append(DeadLetter(
                id=sid, category=name, outcome=Outcome.CUT, reason="cap", where=where,
                message="the category closed (its cap) before this turn was sent; a raised "
                        "cap sends it", conversation_id=conv, turn=turn, turns_total=total))
        return self.budget.feeding.cut(name, letters)
