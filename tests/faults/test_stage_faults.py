"""The hidden-state stage's own processes killed while it runs: its workers and its writer
SIGKILLed, all at once and one at a time. The one stage runner (`tokencap/stack/stage.py`)
starts each again (the writer once the killed one's lease ran out), and the stage finishes
with every training row's states kept once, each file checked against its row."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from foundation import hsfile
from foundation.config import load_config
from foundation.outputs import BadLine, read_results, states_dir, states_file
from sglang_sim.testing import SimServer
from testing.harness import started
from tests.faults.common import STATES_HIDDEN, STATES_LAYERS, states_config
from tests.helpers import training_row_ids
from tokencap import extraction
from tokencap.stack import processes
from tokencap.stack.stage import run_hidden_states
from tokencap.stack.supervisor import Supervisor

pytestmark = pytest.mark.slow

LAYERS, HIDDEN = STATES_LAYERS, STATES_HIDDEN
ROWS = 80  # per category
STALL_S = 0.1  # each extraction takes this long: the stage runs for seconds, not ms
WORKERS = 3


def _kept(cfg_path: Path) -> int:
    spec = load_config(cfg_path).states()
    return sum(len(list(states_dir(spec.output_dir, c).glob("*.safetensors")))
               for c in ("a", "b"))


@pytest.mark.parametrize("how", ["all at once", "one at a time"])
def test_stage_workers_and_writer_killed_are_replaced_and_every_row_kept_once(
        tmp_path, redis_url, how) -> None:
    # Given a finished generation run and an extraction server that takes its time
    path = states_config(tmp_path, "stagefaults", ROWS)
    cfg = load_config(path)
    with SimServer(time_scale=1000.0) as sim, started(cfg, redis_url, [sim.url], 2) as pipe:
        pipe.check_invariants(pipe.run())
    rows = {c: dict(training_row_ids(cfg, c)) for c in ("a", "b")}
    storage = tmp_path / "engine-files"
    storage.mkdir()
    sup = Supervisor(processes.Table(None))
    names = [extraction.STATES_PREFIX + n for n in
             ("writer", *(f"worker-{i}" for i in range(WORKERS)))]
    # kill points: files kept before each kill; what each kill takes
    plan = ([(10, names)] if how == "all at once"
            else [(8 + 12 * k, [name]) for k, name in enumerate(names)])
    killed: list[tuple[str, int]] = []

    def kill_at_points() -> bool:
        while plan and _kept(path) >= plan[0][0]:
            for name in plan.pop(0)[1]:
                child = sup.table.children[name]
                os.kill(child.pid, signal.SIGKILL)
                killed.append((name, child.pid))
        return False

    # When the stage runs and its processes are SIGKILLed
    with SimServer(flavor="vllm", time_scale=1000.0, extract_hidden_states=True,
                   hs_layer_ids=LAYERS, hs_hidden_size=HIDDEN, hs_dtype="bfloat16",
                   hs_storage_path=str(storage), stall_s=STALL_S) as ex:
        status = run_hidden_states(cfg, redis_url, WORKERS, extract_url=ex.url,
                                sup=sup, should_stop=kill_at_points, progress_s=0.2,
                                say=lambda line: None)

    # Then every kill happened and each killed process was started again
    assert not plan, f"the stage ended before every kill point: {plan}, {_kept(path)} kept"
    assert sorted(n for n, _ in killed) == sorted(names)
    for name, pid in killed:
        assert sup.table.spawned.count(name) >= 2, f"{name} was not started again"
        assert sup.table.children.get(name) is None or sup.table.children[name].pid != pid
    assert all(child.poll() is not None for child in sup.table.children.values())
    # and the stage finished with every row's states kept once, each checked against its row
    spec = cfg.states()
    for c in ("a", "b"):
        assert status.categories[c].state == "exhausted"
        assert status.categories[c].samples == len(rows[c]) > 0
        results = [r for r in read_results(Path(spec.output_dir) / c)
                   if not isinstance(r, BadLine)]
        assert sorted(r.source_id for r in results) == sorted(rows[c])  # once each
        files = sorted(states_dir(spec.output_dir, c).iterdir())
        assert len(files) == len(rows[c])  # no stray or temporary file
        for row_id, ids in rows[c].items():
            f = states_file(spec.output_dir, c, row_id)
            hsfile.check(f, hsfile.read(f)[0], ids, len(LAYERS), HIDDEN, "BF16")
