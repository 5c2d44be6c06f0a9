"""The one stage runner (`tokencap/stack/stage.py`): a small run on the simulator, its producer
here, its writer and workers children of a supervisor: started once the run is created, a
writer and a worker SIGKILLed mid-run started again (each said, the workers as `whose` they
are), all stopped at the end; the run finishes with no id twice and no gap. The hidden-state
stage's processes killed are `tests/faults/test_stage_faults.py`'s."""

from __future__ import annotations

import os
import signal

from budget_service.telemetry import status_document
from foundation.redisconn import connect
from sglang_sim.testing import SimServer
from testing.harness import Pipeline, ledger_state
from tests.faults.common import two_category_config
from tokencap.stack import processes
from tokencap.stack.stage import Stage, StageRun
from tokencap.stack.supervisor import Supervisor


def test_a_stage_starts_its_processes_and_starts_again_a_writer_and_a_worker_killed(
        tmp_path, redis_url) -> None:
    # Given a run of two categories on the simulator, and a stage runner with two workers
    cfg = two_category_config(tmp_path, "stagerun", cap_a=3000, cap_b=2000, max_new=64)
    sup = Supervisor(processes.Table(None))
    lines: list[str] = []
    killed: dict[str, int] = {}
    with SimServer(time_scale=200.0) as sim:
        runner = StageRun(Stage(cfg, redis_url, sim.url, 2, whose="the test's"),
                          connect(redis_url), sup, say=lines.append)

        def kill_once_under_way() -> bool:
            # the writer and a worker SIGKILLed once the first tokens are committed (the run
            # cannot end until a writer writes again), and reaped: the stage's next look
            # finds both gone, and starts both again at its look after that
            if not killed and int(ledger_state(runner.budget, "a")["used"] or 0) > 0:
                for name in ("writer", "worker-0"):
                    child = sup.table.children[name]
                    os.kill(child.pid, signal.SIGKILL)
                    child.wait()
                    killed[name] = child.pid
            return False

        # When the stage runs and its processes are killed
        status = runner.run(should_stop=kill_once_under_way, progress_s=3600.0)
    # Then it started them once the run was created, and each killed one again, saying so
    assert killed, "the run ended before anything was committed"
    assert lines[0] == "2 worker(s) started (2 in all)"
    assert "the run's writer was gone: started another (stagerun)" in lines
    assert "1 of the test's 2 worker(s) were gone: started again" in lines
    spawned = sup.table.spawned
    assert (spawned.count("writer"), spawned.count("worker-0"), spawned.count("worker-1")) == (
        2, 2, 1)
    assert all(sup.table.children[name].pid != pid for name, pid in killed.items())
    # and stopped them all at the end (not the stack's: nothing kept)
    assert all(child.poll() is not None for child in sup.table.children.values())
    assert sup.specs == {}
    # and the run finished whole: every sample once, used == the files
    assert status.ended
    Pipeline(cfg, redis_url, [sim.url]).check_invariants(status_document(status))
