"""A test session killed at once (`make test` interrupted, a pytest process SIGKILLed: no
teardown runs) leaves no process it started behind: each dies with it (`tests/conftest.py`
and `testing/harness.py` start them with Linux's parent-death signal)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from foundation.waiting import wait_until
from tests.conftest import ROOT
from tests.interrupted_child import PIDS_ENV
from tokencap.stack.processes import identity

pytestmark = pytest.mark.slow

START_S = 120.0  # the child session's start: a redis-server, a simulator, two workers
END_S = 30.0  # what a worker's SIGTERM takes: it ends between samples


def test_a_killed_test_session_leaves_no_process_it_started(tmp_path) -> None:
    pids_file = tmp_path / "pids"
    child = subprocess.Popen(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--timeout", "900",
         "tests/interrupted_child.py"], cwd=ROOT, env={**os.environ, PIDS_ENV: str(pids_file)},
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        wait_until(lambda: pids_file.exists() and pids_file.read_text().endswith("\n"),
                   START_S, "the child session to start its processes")
        pids = [int(p) for p in pids_file.read_text().split()]
        assert len(pids) == 3 and all(identity(p) is not None for p in pids)
        os.kill(child.pid, signal.SIGKILL)  # the session dies at once: no teardown
        child.wait(END_S)
        wait_until(lambda: all(identity(p) is None for p in pids), END_S,
                   "the processes the killed session started to end")
    finally:
        if child.poll() is None:
            os.killpg(child.pid, signal.SIGKILL)
            child.wait()
