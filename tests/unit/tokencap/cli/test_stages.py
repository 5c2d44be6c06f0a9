"""The commands that run one stage of a run (`tokencap/cli/stages.py`: `run`, `hidden-states`,
`worker`, `writer`, `serve`): what their help says they do and change, and the mistakes they
refuse in one line before they touch a run. The stages themselves run in
`tests/pipeline/` and `tests/unit/tokencap/stack/test_stage.py`."""

from __future__ import annotations

import socket

import pytest
from click.testing import CliRunner
from redis import Redis

from budget_service.budget import Budget
from budget_service.keys import Keys
from tests.helpers import ids_config, make_cfg, one_line_error, row_result, write_run
from tokencap.cli.main import main

NO_REDIS = "redis://127.0.0.1:1/0"  # nothing listens there: a command that needs Redis fails



@pytest.mark.parametrize(("command", "words"), [
    ("run", ["Run the producer", "--dry-run", "committed samples are never fed again"]),
    ("hidden-states", ["--extract-url", "TOKENCAP_EXTRACT_URL", "--plan", "resumes"]),
    ("worker", ["RQ worker", "--pool", "SIGTERM"]),
    ("writer", ["fsync, then ack", "--supervise", "exits 8"]),
    ("serve", ["POST /cap", "TOKENCAP_TOKEN", "--record-s"]),
])
def test_each_stage_command_says_what_it_does_and_changes(command, words) -> None:
    res = CliRunner().invoke(main, [command, "--help"])
    assert res.exit_code == 0
    text = " ".join(res.output.split())
    for word in words:
        assert word in text, (command, word)


def test_a_dry_run_shows_the_first_prompt_and_needs_no_redis(tmp_path) -> None:
    res = CliRunner().invoke(main, ["run", ids_config(tmp_path), "--dry-run",
                                    "--redis-url", NO_REDIS])
    assert res.exit_code == 0, res.output
    assert res.output.startswith("=== a · ") and "prompt tokens: " in res.output
    assert '"max_new_tokens":8' in res.output
    assert not (tmp_path / "out").exists()  # nothing fed, nothing written


def test_a_worker_without_an_engine_is_refused_before_it_takes_a_job() -> None:
    res = CliRunner().invoke(main, ["worker", "--redis-url", NO_REDIS],
                             env={"SGLANG_URL": None})
    assert one_line_error(res, 1), res.output
    assert "no engine: set --sglang-url or SGLANG_URL" in res.output


@pytest.mark.parametrize("argv", [["worker", "--pool", "0"],
                                  ["hidden-states", "x.toml", "--workers", "0"]])
def test_a_pool_of_no_process_is_a_usage_error(argv) -> None:
    assert one_line_error(CliRunner().invoke(main, argv))


def test_hidden_states_without_an_extraction_server_says_where_to_name_one(tmp_path) -> None:
    hs = tmp_path / "hs"
    path = ids_config(tmp_path, f'[hidden_states]\nmodel_config = "{tmp_path / "model.json"}"\n'
                             f'output_dir = "{hs}"')
    res = CliRunner().invoke(main, ["hidden-states", path, "--redis-url", NO_REDIS],
                             env={"TOKENCAP_EXTRACT_URL": None})
    assert one_line_error(res, 1), res.output
    assert "no extraction server: pass --extract-url, set TOKENCAP_EXTRACT_URL or " \
           "hidden_states.engine_url" in res.output
    assert not hs.exists()  # no rows file written


def test_hidden_states_plan_says_the_bytes_and_writes_nothing(tmp_path) -> None:
    hs = tmp_path / "hs"
    path = ids_config(tmp_path, f'[hidden_states]\nmodel_config = "{tmp_path / "model.json"}"\n'
                             f'output_dir = "{hs}"')
    res = CliRunner().invoke(main, ["hidden-states", path, "--plan"])
    assert res.exit_code == 0, res.output
    # no generation yet: no rows, nothing to write
    assert "bytes per token" in res.output and "a: 0 rows, 0 tokens" in res.output
    assert "fits the free space" in res.output and not hs.exists()


def test_hidden_states_plan_on_a_disk_too_small_says_the_plan_then_refuses(
        tmp_path, monkeypatch) -> None:
    import shutil

    from foundation.errors import DiskFull

    hs = tmp_path / "hs"
    path = ids_config(tmp_path, f'[hidden_states]\nmodel_config = "{tmp_path / "model.json"}"\n'
                             f'output_dir = "{hs}"')
    write_run(tmp_path / "out", {"a": [row_result("a", "s0", [1, 2], [3, 4, 5])]})
    real_usage = shutil.disk_usage
    monkeypatch.setattr(shutil, "disk_usage", lambda p: real_usage(p)._replace(free=0))
    res = CliRunner().invoke(main, ["hidden-states", path, "--plan"])
    assert one_line_error(res, DiskFull.exit_code), res.output
    # the plan that explains the refusal comes first, then the refusal
    assert res.output.index("a: 1 rows, 5 tokens") < res.output.index("0.00 GB free")
    assert "fits the free space" not in res.output and not hs.exists()


def test_serve_on_a_port_taken_says_so_in_one_line(redis: Redis, redis_url) -> None:
    Budget(redis, Keys("tokencap", "t")).feeding.init_run(make_cfg(cap=1000))
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        res = CliRunner().invoke(main, ["serve", "--redis-url", redis_url, "--run", "t",
                                        "--port", str(port), "--record-s", "0"])
    assert one_line_error(res, 1), res.output
    assert f"cannot serve on 127.0.0.1:{port}" in res.output
    assert "--port / TOKENCAP_PORT picks another" in res.output
