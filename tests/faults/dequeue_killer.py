"""A worker that dies by SIGKILL right after RQ dequeued a job, before it starts it.

Usage: python -m tests.faults.dequeue_killer REDIS_URL PREFIX RUN CATEGORY [CATEGORY...]
"""

from __future__ import annotations

import os
import signal
import sys

from budget_service.keys import Keys
from consumers.worker import TokencapWorker, make_worker, run_worker
from foundation.redisconn import connect


class DiesAfterDequeue(TokencapWorker):
    def execute_job(self, job, queue) -> None:
        os.kill(os.getpid(), signal.SIGKILL)


if __name__ == "__main__":
    redis = connect(sys.argv[1])
    keys = Keys(sys.argv[2], sys.argv[3])
    run_worker(make_worker(redis, keys, sys.argv[4:], worker_class=DiesAfterDequeue), burst=True)
