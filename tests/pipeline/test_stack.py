"""A stack you can find: after `tokencap up` (the stack left running), a second shell in the
same directory reaches it with nothing set: `status`, `cap set`, the budget service's
`POST /cap` with the token `tokencap token` prints; `down` stops it."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import requests

from testing.harness import free_port
from tests.faults.common import FAULT_KNOBS
from tests.helpers import STACK_VARS

pytestmark = pytest.mark.starts_stack


def _shell(**extra: str) -> dict[str, str]:
    """A new shell's environment: none of the stack's variables."""
    env = {k: v for k, v in os.environ.items() if k not in STACK_VARS}
    return {**env, **extra}


def _tokencap(cwd: Path, *args: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tokencap.cli", *args], cwd=cwd,
                          env=_shell(**env), capture_output=True, text=True, timeout=180)


def test_a_second_shell_finds_the_stack_up_started(tmp_path) -> None:
    src = tmp_path / "ids.jsonl"
    src.write_text("".join(f'{{"input_ids": [{400 + i}, 5, 6]}}\n' for i in range(200)))
    (tmp_path / "run.toml").write_text(f"""
run = "stack"
output_dir = "out"
{FAULT_KNOBS}
[[category]]
name = "a"
source = "ids.jsonl"
format = "input_ids"
cap_tokens = 3000
sampling = {{ max_new_tokens = 256 }}
""")
    port = free_port()
    up = _tokencap(tmp_path, "up", "run.toml", "--sim", "--workers", "2", "--sim-time-scale",
                   "500", BUDGET_PORT=str(port))
    try:
        assert up.returncode == 0, up.stderr[-2000:]
        assert "`make down` (or `tokencap down`) stops the stack" in up.stdout
        run_file = tmp_path / ".run" / "env"
        assert stat.S_IMODE(run_file.stat().st_mode) == 0o600
        # a second shell, nothing set, in the same directory
        status = _tokencap(tmp_path, "status")
        assert status.returncode == 0, status.stderr
        assert status.stdout.startswith("run stack") and "closed" in status.stdout
        raised = _tokencap(tmp_path, "cap", "set", "a", "20000")
        assert raised.returncode == 0, raised.stderr
        assert raised.stdout.startswith("a: cap 3000 -> 20000 (open)")
        token = _tokencap(tmp_path, "token").stdout.strip()
        url = f"http://127.0.0.1:{port}/cap"
        body = {"category": "a", "cap_tokens": 25000}
        assert requests.post(url, json=body, timeout=10).status_code == 401
        r = requests.post(url, json=body, headers={"Authorization": f"Bearer {token}"},
                          timeout=10)
        assert r.status_code == 200, r.text
        st = requests.get(f"http://127.0.0.1:{port}/status", timeout=10).json()
        assert st["categories"]["a"]["cap"] == 25000
        # both changes are in the run's event log, with who made them
        events = _tokencap(tmp_path, "status", "--events")
        assert events.returncode == 0, events.stderr
        lines = events.stdout.splitlines()
        assert len(lines) == 2 and "a  cap 3000 -> 20000  by tokencap cap set" in lines[0]
        assert "cap 20000 -> 25000  by POST /cap from 127.0.0.1" in lines[1]
        # a second `up` of the same stack while its budget service holds the port: joins it
        before = run_file.read_text()
        again = _tokencap(tmp_path, "up", "run.toml", "--workers", "1",
                          SGLANG_URL="http://127.0.0.1:9", BUDGET_PORT=str(port))
        assert again.returncode == 9 and "port" not in again.stderr  # the engine, not the port
        assert run_file.read_text() == before  # a failed up leaves the run file as it was
        # another run on this stack: refused at once (it waited for ever, its jobs never
        # taken), naming the run served and the ways out; the run file kept
        (tmp_path / "other.toml").write_text((tmp_path / "run.toml").read_text().replace(
            'run = "stack"', 'run = "other"'))
        other = subprocess.run([sys.executable, "-m", "tokencap.cli", "up", "other.toml",
                                "--sim"], cwd=tmp_path, env=_shell(BUDGET_PORT=str(port)),
                               capture_output=True, text=True, timeout=60)
        assert other.returncode == 11, other.stderr[-2000:]
        assert "serves run 'stack'" in other.stderr and "--state-dir .run-other" in other.stderr
        assert run_file.read_text() == before and "Traceback" not in other.stderr
        # RQ's own board of this stack's Redis, from the run file
        rq = _tokencap(tmp_path, "rq-info")
        assert rq.returncode == 0 and "tokencap:stack" in rq.stdout, rq.stdout + rq.stderr
        # from another folder: where each command looked, said
        elsewhere = tmp_path / "elsewhere"
        elsewhere.mkdir()
        lost = _tokencap(elsewhere, "status", "--redis-url", before.split("REDIS_URL=")[1]
                         .split("\n")[0], "--run", "nope")
        assert lost.returncode == 7 and "looked in Redis redis://127.0.0.1:" in lost.stderr
        assert f"{elsewhere / '.run' / 'env'}" in lost.stderr
    finally:
        redis_url = (dict(line.split("=", 1) for line in (tmp_path / ".run" / "env").read_text(
        ).splitlines()) if (tmp_path / ".run" / "env").exists() else {}).get("REDIS_URL", "")
        down = _tokencap(tmp_path, "down")
    assert down.returncode == 0 and "stopped budget" in down.stdout
    assert not (tmp_path / ".run" / "env").exists()
    nothing = _tokencap(tmp_path, "down")  # said, with where it looked, and not a success
    assert nothing.returncode == 7 and f"{tmp_path / '.run' / 'pids'}" in nothing.stderr
    # the stack's Redis is gone with it
    gone = _tokencap(tmp_path, "status", "--redis-url", redis_url)
    assert gone.returncode == 3 and "Traceback" not in gone.stderr


def test_up_names_the_budget_port_that_is_taken(tmp_path) -> None:
    import socket

    (tmp_path / "run.toml").write_text(f"""
