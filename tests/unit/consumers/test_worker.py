"""The tokencap worker's RQ bookkeeping: the worker heartbeat in one round trip, not
repeated within WORKER_BEAT_MIN_S, the worker key kept alive WORKER_TTL_S after a beat
(beaten during a job too), only workers whose key lives counted, and RQ's command channel
listened to by a thread that ends with the worker, once the worker's stop handlers are in
place."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading

import pytest
from redis.exceptions import ConnectionError as RedisConnectionError
from rq import Queue
from rq.command import send_shutdown_command
from rq.exceptions import StopRequested
from rq.worker import SimpleWorker

from budget_service import jobs
from budget_service.jobs import MsgspecSerializer
from budget_service.keys import Keys
from consumers import worker as worker_mod
from consumers.worker import TokencapWorker, _job_beats, make_worker, run_worker
from testing.harness import ROOT, wait_until

KEYS = Keys("tokencap", "hb")


def _worker_script(redis_url: str, run: str, body: str) -> list[str]:
    """Run `body` in a Python of its own (the signals it sends reach only it), after the
    imports and `r` (its Redis) and `keys` (run `run`) every such script uses; what it
    printed, split. It must end cleanly, with no traceback."""
    head = ("import os, signal\n"
            "from redis import Redis\n"
            "from budget_service import jobs\n"
            "from budget_service.keys import Keys\n"
            f"r, keys = Redis.from_url({redis_url!r}), Keys('tokencap', {run!r})\n")
    done = subprocess.run([sys.executable, "-c", head + body], cwd=ROOT, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "Traceback" not in done.stderr
    return done.stdout.split()


def _calls(redis, command: str) -> int:
    return int(redis.info("commandstats").get(f"cmdstat_{command}", {}).get("calls", 0))


def test_repeated_heartbeat_is_one_round_trip_then_skipped(redis) -> None:
    w = make_worker(redis, KEYS, ["q"])
    w.register_birth()
    redis.config_resetstat()
    w.heartbeat()
    w.heartbeat()  # within WORKER_BEAT_MIN_S of the first: skipped
    assert _calls(redis, "hset") == 1
    assert _calls(redis, "expire") == 2  # worker key and executions key, once
    ttl = redis.ttl(w.key)
    assert w.worker_ttl == jobs.WORKER_TTL_S
    assert w.worker_ttl - 2 < ttl <= w.worker_ttl  # not RQ's worker_ttl + 60
    w._beat_sent_at -= worker_mod.WORKER_BEAT_MIN_S  # the last beat is now old enough
    w.heartbeat()
    assert _calls(redis, "hset") == 2


def test_heartbeat_with_its_own_ttl_is_never_skipped(redis) -> None:
    w = make_worker(redis, KEYS, ["q"])
    w.register_birth()
    w.heartbeat()
    w.heartbeat(timeout=7)
    assert 0 < redis.ttl(w.key) <= 7


class _RQBeat(TokencapWorker):
    """The same worker with RQ's own heartbeat (three round trips, never skipped)."""

    heartbeat = SimpleWorker.heartbeat


def _burst(redis, worker_class: type[TokencapWorker], queue: str, jobs: int) -> dict[str, int]:
    q = Queue(KEYS.queue_name(queue), connection=redis, serializer=MsgspecSerializer)
    for i in range(jobs):  # refused (not tokencap's function): still one loop per job
        q.enqueue("builtins.len", [i])
    w = make_worker(redis, KEYS, [queue], worker_class=worker_class)
    redis.config_resetstat()
    run_worker(w, burst=True)
    assert q.count == 0
    return {c: _calls(redis, c) for c in ("expire", "hset")}


def test_burst_worker_beats_with_fewer_commands_than_rq(redis) -> None:
    jobs = 20
    ours = _burst(redis, TokencapWorker, "hb.ours", jobs)
    rq = _burst(redis, _RQBeat, "hb.rq", jobs)
    # RQ's beats before and after each dequeue and after each job: 2 EXPIREs each, skipped
    # here while the one pipelined into the suspension check is under a second old
    assert rq["expire"] - ours["expire"] >= 4 * jobs
    assert rq["hset"] - ours["hset"] >= 2 * jobs


