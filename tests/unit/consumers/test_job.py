"""Admission has one owner: what the producer's unpark releases, the worker's admit takes.

Issue 31's scenario, with the real Lua: cap 10,000 tokens counted as prompt + output
(count = "total"), 1,000-token prompts, an expected completion of 300, seven samples in
flight. Unpark used to ask for the completion alone (300) while admit added the prompt
(1,300): unpark released two samples at every commit and admit parked both again.
"""

from __future__ import annotations

from typing import Any

import msgspec
from redis import Redis

from budget_service import jobs
from budget_service.estimator import LengthModel
from budget_service.ledger import now_ms
from consumers import job as worker_job
from foundation.config import Category, RunConfig, SamplingParams
from foundation.wire import JobRef, Pending, Result
from producer.feeder import Producer

PROMPT = 1000
OUTPUT = 300


def _cfg(count: str) -> RunConfig:
    return RunConfig(
        run="adm", output_dir="/tmp/unused", cap_tokens=10_000, count=count,
        expected_tokens=OUTPUT, margin_sigmas=0.0, hard_cap=True,
        category=[Category(name="c", sampling=SamplingParams(max_new_tokens=600),
                           sources=["x"])],
    )


class _Feed:
    """What `Producer.unpark` reads of a category's feed: its category."""

    def __init__(self, cat: Category) -> None:
        self.cat = cat


def _queued(producer: Producer) -> list[JobRef]:
    """The jobs waiting in the category's RQ queue, taken off it."""
    q = producer.queues["c"]
    out = [msgspec.convert(j.args[0], JobRef) for j in q.jobs]
    q.empty()
    return out


def _play(redis: Redis, count: str) -> dict[str, Any]:
    """Feed 30 samples, let the workers admit them, then commit the oldest in flight one at a
    time, unparking after each commit as the producer's tick does, until nothing is left in
    flight. Returns how often a released sample was parked again, and the ledger's end."""
    cfg = _cfg(count)
    cat = cfg.category[0]
    producer = Producer(cfg, redis, None)
    budget = producer.budget
    budget.feeding.init_run(cfg)
    ledger = budget.samples
    model = LengthModel({}, cfg.expected_for(cat), cat.sampling.max_new_tokens)
    pendings = [Pending(sample_id=f"s{i}", ordinal=i, prompt_ids=[7 + i] * PROMPT,
                        sampling={"max_new_tokens": 600}) for i in range(30)]
    ids = budget.feeding.feed("c", 0, len(pendings), now_ms() + 60_000, pendings, [])
    assert ids is not None and len(ids) == 30
    in_flight: list[str] = []
    for p in pendings:  # the producer's first jobs, as it enqueues them
        status, _ = worker_job.admit(ledger, cfg, cat, model,
                                     JobRef("adm", "c", p.sample_id, 0, PROMPT))
        if status == "ok":
            in_flight.append(p.sample_id)
    first = len(in_flight)
    released = bounced = 0
    while in_flight:
        sid = in_flight.pop(0)
        ledger.commit(Result(id=sid, category="c", prompt_ids=[1] * PROMPT,
                             output_ids=[2] * OUTPUT, prompt_tokens=PROMPT,
                             completion_tokens=OUTPUT, finish_reason="stop", text="",
                             sampling={}, counted_tokens=PROMPT + OUTPUT
                             if count == "total" else OUTPUT), 0, 0.0)
        producer.unpark(_Feed(cat), budget.states(["c"])["c"])  # type: ignore[arg-type]
        for ref in _queued(producer):
            released += 1
            status, _ = worker_job.admit(ledger, cfg, cat, model, ref)
            if status == "ok":
                in_flight.append(ref.sample_id)
            elif status == "wait":
                bounced += 1
    st = budget.states(["c"])["c"]
    return {"first": first, "released": released, "bounced": bounced, "state": st}


def test_what_unpark_releases_admit_takes_when_the_prompt_counts(redis: Redis) -> None:
    got = _play(redis, "total")
    assert got["first"] == 7  # 7 x 1,300 < 10,000 <= 8 x 1,300: seven in flight
    assert got["released"] > 0, "the scenario never unparked: nothing tested"
    assert got["bounced"] == 0
    st = got["state"]
    assert st.state == "closed" and st.reserved == 0 and st.worst == 0
    assert st.used <= 10_000 + PROMPT + 600  # below the cap plus one sample's maximum


