"""`producer/followups.py`: what the producer feeds besides new records, against the real
ledger (`Budget` on the test Redis) and a `CategorySource` over a small JSONL source with the
Qwen2.5 fixture tokenizer. Dead samples `tokencap retry` sent back are fed again by `follow`
(their jobs enqueued through the `enqueue` it was given); a conversation's next turn is fed
from the turn the writer wrote, at the queue's front; a closed category reports one cut
record per held turn, once."""

from __future__ import annotations

import json
from pathlib import Path

import msgspec
import pytest
from redis import Redis

from budget_service.budget import Budget
from budget_service.keys import Keys
from budget_service.ledger import CategoryState, now_ms, turn_event
from foundation.config import RunConfig
from foundation.wire import DeadLetter, Outcome, Pending, Result, turn_id
from producer.followups import FollowUps
from producer.render import Renderer
from producer.source import CategorySource
from testing.harness import final_marks, ledger_entry
from tests.conftest import QWEN, write_config
from tests.helpers import LEASE_MS

CAT = "chat"
CONTEXT = 4096
CHATS = [  # line 1: three assistant turns; line 2: two; line 3: a single question
    [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."},
     {"role": "user", "content": "How are you?"}, {"role": "assistant", "content": "Fine."},
     {"role": "user", "content": "Bye"}, {"role": "assistant", "content": "Goodbye."}],
    [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "Red."},
     {"role": "user", "content": "Another?"}, {"role": "assistant", "content": "Blue."}],
    [{"role": "user", "content": "What is 2 + 2?"}],
]

Jobs = list[tuple[str, list[tuple[str, int, int]], bool]]


@pytest.fixture(scope="module")
def qwen() -> Renderer:
    return Renderer(QWEN)


def config(tmp: Path, turns: str) -> RunConfig:
    (tmp / "src.jsonl").write_text("".join(json.dumps({"messages": m}) + "\n" for m in CHATS))
    return write_config(tmp, f"""
run = "conv"
output_dir = "out"
tokenizer = "{QWEN}"
cap_tokens = 100000
[[category]]
name = "{CAT}"
source = "src.jsonl"
turns = "{turns}"
sampling = {{ max_new_tokens = 32 }}
""")


class Setup:
    """The run's ledger, the category's source, and `FollowUps` recording its enqueues."""

    def __init__(self, tmp: Path, redis: Redis, qwen: Renderer, turns: str) -> None:
        self.cfg = config(tmp, turns)
        self.budget = Budget(redis, Keys("tokencap", self.cfg.run))
        self.budget.feeding.init_run(self.cfg)
        self.source = CategorySource.open(self.cfg, self.cfg.category[0], qwen, CONTEXT)
        self.jobs: Jobs = []
        self.followups = FollowUps(
            self.cfg, self.budget, qwen,
            lambda c, refs, front: self.jobs.append((c, list(refs), front)), None)

    def state(self) -> CategoryState:
        return self.budget.states([CAT])[CAT]

    def feed(self, positions: list[int]) -> list[Pending]:
        """Feed the records at `positions` as the producer's tick does."""
        fed, rejected = self.source.prepare([self.source.read(p) for p in positions])
        assert rejected == []
        at = self.budget.feeding.cursor(CAT)
        ids = self.budget.feeding.feed(CAT, at, at + len(fed), now_ms() + LEASE_MS, fed, [])
        assert ids == [p.sample_id for p in fed]
        return fed

    def dead(self, sid: str, reason: str) -> None:
        """A worker admits `sid` and it fails on every try."""
        self.budget.samples.admit(CAT, sid, 10, LEASE_MS)
        assert self.budget.samples.fail(DeadLetter(sid, CAT, Outcome.DEAD, reason))

    def letters(self) -> list[DeadLetter]:
        """The dead-letter stream (what the writer writes to failed.jsonl / stopped.jsonl)."""
        return [msgspec.json.decode(f[b"r"], type=DeadLetter)
                for _id, f in self.budget.redis.xrange(self.budget.keys.cat(CAT).dead)]


def test_a_dead_sample_sent_back_by_retry_is_fed_again(tmp_path, redis, qwen) -> None:
    run = Setup(tmp_path, redis, qwen, "first")
    first, second = run.feed([0, 2])
    run.dead(first.sample_id, "server_error")
    run.dead(second.sample_id, "timeout")
    assert run.followups.follow(run.source, run.state(), 10) == 0  # nothing waits yet
    assert run.budget.operating.retry(CAT, "server_error") == (1, 0)
    st = run.state()
    assert (st.followups, st.failed) == (1, 1)
    assert run.followups.follow(run.source, st, 0) == 0  # no room: nothing fed
    assert run.jobs == []
    assert run.followups.follow(run.source, st, 10) == 1
    # one job, at the back of the queue, with the prompt rendered again from the record
    assert run.jobs == [(CAT, [(first.sample_id, 0, len(first.prompt_ids))], False)]
    again = ledger_entry(run.budget, CAT, first.sample_id).pending
    assert again is not None and again.prompt_ids == first.prompt_ids
    st = run.state()
    assert (st.followups, st.pending, st.failed) == (0, 1, 1)
    assert final_marks(run.budget, CAT) == {second.sample_id: "d:timeout"}
    # fed once: nothing waits any more
    assert run.followups.follow(run.source, st, 10) == 0
    assert len(run.jobs) == 1