def test_a_worker_in_a_job_beats_its_key_from_a_thread(redis, monkeypatch) -> None:
    monkeypatch.setattr(jobs, "WORKER_BEAT_S", 0.05)
    w = make_worker(redis, KEYS, ["q"])
    w.register_birth()
    w.heartbeat(timeout=jobs.WORKER_TTL_S * 100)  # what RQ asks before a job: cut to the TTL
    assert 0 < redis.ttl(w.key) <= jobs.WORKER_TTL_S
    redis.hset(w.key, "last_heartbeat", "before")
    with _job_beats.during(w):  # as while SimpleWorker runs a job (no beat of its own)
        wait_until(lambda: redis.hget(w.key, "last_heartbeat") != b"before",
                   what="a beat during the job")
    assert 0 < redis.ttl(w.key) <= jobs.WORKER_TTL_S


def test_only_workers_whose_key_lives_count_and_rq_cleans_the_rest(redis) -> None:
    live, killed = make_worker(redis, KEYS, ["count"]), make_worker(redis, KEYS, ["count"])
    for w in (live, killed):
        w.register_birth()
        w.heartbeat()
    registry = f"rq:workers:{KEYS.queue_name('count')}"
    assert jobs.worker_count(redis, KEYS, "count") == 2
    redis.delete(killed.key)  # its last beat is WORKER_TTL_S old: the key expired
    assert jobs.worker_count(redis, KEYS, "count") == 1
    assert redis.scard(registry) == 2  # still registered
    jobs.clean_workers(redis, KEYS, ["count"])
    assert redis.smembers(registry) == {live.key.encode()}


class _Watched(TokencapWorker):
    """Keeps the command listener it had when it unsubscribed."""

    listener: threading.Thread | None = None

    def unsubscribe(self) -> None:
        self.listener = self._commands
        super().unsubscribe()


def test_a_worker_s_command_listener_ends_with_the_worker(redis) -> None:
    """The unsubscribe's reply ends the listener before the worker's end returns (with
    redis-py 8.2, RQ's listener slept on in its 60 s poll and every worker's end waited on
    it: the kill-point and SIGTERM tests timed out)."""
    for i in range(3):
        w = make_worker(redis, KEYS, ["cmd"], name=f"cmd-{i}", worker_class=_Watched)
        run_worker(w, burst=True)  # an empty queue: subscribe, then straight to the end
        assert isinstance(w, _Watched) and w.listener is not None
        assert not w.listener.is_alive()
        assert redis.pubsub_numsub(w.pubsub_channel_name) == [
            (w.pubsub_channel_name.encode(), 0)]


def test_a_stop_sent_as_soon_as_the_worker_listens_ends_it_before_its_first_job(
        redis, redis_url) -> None:
    """RQ's shutdown command is a SIGINT the worker sends itself; RQ installs its handlers
    only after subscribing. One sent right then (CI: `send_shutdown_command` as soon as the
    worker listened) was a KeyboardInterrupt traceback. Here the worker sends it itself the
    moment it has subscribed, as the command's handler does: it ends cleanly, the job
    waiting in its queue untouched."""
    out = _worker_script(redis_url, "hb", (
        "from consumers.worker import TokencapWorker, make_worker, run_worker\n"
        "class Told(TokencapWorker):\n"
        "    def subscribe(self):\n"
        "        super().subscribe()\n"
        "        os.kill(os.getpid(), signal.SIGINT)\n"
        "jobs.queue(r, keys, 'early').enqueue_call(func='os.getcwd')\n"
        "w = make_worker(r, keys, ['early'], name='early', worker_class=Told)\n"
        "run_worker(w, burst=True)\n"
        "print(w.stop_asked, len(jobs.queue(r, keys, 'early')))\n"))
    assert out == ["True", "1"]  # stopped; the job left for another worker
    assert redis.pubsub_numsub("rq:pubsub:early") == [(b"rq:pubsub:early", 0)]


