"""`tokencap/cli/find_run.py`: a run is always named before it is touched. Every command
says which run, on which Redis, under which prefix, and where each came from; a command that
changes a run refuses one found only by a fallback; the prefix comes from the run file like
the URL does."""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner
from redis import Redis

from budget_service.budget import Budget
from budget_service.keys import Keys
from testing.harness import ledger_state
from tests.helpers import make_cfg, one_line_error
from tokencap.cli.main import main
from tokencap.stack.runfile import RUN_FILE


@pytest.fixture
def run_in_redis(redis: Redis) -> Budget:
    budget = Budget(redis, Keys("tokencap", "t"))
    budget.feeding.init_run(make_cfg(cap=1000))
    return budget


def invoke(tmp: Path, *args: str) -> object:
    """The command with a state dir that holds no run file, and no connection variables."""
    return CliRunner().invoke(main, [*args, "--state-dir", str(tmp / "no-stack")],
                              env={"TOKENCAP_RUN": None, "REDIS_URL": None,
                                   "TOKENCAP_PREFIX": None, "TOKENCAP_STATE_DIR": None})


@pytest.mark.parametrize("command", [["cap", "set", "code", "5000"], ["retry"],
                                     ["report"]])
def test_a_command_that_changes_a_run_refuses_the_only_run_it_found_by_fallback(
        tmp_path, redis_url, run_in_redis, command) -> None:
    res = invoke(tmp_path, *command, "--redis-url", redis_url)
    assert res.exit_code != 0 and "Traceback" not in res.output
    assert "found only by a fallback" in res.output and "--run t" in res.output
    assert ledger_state(run_in_redis, "code")["cap"] == 1000  # nothing changed


def test_named_the_same_command_acts_and_says_on_what(tmp_path, redis_url,
                                                     run_in_redis) -> None:
    res = invoke(tmp_path, "cap", "set", "code", "5000", "--redis-url", redis_url,
                 "--run", "t")
    assert res.exit_code == 0, res.output
    assert f"run t on {redis_url} (prefix tokencap; run from flag, Redis from flag)" \
        in res.stderr
    assert ledger_state(run_in_redis, "code")["cap"] == 5000


def test_reading_a_run_found_by_fallback_is_allowed_and_named(tmp_path, redis_url,
                                                              run_in_redis) -> None:
    res = invoke(tmp_path, "status", "--json", "--redis-url", redis_url)
    assert res.exit_code == 0, res.output
    assert "run t on" in res.stderr and "the only run in this Redis" in res.stderr
    assert res.stdout.lstrip().startswith("{")  # the document alone on stdout


def test_the_prefix_comes_from_the_run_file_like_the_url(tmp_path, redis, redis_url) -> None:
    budget = Budget(redis, Keys("custom", "mine"))
    budget.feeding.init_run(make_cfg(cap=1000))
    state = tmp_path / ".run"
    state.mkdir()
    (state / RUN_FILE).write_text(f"REDIS_URL={redis_url}\nTOKENCAP_RUN=mine\n"
                                  "TOKENCAP_PREFIX=custom\n")
    runner = CliRunner()
    res = runner.invoke(main, ["cap", "set", "code", "7000", "--state-dir", str(state)],
                        env={"TOKENCAP_RUN": None, "REDIS_URL": None, "TOKENCAP_PREFIX": None})
    assert res.exit_code == 0, res.output
    assert "(prefix custom; run from run file, Redis from run file)" in res.stderr
    assert ledger_state(budget, "code")["cap"] == 7000


def test_a_run_that_is_not_there_exits_7(redis_url) -> None:
    out = CliRunner().invoke(main, ["status", "--redis-url", redis_url, "--run", "nope"])
    assert out.exit_code == 7 and "run 'nope' not found" in out.output


def test_without_a_run_name_the_only_run_is_taken_and_no_run_or_several_are_said(
        tmp_path, redis, redis_url) -> None:
    res = invoke(tmp_path, "status", "--redis-url", redis_url)
    assert one_line_error(res, 7) and "no tokencap run: looked in Redis redis://127.0.0.1:" \
        in res.output and "under prefix 'tokencap'" in res.output
    for run in ("one", "two"):
        Budget(redis, Keys("tokencap", run)).feeding.init_run(make_cfg(cap=1000))
    res = invoke(tmp_path, "status", "--redis-url", redis_url)
    assert one_line_error(res, 1) and "several runs in Redis (one, two): pick one with --run" \
        in res.output
    # another prefix is another namespace: its only run is found there
    Budget(redis, Keys("other", "three")).feeding.init_run(make_cfg(cap=1000))
    res = invoke(tmp_path, "status", "--json", "--redis-url", redis_url, "--prefix", "other")
    assert res.exit_code == 0, res.output
    assert "run three on" in res.stderr and "(prefix other;" in res.stderr