def test_a_retried_sample_whose_record_is_gone_is_rejected(tmp_path, redis, qwen) -> None:
    run = Setup(tmp_path, redis, qwen, "first")
    gone = Pending(sample_id="src:9", ordinal=8, prompt_ids=[1, 2, 3], sampling={})
    assert run.budget.feeding.feed(CAT, 0, 1, now_ms() + LEASE_MS, [gone], []) == ["src:9"]
    run.dead("src:9", "server_error")
    assert run.budget.operating.retry(CAT) == (1, 0)
    assert run.followups.follow(run.source, run.state(), 10) == 1
    assert run.jobs == [(CAT, [], False)]  # nothing to enqueue
    assert final_marks(run.budget, CAT) == {"src:9": "r:source_changed"}
    [letter] = [d for d in run.letters() if d.reason == "source_changed"]
    assert letter.id == "src:9" and "no record has this id" in letter.message


def written_turn(run: Setup, pos: int, reply: str, qwen: Renderer) -> Result:
    """Turn 1 of the conversation at `pos`, generated as `reply` and written."""
    [p] = run.feed([pos])
    out = qwen.encode(reply) + [qwen.eos_token_id]
    return Result(id=p.sample_id, category=CAT, prompt_ids=p.prompt_ids, output_ids=out,
                  prompt_tokens=len(p.prompt_ids), completion_tokens=len(out),
                  finish_reason="stop", text=reply, sampling={}, counted_tokens=len(out),
                  ordinal=pos, conversation_id=p.conversation_id, turn=1,
                  turns_total=p.turns_total)


def test_the_next_turn_is_fed_from_the_written_turn_at_the_front(tmp_path, redis, qwen) -> None:
    run = Setup(tmp_path, redis, qwen, "all")
    row = written_turn(run, 0, "Hi there!", qwen)
    ev = turn_event(row)
    assert ev is not None and ev.next_id == turn_id("src:1", 2)
    run.budget.feeding.restore_followups(CAT, [ev])  # as the writer's acknowledge leaves it
    assert run.followups.follow(run.source, run.state(), 10) == 1
    [(cat, [(sid, seq, tokens)], front)] = run.jobs
    assert (cat, sid, seq, front) == (CAT, "src:1#t2", 0, True)
    p = ledger_entry(run.budget, CAT, sid).pending
    assert p is not None and tokens == len(p.prompt_ids)
    assert (p.conversation_id, p.turn, p.turns_total, p.prefix_consistent) == (
        "src:1", 2, 3, True)
    # turn 2's prompt is turn 1's prompt and output, then the source's next user turn
    assert p.prompt_ids[:len(row.prompt_ids) + len(row.output_ids)] == (
        row.prompt_ids + row.output_ids)
    text = qwen.decode(p.prompt_ids)
    assert "Hi there!" in text and "Hello." not in text and "How are you?" in text


def test_a_next_turn_whose_record_changed_stops_its_conversation(tmp_path, redis,
                                                                 qwen) -> None:
    run = Setup(tmp_path, redis, qwen, "all")
    row = written_turn(run, 0, "Hi there!", qwen)
    ev = turn_event(msgspec.structs.replace(row, id="other:1#t1", conversation_id="other:1"))
    assert ev is not None
    run.budget.feeding.restore_followups(CAT, [ev])  # its record's position holds src:1
    assert run.followups.follow(run.source, run.state(), 10) == 1
    assert run.jobs == [(CAT, [], True)]
    [letter] = run.letters()
    assert (letter.id, letter.outcome, letter.reason, letter.where) == (
        "other:1#t2", Outcome.STOPPED, "source_changed", "../src.jsonl:1")


def test_a_closed_category_reports_each_held_turn_once(tmp_path, redis, qwen) -> None:
    run = Setup(tmp_path, redis, qwen, "all")
    rows = [written_turn(run, 0, "Hi there!", qwen), written_turn(run, 1, "Green.", qwen)]
    events = [turn_event(r) for r in rows]
    run.budget.feeding.restore_followups(CAT, [e for e in events if e is not None])
    closed, _old = run.budget.operating.set_cap(CAT, 0)
    assert closed
    st = run.state()
    assert (st.state, st.followups) == ("closed", 2)
    assert run.followups.report_cut(run.source, st) == 2
    cut = sorted(run.letters(), key=lambda d: d.id)
    assert [(d.id, d.outcome, d.reason, d.conversation_id, d.turn, d.turns_total, d.where)
            for d in cut] == [
        ("src:1#t2", Outcome.CUT, "cap", "src:1", 2, 3, "../src.jsonl:1"),
        ("src:2#t2", Outcome.CUT, "cap", "src:2", 2, 2, "../src.jsonl:2"),
    ]
    # once: neither this producer nor a new one reports them again
    assert run.followups.report_cut(run.source, run.state()) == 0
    fresh = FollowUps(run.cfg, run.budget, qwen, lambda *a: None, None)
    assert fresh.report_cut(run.source, run.state()) == 0
    assert len(run.letters()) == 2
    # a cut turn is not an end: it still waits, and nothing was enqueued
    assert run.state().followups == 2 and final_marks(run.budget, CAT) == {}
    assert run.jobs == []