def test_a_worker_told_to_shut_down_on_rq_s_command_channel_does(redis, redis_url) -> None:
    """RQ's commands still reach the worker: `send_shutdown_command` ends an idle one."""
    code = (f"from redis import Redis\n"
            f"from budget_service.keys import Keys\n"
            f"from consumers.worker import make_worker, run_worker\n"
            f"w = make_worker(Redis.from_url({redis_url!r}), Keys('tokencap', 'hb'), ['cmd'],"
            f" name='told')\n"
            f"run_worker(w)\n")
    proc = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        channel = "rq:pubsub:told"
        wait_until(lambda: redis.pubsub_numsub(channel)[0][1] == 1, timeout_s=60,
                   what="the worker to listen on its command channel")
        send_shutdown_command(redis, "told")
        assert proc.wait(60) == 0, proc.stderr.read() if proc.stderr else ""
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.parametrize("noted_by", ["ours while starting", "RQ's when idle"])
def test_a_worker_told_to_stop_is_not_started_again_when_redis_fails_it(
        redis, monkeypatch, noted_by) -> None:
    """A stop noted (by our handler during the bootstrap, or RQ's idle one, which ends the
    loop by raising StopRequested), then Redis gone: the supervisor returns instead of
    starting another worker."""
    made: list[TokencapWorker] = []

    class StoppedThenLost(TokencapWorker):
        def subscribe(self) -> None:
            if noted_by == "ours while starting":
                self._stop_at_start(15, None)  # what a SIGTERM here runs
            else:
                handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
                with pytest.raises(StopRequested):
                    self.request_stop(signal.SIGTERM, None)  # RQ's handler, the worker idle
                for sig, handler in handlers.items():  # RQ put its cold-stop handler in
                    signal.signal(sig, handler)
            raise RedisConnectionError("Redis went away")

    def make(*args, **kwargs):  # the first worker only: another one would run its burst
        made.append(make_worker(*args, **kwargs,
                                worker_class=TokencapWorker if made else StoppedThenLost))
        return made[-1]

    monkeypatch.setattr(worker_mod, "make_worker", make)
    assert worker_mod.supervise(lambda: redis, KEYS, ["lost"], burst=True) == 0
    assert len(made) == 1


def test_a_worker_told_to_stop_mid_job_ends_after_it_and_is_not_started_again(
        redis, redis_url) -> None:
    """A SIGTERM while a job runs reaches RQ's handler, which only notes it (the job is
    finished first): the worker ends after that job, and its supervisor returns instead of
    starting another one (which would take the next job, and run on)."""
    out = _worker_script(redis_url, "busy", (
        "from rq.worker import WorkerStatus\n"
        "from consumers import worker as worker_mod\n"
        "made = []\n"
        "class Busy(worker_mod.TokencapWorker):\n"
        "    def execute_job(self, job, queue):  # the stop comes with a job in hand\n"
        "        self.set_state(WorkerStatus.BUSY)\n"
        "        os.kill(os.getpid(), signal.SIGTERM)\n"
        "        self.set_state(WorkerStatus.IDLE)\n"
        "make = worker_mod.make_worker\n"
        "def made_busy(*args, **kwargs):\n"
        "    made.append(make(*args, **kwargs, worker_class=Busy))\n"
        "    return made[-1]\n"
        "worker_mod.make_worker = made_busy\n"
        "q = jobs.queue(r, keys, 'busy')\n"
        "for _ in range(2):\n"
        "    q.enqueue_call(func='os.getcwd')\n"
        "code = worker_mod.supervise(lambda: r, keys, ['busy'], name='busy')\n"
        "print(code, len(made), made[0].stop_asked, len(q))\n"))
    assert out == ["0", "1", "True", "1"]  # one job taken, the other left