run = "p"
output_dir = "out"
{FAULT_KNOBS}
[[category]]
name = "a"
source = "x.jsonl"
format = "input_ids"
sampling = {{ max_new_tokens = 8 }}
""")
    (tmp_path / "x.jsonl").write_text('{"input_ids": [1, 2]}\n')
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        done = _tokencap(tmp_path, "up", "run.toml", "--sim", BUDGET_PORT=str(port))
    assert done.returncode == 1
    assert f"port {port} is taken" in done.stderr and "Traceback" not in done.stderr
    # the way out named as it is spelled now, not the deprecated BUDGET_PORT
    assert "--budget-port 0" in done.stderr and "TOKENCAP_BUDGET_PORT" in done.stderr
    assert not (tmp_path / ".run" / "pids").exists() or not list(
        (tmp_path / ".run" / "pids").glob("*.pid"))


def test_up_exits_2_when_every_record_of_a_category_is_rejected(tmp_path) -> None:
    (tmp_path / "bad.jsonl").write_text("".join('{"input_ids": []}\n' for _ in range(5)))
    (tmp_path / "run.toml").write_text(f"""
run = "allbad"
output_dir = "out"
{FAULT_KNOBS}
[[category]]
name = "a"
source = "bad.jsonl"
format = "input_ids"
cap_tokens = 3000
sampling = {{ max_new_tokens = 16 }}
""")
    try:
        up = _tokencap(tmp_path, "up", "run.toml", "--sim", "--workers", "1",
                       BUDGET_PORT=str(free_port()))
        assert up.returncode == 2, (up.stdout + up.stderr)[-2000:]
        assert "a: every record was rejected (5" in up.stdout
        assert "out/a/failed.jsonl" in up.stdout and "Traceback" not in up.stderr
    finally:
        _tokencap(tmp_path, "down")
