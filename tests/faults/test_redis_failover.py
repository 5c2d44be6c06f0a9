"""A run that outlives its Redis host: a master, a replica and a Sentinel on loopback, the run
pointed at `redis+sentinel://`; the master is killed mid-run, Sentinel promotes the replica,
every client follows it, and what asynchronous replication lost is rebuilt from the files
(no id twice, `used` equals the files)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
from redis import Redis

from foundation.redisconn import parse_sentinel_url
from sglang_sim.testing import SimServer
from testing.harness import (
    RedisServer,
    find_redis_server,
    free_port,
    ledger_state,
    started,
    wait_until,
)
from tests.faults.common import Background, two_category_config

pytestmark = pytest.mark.slow

MASTER = "tokencap-test"


class Sentinel:
    """`redis-server --sentinel` (the binary Debian's redis-sentinel package links to)
    watching one master, quorum 1, a master down after 1 s."""

    def __init__(self, workdir: Path, master_port: int) -> None:
        self.port = free_port()
        workdir.mkdir(parents=True, exist_ok=True)
        conf = workdir / "sentinel.conf"
        conf.write_text(f"""port {self.port}
bind 127.0.0.1
dir {workdir}
sentinel monitor {MASTER} 127.0.0.1 {master_port} 1
sentinel down-after-milliseconds {MASTER} 1000
sentinel failover-timeout {MASTER} 10000
sentinel parallel-syncs {MASTER} 1
""")
        binary = find_redis_server()
        assert binary is not None
        self.proc = subprocess.Popen([binary, str(conf), "--sentinel"],
                                     stdout=(workdir / "sentinel.log").open("ab"),
                                     stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        self.client = Redis(port=self.port)
        wait_until(self._up, what="the sentinel")

    def _up(self) -> bool:
        try:
            return bool(self.client.ping())
        except Exception:
            return False

    def master_port(self) -> int:
        host, port = self.client.sentinel_get_master_addr_by_name(MASTER)
        return int(port)

    def replicas_known(self) -> int:
        return len(self.client.sentinel_slaves(MASTER))

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait(10)


def test_sentinel_urls_read_as_rq_and_redis_py_take_them() -> None:
    s = parse_sentinel_url("redis+sentinel://:pw@h1:26379,h2:26380/mymaster/2")
    assert s.sentinels == [("h1", 26379), ("h2", 26380)] and s.master == "mymaster"
    assert (s.db, s.password) == (2, "pw")
    assert parse_sentinel_url("redis+sentinel://h:1/m").db == 0
    for bad in ("redis+sentinel://h:1", "redis+sentinel://h/m", "redis+sentinel://h:1/m/x"):
        with pytest.raises(ValueError, match="redis\\+sentinel"):
            parse_sentinel_url(bad)


def test_the_master_killed_mid_run_the_replica_takes_over_and_the_run_finishes(
        tmp_path) -> None:
    master = RedisServer(tmp_path / "master").start()
    replica = RedisServer(tmp_path / "replica",
                          extra=["--replicaof", "127.0.0.1", str(master.port)]).start()
    wait_until(lambda: replica.client.info("replication")["master_link_status"] == "up",
               what="the replica in sync")
    sentinel = Sentinel(tmp_path / "sentinel", master.port)
    try:
        wait_until(lambda: sentinel.replicas_known() >= 1, timeout_s=30,
                   what="the sentinel to find the replica")
        url = f"redis+sentinel://127.0.0.1:{sentinel.port}/{MASTER}/0"
        cfg = two_category_config(tmp_path, cap_a=16000, cap_b=10000)
        with SimServer(time_scale=60.0) as sim, started(cfg, url, [sim.url], 4) as pipe:
            bg = Background(pipe).start()
            wait_until(lambda: sum(ledger_state(pipe.budget, c)["used"] for c in ("a", "b"))
                       >= 6000, timeout_s=60, what="progress")
            master.kill()  # the host is gone: what the replica has not got is lost
            wait_until(lambda: sentinel.master_port() == replica.port, timeout_s=60,
                       what="Sentinel to promote the replica")
            status = bg.join(180)
        pipe.check_invariants(status)  # no id twice, used == the files, nothing lost
        for c in ("a", "b"):
            assert status["categories"][c]["state"] == "closed"
        assert replica.client.info("replication")["role"] == "master"
    finally:
        sentinel.stop()
        replica.kill()
        master.kill()
