"""Not collected by itself (no `test_` in its name): the session that
tests/pipeline/test_interrupted_session.py starts and kills. Its one test starts what a
pipeline test starts (a private redis-server, a simulator, worker processes), writes their
pids, and waits to be killed."""

from __future__ import annotations

import os
import threading
from pathlib import Path

from sglang_sim.testing import SimServer
from testing.harness import Pipeline
from tests.faults.common import two_category_config

PIDS_ENV = "TOKENCAP_CHILD_PIDS"
WAIT_S = 600.0  # longer than the parent waits: it kills this session first


def test_waits_with_its_processes_until_killed(tmp_path, redis_server, redis_url) -> None:
    cfg = two_category_config(tmp_path)
    with SimServer(time_scale=1000.0) as sim:
        pipe = Pipeline(cfg, redis_url, [sim.url])
        workers = pipe.start_workers(2, wait=True)
        pids = [redis_server.proc.pid, *(w.pid for w in workers)]
        Path(os.environ[PIDS_ENV]).write_text("".join(f"{p}\n" for p in pids))
        threading.Event().wait(WAIT_S)
