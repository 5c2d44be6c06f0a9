"""The stack's commands (`tokencap/cli/stack.py`: `up`, `down`, `add-workers`, `token`, `sim`):
what their help says, and the mistakes they refuse in one line before anything is started.
The stack itself is `tests/unit/tokencap/stack/`'s; a whole `up` is
`tests/pipeline/test_stack.py`'s."""

from __future__ import annotations

import sys

from click.testing import CliRunner

from tests.helpers import ids_config, one_line_error
from tokencap.cli.main import main


def _invoke(*args: str, **env: str | None) -> object:
    return CliRunner().invoke(main, list(args), env={"SGLANG_URL": None, "REDIS_URL": None,
                                                    **env})


def test_up_takes_the_connection_flags_and_the_prefixed_variables() -> None:
    out = CliRunner().invoke(main, ["up", "-h"]).output
    assert "--redis-url" in out and "--sglang-url" in out
    assert "TOKENCAP_WORKERS" in out and "TOKENCAP_BUDGET_PORT" in out


def test_up_refuses_the_simulator_and_an_engine_together_before_starting_anything(
        tmp_path) -> None:
    state = tmp_path / "state"
    res = _invoke("up", ids_config(tmp_path), "--sim", "--state-dir", str(state),
                  SGLANG_URL="http://127.0.0.1:9")
    assert one_line_error(res, 1), res.output
    assert "--sim and SGLANG_URL both given" in res.output
    assert not state.exists()  # no Redis, no pid file, no run file


def test_up_without_an_engine_or_a_stack_here_says_how_to_name_one(tmp_path) -> None:
    state = tmp_path / "state"
    res = _invoke("up", ids_config(tmp_path), "--state-dir", str(state))
    assert one_line_error(res, 1), res.output
    assert "no engine: set SGLANG_URL" in res.output and "--sim" in res.output
    assert not state.exists()  # never the simulator by default


def test_up_reads_the_old_variable_names_for_one_more_version_and_says_so(tmp_path) -> None:
    args = ("up", ids_config(tmp_path), "--sim", "--state-dir", str(tmp_path / "state"))
    old = _invoke(*args, SGLANG_URL="http://127.0.0.1:9", WORKERS="3", TOKENCAP_WORKERS=None)
    assert "[up] WORKERS is read for one more version: set TOKENCAP_WORKERS instead" \
        in old.output
    new = _invoke(*args, SGLANG_URL="http://127.0.0.1:9", WORKERS="3", TOKENCAP_WORKERS="3")
    assert "WORKERS is read" not in new.output  # the new name given: the old one is ignored
    assert one_line_error(old, 1) and one_line_error(new, 1)


def test_token_prints_the_stacks_token_or_says_there_is_no_stack(tmp_path) -> None:
    state = tmp_path / ".run"
    res = _invoke("token", "--state-dir", str(state))
    assert one_line_error(res, 1), res.output
    assert f"no stack started by `tokencap up` in {state} (no run file {state / 'env'})" \
        in res.output
    state.mkdir()
    (state / "env").write_text("REDIS_URL=redis://127.0.0.1:9/0\nTOKENCAP_TOKEN=s3cret\n")
    res = _invoke("token", "--state-dir", str(state))
    assert res.exit_code == 0 and res.output == "s3cret\n"


def test_add_workers_needs_one_or_more_and_a_stack(tmp_path) -> None:
    state = tmp_path / "state"
    assert one_line_error(_invoke("add-workers", "0", "--state-dir", str(state)))
    res = _invoke("add-workers", "2", "--state-dir", str(state))
    assert one_line_error(res, 1) and "no stack is running here" in res.output
    assert not (state / "pids").exists()


def test_down_with_nothing_started_says_where_it_looked_and_is_no_success(tmp_path) -> None:
    res = _invoke("down", "--state-dir", str(tmp_path / "state"))
    assert res.exit_code == 7 and "nothing to stop" in res.output
    assert f"{(tmp_path / 'state' / 'pids').resolve()}" in res.output


def test_sim_passes_its_arguments_on_to_the_simulator(monkeypatch) -> None:
    monkeypatch.setattr(sys, "argv", list(sys.argv))  # `sim` sets the simulator's argv
    own = CliRunner().invoke(main, ["sim", "-h"])  # -h is the simulator's
    assert own.exit_code == 0 and "--time-scale" in own.output
    res = CliRunner().invoke(main, ["sim", "--help"])  # --help is the command's
    assert res.exit_code == 0 and "python -m sglang_sim" in res.output
