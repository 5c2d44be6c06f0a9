"""The producer killed between any two of its Redis calls while it feeds, reaps or unparks:
a new producer finishes the run, and every fed sample still ends in exactly one terminal
state.

A kill is a `Killed` raised by the producer's Redis client at its k-th round trip, either
before the command is sent or after its reply arrived (the command ran, the producer never
learnt it), for every k of one producer tick. Nothing catches `Killed` (it is not an
`Exception`), so nothing of the tick after that point runs: what SIGKILL does.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec
import pytest
from redis import Redis
from rq import Queue

from budget_service.ledger import now_ms
from consumers.job import configure
from consumers.worker import make_worker, run_worker
from foundation.config import RunConfig
from foundation.wire import Pending
from producer.run import build_producer
from sglang_sim.testing import SimServer
from testing.harness import Pipeline, ledger_entry, wait_until
from tests.conftest import write_config
from writer.writer import Writer

pytestmark = pytest.mark.slow

PROMPTS = 4
LEASE_S = 0.3


class Killed(BaseException):
    """Stands for SIGKILL: nothing after it runs, nothing catches it."""


class DyingRedis(Redis):  # type: ignore[type-arg]
    """A client that counts its round trips and dies at round trip `die_at`."""

    die_at: int | None = None
    after = False
    trips = 0

    def _trip(self, send: Callable[[], Any]) -> Any:
        self.trips += 1
        dying = self.trips == self.die_at
        if dying and not self.after:
            raise Killed(f"before round trip {self.trips}")
        out = send()
        if dying:
            raise Killed(f"after round trip {self.trips}")
        return out

    def execute_command(self, *args: Any, **options: Any) -> Any:
        return self._trip(lambda: super(DyingRedis, self).execute_command(*args, **options))

    def pipeline(self, transaction: bool = True, shard_hint: Any = None) -> Any:
        pipe = super().pipeline(transaction, shard_hint)
        execute = pipe.execute
        pipe.execute = lambda raise_on_error=True: self._trip(lambda: execute(raise_on_error))
        return pipe


def make_config(tmp: Path, name: str) -> RunConfig:
    src, src_b = tmp / "ids.jsonl", tmp / "ids-b.jsonl"
    for path, base in ((src, 400), (src_b, 400 + PROMPTS)):  # no prompt in both categories
        if not path.exists():
            path.write_text("".join(json.dumps({"input_ids": [base + i, 5, 6]}) + "\n"
                                    for i in range(PROMPTS)))
    out = tmp / name
    return write_config(tmp, f"""
