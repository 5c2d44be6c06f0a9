"""The servers of a local stack (`tokencap/stack/services.py`): the simulator's family for the
run's tokenizer; the stack's Redis started once and found again (by its pid file, else by its
data folder), started again on its port after it was killed; the budget service and the
simulator kept running: killed, each is started again where it was, and said so."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest
import requests
from redis import Redis

from budget_service.budget import Budget
from budget_service.keys import Keys
from foundation.engine.info import healthy
from testing.harness import child_env, wait_until
from tests.conftest import FIXTURES, QWEN, write_config
from tests.helpers import make_cfg
from tokencap.stack import processes
from tokencap.stack.localredis import free_port
from tokencap.stack.services import PROGRAMS, Services, answers, sim_family
from tokencap.stack.supervisor import Supervisor


def stack(state: Path, lines: list[str]) -> Services:
    """The servers of the stack in `state`, as a new `up` finds them."""
    return Services(state, Supervisor(processes.Table(state, PROGRAMS)), lines.append)


def killed(services: Services, name: str) -> None:
    """SIGKILL the child `name` and reap it: its pid file names no live process now."""
    child = services.procs.children[name]
    child.kill()
    child.wait()


@pytest.mark.parametrize(("tokenizer", "family"), [
    (None, ()), (QWEN, ("--family", "qwen25")), (FIXTURES / "tokenizers" / "qwen3",
                                                 ("--family", "qwen3")),
    (FIXTURES / "tokenizers" / "qwen3-coder", ("--family", "qwen3_coder")),
    (FIXTURES / "tokenizers" / "phi-3-mini", ())])  # a family the simulator does not play
def test_the_simulator_answers_in_the_grammar_of_the_runs_model_family(
        tmp_path, tokenizer, family) -> None:
    if tokenizer is None:  # token ids, no tokenizer: no family
        head, fmt, record = "", "input_ids", '{"input_ids": [1, 2]}'
    else:
        head, fmt, record = f'tokenizer = "{tokenizer}"\n', "prompt", '{"prompt": "Hi"}'
    (tmp_path / "src.jsonl").write_text(record + "\n")
    cfg = write_config(tmp_path, f'run = "r"\noutput_dir = "{tmp_path / "out"}"\n{head}'
                       f'sampling_defaults = "engine"\n[[category]]\nname = "a"\n'
                       f'source = "{tmp_path / "src.jsonl"}"\nformat = "{fmt}"\n'
                       "sampling = { max_new_tokens = 8 }\n")
    assert sim_family(cfg) == family


def test_the_stacks_redis_is_started_once_found_again_and_restarted_on_its_port(
        tmp_path) -> None:
    state, lines = tmp_path / "state", []
    first = stack(state, lines)
    assert first.redis("redis://10.0.0.5:6380/0", {}) == "redis://10.0.0.5:6380/0"
    assert lines == [] and not state.exists()  # REDIS_URL given: used as is, nothing started
    url = first.redis(None, {})
    try:
        data = (state / "redis").resolve()
        assert lines[-1].startswith("started redis-server ") and f"with AOF in {data}" \
            in lines[-1]
        client = Redis.from_url(url)
        assert client.config_get("appendonly") == {"appendonly": "yes"}
        assert client.config_get("maxmemory-policy")["maxmemory-policy"] == "noeviction"
        client.close()
        pid = first.procs.children["redis"].pid
        # a second `up`: the run file names it and its pid file says it runs
        second = stack(state, lines)
        assert second.redis(None, {"REDIS_URL": url}) == url and second.procs.spawned == []
        # its pid file lost (or wrong): told by its data folder, the pid file written again
        (state / "pids" / "redis.pid").unlink()
        third = stack(state, lines)
        assert third.redis(None, {"REDIS_URL": url}) == url and third.procs.spawned == []
        assert lines[-1] == (f"the stack's redis-server answers on {url} (pid {pid}): pid file "
                             "written again")
        assert processes.read(state / "pids" / "redis.pid").pid == pid
        # killed with the node: started again on the port the run file names
        killed(first, "redis")
        again = stack(state, lines)
        assert again.redis(None, {"REDIS_URL": url}) == url and answers(url)
        assert lines[-2].startswith("stale pid file(s) replaced: redis ")
        assert lines[-1].startswith("started redis-server ")
    finally:
        processes.Table(state, PROGRAMS).stop(["redis"], 10.0, 0.1)
    assert not answers(url)


def test_a_killed_budget_service_is_started_again_on_its_port(tmp_path, redis: Redis,
                                                              redis_url) -> None:
    Budget(redis, Keys("tokencap", "t")).feeding.init_run(make_cfg())
    state, lines = tmp_path / "state", []
    # Given a pid file a killed stack left
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    (state / "pids").mkdir(parents=True)
    (state / "pids" / "budget.pid").write_text(f"{gone.pid}\nanother-boot:1\n")
    services = stack(state, lines)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = child_env(REDIS_URL=redis_url, TOKENCAP_RUN="t", TOKENCAP_PREFIX="tokencap",
                    TOKENCAP_TOKEN="tok")

    def serves() -> bool:
        try:
            return requests.get(f"{url}/status", timeout=5).status_code == 200
        except requests.ConnectionError:
            return False

    try:
        # When `up` starts its budget service
        services.budget_service(port, env, first=True)
        assert lines[0].startswith("stale pid file(s) replaced: budget ")
        assert lines[1].startswith(f"live page on {url}/ ") and len(lines) == 2
        wait_until(serves, what="the budget service to answer")
        # and it is killed while `up` feeds
        killed(services, "budget")
        services.budget_service(port, env, first=False)  # seen dead: its restart is due soon
        assert not services.sup.alive("budget") and len(lines) == 2
        services.sup._restarts["budget"].due_at = time.monotonic()  # its delay has passed
        services.budget_service(port, env, first=False)
        # Then it is started again on its port, and said so
        assert lines[2:] == [f"the budget service was gone: started again on {url}"]
        wait_until(serves, what="the budget service to answer again")
        assert services.procs.spawned == ["budget", "budget"]
    finally:
        services.sup.stop(timeout_s=10)


def test_a_killed_simulator_is_started_again_where_it_was_and_a_second_up_joins_it(
        tmp_path) -> None:
    state, lines = tmp_path / "state", []
    services = stack(state, lines)
    url = services.simulator({}, 100.0, None, ())
    try:
        assert lines == [f"started the SGLang simulator (no GPU) on {url}, time x100"]
        joined = stack(state, lines)
        assert joined.simulator({"SGLANG_URL": url}, 100.0, None, ()) == url
        assert joined.procs.spawned == [] and "sim" in joined.sup.specs  # kept, not started
        killed(services, "sim")
        services.tend_simulator()  # seen dead: its restart is due soon
        services.sup._restarts["sim"].due_at = time.monotonic()  # its delay has passed
        services.tend_simulator()
        assert lines[-1] == f"the simulator was gone: started again on {url}"
        wait_until(lambda: healthy(url, 1.0), what="the simulator to answer again")
    finally:
        services.sup.stop(timeout_s=10)
