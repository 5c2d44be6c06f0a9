"""The README's two commands one after the other: `make up` leaves its stack running (budget
service on 8321, its Redis, simulator, writer and workers, the run file in its folder), then
`make test` runs. Every test that starts a stack (marked `starts_stack`) passes beside it,
and the stack is left as it was: the same run file, the same Redis keys and run status, the
same output files, every process alive. In a session that holds this test, those tests run
only here (tests/conftest.py deselects them from the session itself)."""

from __future__ import annotations

import hashlib
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from redis import Redis

from budget_service.keys import Keys
from foundation.config import DEFAULT_BUDGET_PORT
from tests.conftest import ROOT
from tests.faults.common import FAULT_KNOBS
from tests.helpers import STACK_VARS
from tokencap.stack import processes

pytestmark = pytest.mark.slow
INNER_TIMEOUT_S = 600


def _user_shell() -> dict[str, str]:
    """A user's shell: none of the stack's variables, nor the ones this test session set."""
    drop = {*STACK_VARS, "TOKENCAP_PORT", "TOKENCAP_SOURCE_CACHE", "HF_HOME"}
    return {k: v for k, v in os.environ.items() if k not in drop}


def _port_free(port: int) -> bool:
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _snapshot(home: Path) -> dict[str, object]:
    """What must not change: the run file, the processes, the Redis keys and the run's
    counts, the output files."""
    state = home / ".run"
    env = dict(line.split("=", 1) for line in (state / "env").read_text().splitlines())
    # each process as its pid file records it (pid and start time): alive, and the same one
    alive = {p.stem: (processes.read(p), processes.running(processes.read(p), ""))
             for p in (state / "pids").glob("*.pid")}
    redis = Redis.from_url(env["REDIS_URL"])
    # the persistent keys (RQ's job hashes expire by themselves: result_ttl)
    keys = sorted(k.decode() for k in redis.scan_iter(count=1000) if redis.ttl(k) == -1)
    state_key = Keys(env["TOKENCAP_PREFIX"], env["TOKENCAP_RUN"]).cat("a").state
    counts = {k.decode(): v.decode() for k, v in redis.hgetall(state_key).items()}
    redis.close()
    files = {str(p.relative_to(home)): hashlib.sha256(p.read_bytes()).hexdigest()
             for p in sorted((home / "out").rglob("*")) if p.is_file()}
    return {"run file": (state / "env").read_text(), "alive": alive, "keys": keys,
            "category a": counts, "files": files}


@pytest.mark.timeout(INNER_TIMEOUT_S + 240)  # the inner run has its own, INNER_TIMEOUT_S
def test_the_tests_that_start_stacks_pass_beside_a_stack_up_left_running(tmp_path) -> None:
    # Given a stack `tokencap up --sim` started in a user's folder, on the default budget port
    # (when a stack of this machine already holds 8321, that one is the neighbour and ours
    # takes a free port)
    home = tmp_path / "user"
    home.mkdir()
    (home / "ids.jsonl").write_text("".join(f'{{"input_ids": [{400 + i}, 5, 6]}}\n'
                                            for i in range(60)))
    (home / "run.toml").write_text(f"""
run = "neighbour"
output_dir = "out"
{FAULT_KNOBS}
[[category]]
name = "a"
source = "ids.jsonl"
format = "input_ids"
cap_tokens = 2000
sampling = {{ max_new_tokens = 64 }}
""")
    shell = _user_shell()
    if not _port_free(DEFAULT_BUDGET_PORT):
        shell["BUDGET_PORT"] = "0"
    up = subprocess.run([sys.executable, "-m", "tokencap.cli", "up", "run.toml", "--sim",
                         "--workers", "2", "--sim-time-scale", "500"], cwd=home, env=shell,
                        capture_output=True, text=True, timeout=180)
    try:
        assert up.returncode == 0, up.stdout[-2000:] + up.stderr[-2000:]
        before = _snapshot(home)
        assert all(up for _rec, up in before["alive"].values())
        assert {"redis", "sim", "budget", "writer"} <= set(before["alive"])
        # When every test that starts a stack runs, from that folder, in a user's shell
        inner = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-m", "starts_stack", "-p", "no:cacheprovider",
             "--rootdir", str(ROOT), "-c", str(ROOT / "pyproject.toml"),
             "--ignore", str(Path(__file__)), str(ROOT / "tests")],
            cwd=home, env=shell, capture_output=True, text=True, timeout=INNER_TIMEOUT_S)
        # Then they pass, and the stack is as it was
        assert inner.returncode == 0, inner.stdout[-4000:] + inner.stderr[-2000:]
        assert " passed" in inner.stdout.splitlines()[-1]
        assert _snapshot(home) == before
    finally:
        subprocess.run([sys.executable, "-m", "tokencap.cli", "down"], cwd=home, env=shell,
                       capture_output=True, timeout=60)