run = "kill"
sampling_defaults = "engine"
output_dir = "{out}"
lease_s = {LEASE_S}
high_water = {PROMPTS}
max_attempts = 20
[[category]]
name = "a"
source = "{src}"
format = "input_ids"
cap_tokens = 1000000
sampling = {{ max_new_tokens = 64 }}
[[category]]
name = "b"
source = "{src_b}"
format = "input_ids"
cap_tokens = 1000000
sampling = {{ max_new_tokens = 64 }}
""", name=f"{name}.toml")


def queued_job_ids(pipe: Pipeline, category: str) -> list[str]:
    return Queue(pipe.keys.queue_name(category), connection=pipe.redis).get_job_ids()


def take_jobs(pipe: Pipeline, category: str, sids: list[str]) -> None:
    """The jobs of `sids` leave the queue, as if a worker dequeued them."""
    q = Queue(pipe.keys.queue_name(category), connection=pipe.redis)
    for sid in sids:
        seq = ledger_entry(pipe.budget, category, sid).seq
        q.remove(pipe.keys.job_id(category, sid, seq))


def fed_ids(pipe: Pipeline, category: str) -> list[str]:
    return sorted(pipe.budget.redis.hkeys(pipe.keys.cat(category).pending), key=bytes.decode)


# -- scenarios: the state the killed tick finds --------------------------------------------

def nothing_fed(pipe: Pipeline) -> None:
    """A new run: the tick feeds both categories."""


def workers_died_and_retries_are_due(pipe: Pipeline) -> None:
    """Everything fed; a worker died with two samples of `a` in flight, one sample of `a` is
    due for a retry, one of b's jobs waits in the queue with an expired lease: the tick
    reaps."""
    producer = build_producer(pipe.cfg, pipe.redis, None)
    producer.tick()
    a = [s.decode() for s in fed_ids(pipe, "a")]
    take_jobs(pipe, "a", a[:3])
    for sid in a[:2]:
        assert pipe.budget.samples.admit("a", sid, 64, lease_ms=1)[0] == "ok"
    raw = pipe.redis.hget(pipe.keys.cat("a").pending, a[2])
    p = msgspec.json.decode(raw, type=Pending)
    pipe.budget.samples.release("a", msgspec.structs.replace(p, failures=1), now_ms() - 1)
    pipe.budget.feeding.keep_lease("b", fed_ids(pipe, "b")[0].decode(), now_ms() - 1)
    # the three leases expire at once; a's fourth sample (its job still queued) expires
    # after lease_s, maybe before this check on a loaded machine: either way the tick reaps
    wait_until(lambda: set(a[:3]) <= set(pipe.budget.feeding.expired("a", now_ms(), 100)),
               what="the leases to expire")


def samples_parked_with_room_now(pipe: Pipeline) -> None:
    """Everything fed; in `a` three samples wait in the park behind one in flight whose
    estimate has shrunk since (room now); in `b`, closed since, two wait in the park. The
    in-flight samples' worker died (their leases expire at once). The tick unparks a's
    and holds b's back (a closed category's parked samples are not final)."""
    producer = build_producer(pipe.cfg, pipe.redis, None)
    producer.tick()
    a = [s.decode() for s in fed_ids(pipe, "a")]
    b = [s.decode() for s in fed_ids(pipe, "b")]
    take_jobs(pipe, "a", a[:4])
    take_jobs(pipe, "b", b[:3])
    assert pipe.budget.samples.admit("a", a[0], 900_000, lease_ms=1)[0] == "ok"
    assert pipe.budget.samples.admit("b", b[0], 64, lease_ms=1)[0] == "ok"
    for sid in a[1:4]:
        assert pipe.budget.samples.admit("a", sid, 900_000, lease_ms=1)[0] == "wait"
    for sid in b[1:3]:
        assert pipe.budget.samples.admit("b", sid, 2_000_000, lease_ms=1)[0] == "wait"
    assert pipe.budget.samples.heartbeat("a", a[0], 64, lease_ms=1)  # room for the parked ones now
    pipe.budget.operating.set_cap("b", 0)
    assert pipe.budget.telemetry.status()["categories"]["a"]["parked"] == 3


SCENARIOS = {
    "feed": nothing_fed,
    "reap": workers_died_and_retries_are_due,
    "unpark": samples_parked_with_room_now,
}


def killed_tick(pipe: Pipeline, die_at: int | None, after: bool) -> int:
    """One producer tick on a client that dies at round trip `die_at`; the trips it made."""
    client = DyingRedis.from_url(pipe.redis_url)
    producer = build_producer(pipe.cfg, client, None)
    producer.recovery.reaped_at = float("-inf")  # this tick reaps
    client.trips, client.die_at, client.after = 0, die_at, after
    try:
        producer.tick()
    except Killed:
        pass
    finally:
        client.close()
    return client.trips


def finish(pipe: Pipeline, sim_url: str) -> dict[str, Any]:
    """A new producer, a writer and a worker (all in this process, in turn) take the run to
    its end."""
    producer = pipe.build()
    names = [c.name for c in pipe.cfg.category]
    writer = Writer(pipe.redis, pipe.keys, names, Path(pipe.cfg.output_dir))
    configure(pipe.redis_url, [sim_url], pipe.cfg.key_prefix)

    def step() -> bool:
        producer.tick()
        run_worker(make_worker(pipe.redis, pipe.keys, names), burst=True)
        writer.recover()
        writer.drain_once(block_ms=None)
        return producer.finished()

    try:
        wait_until(step, timeout_s=60, what="the run to finish")
    finally:
        writer.close()
    producer.recovery.finalize()
    return pipe.budget.telemetry.status()


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_producer_killed_at_every_point_of_a_tick(tmp_path, redis, redis_url,
                                                  scenario: str) -> None:
    setup = SCENARIOS[scenario]
    with SimServer(time_scale=1000.0) as sim:
        # Given the tick's round trips, counted once without a kill
        pipe = Pipeline(make_config(tmp_path, f"{scenario}-count"), redis_url, [sim.url])
        setup(pipe)
        trips = killed_tick(pipe, None, False)
        assert trips >= 4, f"{scenario}: the tick made only {trips} round trips"
        for k in range(1, trips + 1):
            for after in (False, True):
                # When the producer dies at that point
                redis.flushdb()
                name = f"{scenario}-{k}-{'after' if after else 'before'}"
                pipe = Pipeline(make_config(tmp_path, name), redis_url, [sim.url])
                setup(pipe)
                killed_tick(pipe, k, after)
                # Then a new producer finishes the run, and every fed sample is final once
                status = finish(pipe, sim.url)
                try:
                    pipe.check_invariants(status)
                except AssertionError as exc:
                    raise AssertionError(f"killed {name}: {exc}") from None
                st = status["categories"]
                assert st["a"]["samples"] + st["b"]["samples"] + st["b"]["skipped"] \
                    == 2 * PROMPTS, (name, st)