def test_what_unpark_releases_admit_takes_when_only_the_output_counts(redis: Redis) -> None:
    got = _play(redis, "output")
    assert got["released"] > 0 and got["bounced"] == 0


def test_unpark_sends_the_prompt_tokens_in_the_job_without_reading_each_sample(
        redis: Redis) -> None:
    cfg = _cfg("total")
    producer = Producer(cfg, redis, None)
    producer.budget.feeding.init_run(cfg)
    fed = [Pending(sample_id=s, ordinal=0, prompt_ids=[i] * PROMPT, sampling={})
           for i, s in enumerate("xa")]
    producer.budget.feeding.feed("c", 0, 2, now_ms() + 60_000, fed, [])
    model = LengthModel({}, OUTPUT, 600)
    cat = cfg.category[0]
    assert worker_job.admit(producer.budget.samples, cfg, cat, model,
                            JobRef("adm", "c", "x", 0, PROMPT))[0] == "ok"
    redis.hset(producer.keys.cat("c").state, "used", 8_000)  # 8,000 + 2 x 1,300 > the cap
    assert worker_job.admit(producer.budget.samples, cfg, cat, model,
                            JobRef("adm", "c", "a", 0, PROMPT))[0] == "wait"
    redis.hset(producer.keys.cat("c").state, "used", 0)
    calls: list[str] = []
    real_entries = producer.budget.entries
    producer.budget.entries = (  # type: ignore[method-assign]
        lambda *a: calls.append("entries") or real_entries(*a))
    producer.unpark(_Feed(cat), producer.budget.states(["c"])["c"])  # type: ignore[arg-type]
    [ref] = _queued(producer)
    assert (ref.sample_id, ref.seq, ref.prompt_tokens) == ("a", 1, PROMPT) and calls == []
    assert jobs.JOB_FUNC == "consumers.job.process"


def test_a_full_states_folder_is_tried_more_seldom_the_longer_it_stays_full() -> None:
    from consumers.job import DISK_PAUSE_MAX_S, disk_pause_s

    waits = [disk_pause_s(age, jitter=0.0) for age in (0, 1, 10, 60, 3600)]
    assert waits == sorted(waits) and waits[0] == 1.0 and waits[-1] == DISK_PAUSE_MAX_S
    assert disk_pause_s(10, jitter=0.25) == 5.25


def test_a_kept_file_clears_the_disk_trouble_at_once_where_the_pause_was_seen(
        monkeypatch) -> None:
    # Given a worker that keeps files: the record of a full disk is cleared at most every
    # TROUBLE_CLEAR_S (a Redis call a row cost as much as the commit), but at once by a
    # worker that saw the pause itself
    from types import SimpleNamespace

    calls: list[tuple[str, str | None]] = []
    ledger = SimpleNamespace(record_disk_trouble=lambda f, why, at: calls.append((f, why)))
    rc = SimpleNamespace(cfg=SimpleNamespace(run="r.hs"), ledger=ledger)
    clock = [1000.0]
    monkeypatch.setattr(worker_job.time, "monotonic", lambda: clock[0])
    monkeypatch.setattr(worker_job, "_trouble_cleared", {})
    monkeypatch.setattr(worker_job, "_disk_pauses", set())
    worker_job._room_again(rc, "/hs/a")  # type: ignore[arg-type]
    clock[0] += 1.0
    worker_job._room_again(rc, "/hs/a")  # type: ignore[arg-type]
    assert calls == [("/hs/a", None)]
    worker_job._disk_pauses.add("r.hs")  # this worker saw the disk full
    worker_job._room_again(rc, "/hs/a")  # type: ignore[arg-type]
    assert len(calls) == 2 and "r.hs" not in worker_job._disk_pauses
    clock[0] += worker_job.TROUBLE_CLEAR_S
    worker_job._room_again(rc, "/hs/a")  # type: ignore[arg-type]
    assert len(calls) == 3
