"""The one stage runner (`tokencap/stack/stage.py`): a small run on the simulator, its producer
here, its writer and workers children of a supervisor: started once the run is created, a
writer and a worker SIGKILLed mid-run started again (each said, the workers as `whose` they
are), all stopped at the end; the run finishes with no id twice and no gap. The hidden-state
stage beside generation (`StatesBeside`, what `tokencap up` runs): a category's states
extracted while another category still generates, every training row's states once at the
end, and both stages shown by `status`, its board and the report. The hidden-state stage's
processes killed are `tests/faults/test_stage_faults.py`'s."""

from __future__ import annotations

import io
import json
import os
import signal
from pathlib import Path

from click.testing import CliRunner
from rich.console import Console

from budget_service.budget import Budget
from budget_service.keys import Keys
from budget_service.telemetry import status_document
from foundation import hsfile
from foundation.config import load_config
from foundation.outputs import BadLine, read_results, states_dir, states_file
from foundation.redisconn import connect
from foundation.units import size_text
from sglang_sim.testing import SimServer
from testing.harness import Pipeline, ledger_state, wait_until
from tests.faults.common import STATES_HIDDEN, STATES_LAYERS, states_config, two_category_config
from tests.helpers import training_row_ids
from tokencap.cli.main import main
from tokencap.reports.report import build_report
from tokencap.reports.watch import watch
from tokencap.stack import processes
from tokencap.stack.stage import Stage, StageRun, StatesBeside
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


def test_beside_generation_a_category_s_states_are_extracted_while_another_generates(
        tmp_path, redis_url) -> None:
    # Given a small category (a) and a large one (b), generated on the simulator, and an
    # extraction server: generation run by the stage runner, the hidden-state stage beside it
    path = states_config(tmp_path, "beside", 6, lease_s=10.0, rows_b=150)
    cfg = load_config(path)
    redis = connect(redis_url)
    gen_budget = Budget(redis, Keys(cfg.key_prefix, cfg.run))
    hs_budget = Budget(redis, Keys(cfg.key_prefix, cfg.run + ".hs"))
    sup = Supervisor(processes.Table(None))
    storage = tmp_path / "engine-files"
    storage.mkdir()
    lines: list[str] = []
    held: dict[str, object] = {}
    with SimServer(time_scale=1000.0) as sim, SimServer(
            flavor="vllm", time_scale=1000.0, extract_hidden_states=True,
            hs_layer_ids=STATES_LAYERS, hs_hidden_size=STATES_HIDDEN, hs_dtype="bfloat16",
            hs_storage_path=str(storage)) as ex:
        gen = StageRun(Stage(cfg, redis_url, sim.url, 2), redis, sup, say=lines.append)
        beside = StatesBeside(cfg, redis_url, 2, sup, extract_url=ex.url, say=lines.append,
                              progress_s=0.2)

        def hold_b_until_a_has_states() -> bool:
            # once the stage started (a's generation ended), generation's producer waits
            # here for a's first states row: b, whose records are not all fed, cannot end
            # meanwhile, so the overlap is the mechanism's to make, not a race's outcome
            if beside.started and not held:
                wait_until(lambda: hs_budget.has_run()
                           and hs_budget.states(["a"])["a"].samples > 0,
                           120, "a's first states row")
                held.update(gen_budget.states(["a", "b"]))
            return False

        # When generation runs to its end, the stage beside it
        status = gen.run(should_stop=hold_b_until_a_has_states, on_states=beside.poll,
                         progress_s=3600.0)
        states = beside.wait()
    assert states is not None and status.ended and states.ended
    rows = {c: dict(training_row_ids(cfg, c)) for c in ("a", "b")}
    assert len(rows["b"]) > len(rows["a"]) > 0
    # Then a's states were extracted while b still generated: when a's first states row was
    # committed, a's generation had ended and b's was open, with rows still to commit
    a_then, b_then = held["a"], held["b"]
    assert a_then.state == "exhausted" and b_then.state == "open"
    assert b_then.samples < status.categories["b"].samples
    # and the files say so: a states row was sent before b's last generated row
    spec = cfg.states()
    hs_rows = {c: [r for r in read_results(Path(spec.output_dir) / c)
                   if not isinstance(r, BadLine)] for c in ("a", "b")}
    gen_b = [r for r in read_results(Path(cfg.output_dir) / "b") if not isinstance(r, BadLine)]
    assert min(r.sent_at_ms for r in hs_rows["a"]) < max(r.sent_at_ms for r in gen_b)
    # the stage's plan said b's rows were those so far; a's rows were listed as its
    # generation ended, b's after
    assert any(ln.startswith("  b: ") and ln.endswith("so far, its generation goes on)")
               for ln in lines)
    listed = [ln for ln in lines if ln.startswith("hidden states of ")]
    assert listed[0].startswith("hidden states of a (its generation exhausted): ")
    assert any(ln.startswith("hidden states of b") for ln in listed[1:])
    # and at the end every training row of both categories has its states, once
    for c in ("a", "b"):
        assert states.categories[c].state == "exhausted"
        assert states.categories[c].samples == len(rows[c])
        assert sorted(r.source_id for r in hs_rows[c]) == sorted(rows[c])
        assert len(list(states_dir(spec.output_dir, c).iterdir())) == len(rows[c])
        for row_id, ids in rows[c].items():
            f = states_file(spec.output_dir, c, row_id)
            hsfile.check(f, hsfile.read(f)[0], ids, len(STATES_LAYERS), STATES_HIDDEN, "BF16")
    assert all(child.poll() is not None for name, child in sup.table.children.items()
               if name.startswith("hs-"))

    # `status` shows both stages (the run found beside its stage, without --run)
    res = CliRunner().invoke(main, ["status", "--redis-url", redis_url],
                             env={"TOKENCAP_RUN": None})
    assert res.exit_code == 0, res.output
    assert "run beside\n" in res.stdout and "run beside.hs\n" in res.stdout
    kept_a = states.state_bytes(states.categories["a"])
    assert kept_a is not None and f"hidden states a: {size_text(kept_a.used)}" in res.stdout
    res = CliRunner().invoke(main, ["status", "--json", "--redis-url", redis_url],
                             env={"TOKENCAP_RUN": None})
    doc = json.loads(res.stdout)
    assert doc["run"] == "beside" and doc["hidden_states"]["run"] == "beside.hs"
    assert {c: st["samples"] for c, st in doc["hidden_states"]["categories"].items()} == {
        c: len(rows[c]) for c in ("a", "b")}
    # its board (plain lines), below the run's
    buf = io.StringIO()
    stage = gen_budget.telemetry.stage()
    assert stage is not None
    watch(gen_budget.telemetry.snapshot, [], gen_budget.telemetry.workers, iterations=1,
          console=Console(file=buf), fetch_stage=stage.snapshot)
    board = buf.getvalue().splitlines()
    assert board[0].startswith("a used=") and any(
        ln.startswith(f"hidden states b rows={len(rows['b'])} bytes=") for ln in board)
    # and the report: the stage's table, its numbers the stage's
    page = build_report(gen_budget, Path(cfg.output_dir), tmp_path / "report").read_text()
    assert '<table id="hidden-states">' in page
    for c in ("a", "b"):
        used = states.state_bytes(states.categories[c])
        assert used is not None
        assert f'data-category="{c}" data-rows="{len(rows[c])}" data-bytes="{used.used}"' in page

