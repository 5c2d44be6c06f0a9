"""The plain-RQ baseline of the ceiling scenario: a no-op job and a SimpleWorker to run it.

`python -m bench.noop REDIS_URL QUEUE [--burst]` runs one plain `rq.SimpleWorker` (default
pickle serializer, default result TTL) with the `work()` arguments a tokencap worker uses
(no scheduler, WARNING logging), so the only difference left is tokencap's own work.
"""

from __future__ import annotations

import subprocess
import sys

_session = None
# how long a stopped plain RQ worker is given before it is killed
STOP_GRACE_S = 15.0


def noop() -> None:
    """The job: nothing."""


def generate(url: str, input_ids: list[int], max_new_tokens: int) -> int:
    """A job that only makes the engine call a tokencap job makes (keep-alive session)."""
    global _session
    import requests

    if _session is None:
        _session = requests.Session()
    body = {"input_ids": input_ids, "sampling_params": {"max_new_tokens": max_new_tokens}}
    resp = _session.post(f"{url}/generate", json=body, timeout=(3.05, 60))
    resp.raise_for_status()
    return int(resp.json()["meta_info"]["completion_tokens"])


def main(argv: list[str]) -> int:
    from redis import Redis
    from rq import Queue
    from rq.worker import SimpleWorker

    url, queue = argv[0], argv[1]
    redis = Redis.from_url(url)
    worker = SimpleWorker([Queue(queue, connection=redis)], connection=redis)
    worker.work(burst="--burst" in argv, with_scheduler=False, logging_level="WARNING")
    return 0


def stop(procs: list[subprocess.Popen], terminate: bool = True) -> list[int]:
    """End the plain RQ workers `procs` once their figures are taken: SIGTERM (not for burst
    workers, `terminate` False: they end on their own), then SIGKILL for any still alive
    STOP_GRACE_S later. Returns the pids killed. A plain RQ 3.0 worker can outlive its stop
    by up to a minute: its teardown sends UNSUBSCRIBE and waits for redis-py's pubsub
    thread (redis-py >= 8.2 joins it), and a thread that read the reply before the stop
    flag was cleared sleeps through another of RQ's 60 s polls. tokencap's worker listens
    with a thread of its own (consumers/worker.py)."""
    if terminate:
        for p in procs:
            p.terminate()
    killed = []
    for p in procs:
        try:
            p.wait(STOP_GRACE_S)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
            killed.append(p.pid)
    return killed


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
