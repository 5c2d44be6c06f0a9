"""A worker that dies by SIGKILL right after RQ dequeued a job, before it starts it.

Usage: python -m tests.faults.dequeue_killer REDIS_URL QUEUE [QUEUE...]
"""

from __future__ import annotations

import os
import signal
import sys

from consumers.worker import TokencapWorker, make_worker, run_worker
from tokencap.redisconn import connect


class DiesAfterDequeue(TokencapWorker):
    def execute_job(self, job, queue) -> None:  # noqa: ANN001
        os.kill(os.getpid(), signal.SIGKILL)


if __name__ == "__main__":
    redis = connect(sys.argv[1])
    run_worker(make_worker(redis, sys.argv[2:], worker_class=DiesAfterDequeue), burst=True)
