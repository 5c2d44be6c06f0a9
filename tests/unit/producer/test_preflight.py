"""The preflight: nothing is fed to an engine that serves another model than the tokenizer's,
cannot be reached, or answers in a shape tokencap cannot read (`producer.preflight`); a
worker refuses an engine whose model is not the one the run's producer checked; rows say
which model and engine made them, and whether it was a simulator."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from redis import Redis

from budget_service.budget import Budget
from budget_service.keys import Keys
from foundation.config import RunConfig
from foundation.engine.info import EngineInfo
from foundation.errors import EngineNotReady, EngineUnusable
from producer.preflight import until_ready
from producer.run import run_to_end
from sglang_sim.config import FaultConfig, LengthDist
from sglang_sim.testing import SimServer
from testing.harness import Pipeline, free_port
from tests.conftest import ROOT, write_config
from tests.faults.common import FAULT_KNOBS
from tokencap.export.exporter import ExportError, export
from tokencap.reports.progress import SIMULATED_TEXT, summary_table

FIXTURES = ROOT / "tests" / "fixtures"
PHI3 = FIXTURES / "tokenizers" / "phi-3-mini"
QWEN = FIXTURES / "tokenizers" / "qwen2.5-instruct"
GSM8K = FIXTURES / "datasets" / "question_answer" / "gsm8k_test_first200.jsonl"
UP_TIMEOUT_S = 30.0  # the bound: a dead engine stops `up` within 30 s
EXIT_ENGINE_UNUSABLE = EngineUnusable.exit_code
ONE_TOKEN = LengthDist(1.0, 0.0)  # every generation ends on its first token


def _config(tmp: Path, tokenizer: Path, head: str = "preflight_wait_s = 1") -> Path:
    """`preflight_wait_s` short unless a test checks the wait itself."""
    path = tmp / "run.toml"
    path.write_text(f"""
run = "pre"
output_dir = "{tmp / 'out'}"
tokenizer = "{tokenizer}"
{head}
[[category]]
name = "math"
source = "{GSM8K}"
cap_tokens = 5000
sampling = {{ max_new_tokens = 64, temperature = 0.7 }}
""")
    return path


def _ids_config(tmp: Path, run: str) -> RunConfig:
    """A run of six token-id prompts, sampling left to the engine (no tokenizer); every reply
    is cut at 16 tokens, and written as a training row (no reply gate: these tests are
    about the rows' provenance and the preflight)."""
    src = tmp / "ids.jsonl"
    src.write_text("".join(f'{{"input_ids": [{400 + i}, 5, 6]}}\n' for i in range(6)))
    return write_config(tmp, f"""
run = "{run}"
output_dir = "{tmp / 'out'}"
reply_gate = false
{FAULT_KNOBS}
[[category]]
name = "a"
source = "{src}"
format = "input_ids"
cap_tokens = "none"
sampling = {{ max_new_tokens = 16 }}
""")


def _up(tmp: Path, tokenizer: Path, redis_url: str | None, engine: str,
        head: str = "preflight_wait_s = 1") -> subprocess.CompletedProcess:
    env = {**os.environ, "SGLANG_URL": engine}
    env.pop("SGLANG_API_KEY", None)
    env.pop("REDIS_URL", None)
    if redis_url:
        env["REDIS_URL"] = redis_url
    try:
        return subprocess.run(
            [sys.executable, "-m", "tokencap.cli", "up", str(_config(tmp, tokenizer, head)),
             "--workers", "1", "--state-dir", str(tmp / "state")],
            cwd=ROOT, env=env, capture_output=True, text=True, timeout=UP_TIMEOUT_S)
    finally:
        # a run that finished leaves its stack up (as `make up` does): stop it
        subprocess.run([sys.executable, "-m", "tokencap.cli", "down", "--state-dir",
                        str(tmp / "state")], cwd=ROOT, env=env, capture_output=True,
                       timeout=UP_TIMEOUT_S)


def _refused_before_anything(done: subprocess.CompletedProcess, redis: Redis) -> str:
    assert done.returncode == EXIT_ENGINE_UNUSABLE, done.stderr[-2000:]
    assert "Traceback" not in done.stderr
    # nothing was enqueued, no run was created: the Redis of the run holds no key at all
    assert redis.keys("*") == []
    return done.stderr


@pytest.mark.starts_stack
def test_up_stops_before_feeding_when_the_tokenizer_is_not_the_served_model(
        tmp_path, redis, redis_url) -> None:
    # Given an engine serving Qwen's vocabulary (151,936 ids) and a run with Phi-3's tokenizer
    with SimServer(time_scale=1000.0) as sim:
        done = _up(tmp_path, PHI3, redis_url, sim.url)
        assert sim.requests() == [{"max_new_tokens": 16, "temperature": 0.0}]  # the probe only
    err = _refused_before_anything(done, redis)
    # Then the message names both sides
    assert f"engine {sim.url}" in err and "tokencap-sglang-sim" in err
    assert "does not serve the tokenizer's model" in err and str(PHI3) in err


@pytest.mark.starts_stack
def test_up_stops_within_30_s_when_the_engine_cannot_be_reached(tmp_path, redis,
                                                                 redis_url) -> None:
    dead = f"http://127.0.0.1:{free_port()}"  # the default preflight_wait_s: tried for 20 s
    err = _refused_before_anything(_up(tmp_path, QWEN, redis_url, dead, head=""), redis)
    assert f"engine {dead}: cannot reach it (connection refused)" in err
    assert "preflight_wait_s = 20" in err


@pytest.mark.starts_stack
def test_up_stops_the_redis_it_started_when_the_engine_is_unusable(tmp_path) -> None:
    dead = f"http://127.0.0.1:{free_port()}"
    done = _up(tmp_path, QWEN, None, dead)  # no REDIS_URL: up starts its own redis-server
    assert done.returncode == EXIT_ENGINE_UNUSABLE, done.stderr[-2000:]
    assert "[up] stopping what it started: redis" in done.stdout
    assert list((tmp_path / "state" / "pids").glob("*.pid")) == []


@pytest.mark.starts_stack
def test_up_refuses_an_sglang_without_output_ids_in_its_reply(tmp_path, redis,
                                                               redis_url) -> None:
    with SimServer(time_scale=1000.0, sglang_version="0.4.10") as sim:
        err = _refused_before_anything(_up(tmp_path, QWEN, redis_url, sim.url), redis)
    assert "SGLang older than 0.5.1" in err and "upgrade the engine" in err


@pytest.mark.starts_stack
def test_up_refuses_an_engine_that_wants_an_api_key_it_was_not_given(tmp_path, redis,
                                                                     redis_url) -> None:
    with SimServer(time_scale=1000.0, api_key="s3cret") as sim:
        err = _refused_before_anything(_up(tmp_path, QWEN, redis_url, sim.url), redis)
    assert "HTTP 401" in err and "SGLANG_API_KEY" in err and "s3cret" not in err


def test_an_engine_that_stops_on_another_models_end_of_turn_is_refused(tmp_path) -> None:
    from producer.preflight import preflight
    from producer.run import load_renderer

    cfg = write_config(tmp_path, _config(tmp_path, QWEN).read_text())
    renderer = load_renderer(cfg)
    # an engine whose every generation ends at once on id 2 (Phi-3's and Llama's </s>)
    with SimServer(time_scale=1000.0, eos_token_id=2, default_length=ONE_TOKEN) as sim:
        with pytest.raises(EngineUnusable, match=r"stopped on id 2, the end-of-turn ids of "
                                                 r"the tokenizer .* are \[151643, 151645\]"):
            preflight(cfg, [sim.url], renderer)
    with SimServer(time_scale=1000.0, default_length=ONE_TOKEN) as sim:
        (info,) = preflight(cfg, [sim.url], renderer)  # Qwen's <|im_end|>: the same model
    assert info.simulated and info.model == "tokencap-sglang-sim" and info.version == "0.5.23"


def test_a_worker_refuses_an_engine_serving_another_model_than_the_producer_checked(
        tmp_path, redis, redis_url) -> None:
    cfg = _ids_config(tmp_path, "w")
    budget = Budget(redis, Keys(cfg.key_prefix, cfg.run))
    budget.feeding.init_run(cfg)
    budget.telemetry.record_engines([EngineInfo(url="http://gpu-1:30000", api="sglang",
                                      model="Qwen/Qwen3-8B", version="0.5.23")])
    with SimServer(time_scale=1000.0) as sim:
        env = {**os.environ, "REDIS_URL": redis_url, "SGLANG_URL": sim.url,
               "TOKENCAP_RUN": "w"}
        done = subprocess.run([sys.executable, "-m", "tokencap.cli", "worker", "--burst"],
                              cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == EXIT_ENGINE_UNUSABLE, done.stderr[-2000:]
    assert "serves 'tokencap-sglang-sim'" in done.stderr and "Qwen/Qwen3-8B" in done.stderr
    assert "Traceback" not in done.stderr


def test_rows_name_the_model_and_engine_and_a_simulators_rows_are_not_exported(
        tmp_path, redis_url) -> None:
    cfg = _ids_config(tmp_path, "rows")
    with SimServer(time_scale=1000.0) as sim:
        pipe = Pipeline(cfg, redis_url, [sim.url])

        def start(_producer: object) -> None:
            pipe.start_writer()
            pipe.start_workers(2)

        try:
            status = run_to_end(cfg, pipe.redis, [sim.url], before_feed=start)
        finally:
            pipe.close()
    rows = pipe.results("a")
    assert len(rows) == 6
    assert {(r.model, r.engine_version, r.simulated) for r in rows} == {
        ("tokencap-sglang-sim", "0.5.23", True)}
    assert status.simulated is True and SIMULATED_TEXT in summary_table(status)
    assert [e.model for e in status.engines.values()] == ["tokencap-sglang-sim"]
    with pytest.raises(ExportError, match="generated by a simulator"):
        export(Path(cfg.output_dir), tmp_path / "x", ["specforge"])
    summary = export(Path(cfg.output_dir), tmp_path / "y", ["specforge"], allow_simulated=True)
    assert summary  # exported on request


@pytest.mark.starts_stack
def test_up_waits_for_an_engine_that_answers_503_to_its_first_probes(tmp_path, redis,
                                                                     redis_url) -> None:
    # Given an engine that answers its first three generations with 503 (busy), then serves
    busy = FaultConfig(error_burst={503: 3})
    with SimServer(time_scale=1000.0, faults=busy, tokenizer=str(QWEN)) as sim:
        done = _up(tmp_path, QWEN, redis_url, sim.url, head="")
        faults = sim.stats()["faults_injected"]
    # Then `up` waited, said so on each try, and ran the config to its end
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert faults == {"503": 3}
    waits = [line for line in done.stderr.splitlines() if "waiting for engine" in line]
    assert [w.split("waiting for engine ", 1)[1] for w in waits] == [
        f"{sim.url} (503), {n} try, up to 20 s" for n in ("2nd", "3rd", "4th")]
    assert "Traceback" not in done.stderr


class _Clock:
    """A clock that moves only when `sleep` is called."""

    def __init__(self) -> None:
        self.now = 0.0
        self.slept: list[float] = []

    def sleep(self, s: float) -> None:
        self.slept.append(s)
        self.now += s


def test_the_preflight_waits_with_the_workers_backoff_and_gives_up_saying_so() -> None:
    clock = _Clock()

    def never() -> None:
        raise EngineNotReady("engine http://e: cannot reach it (connection refused)",
                             "connection refused")

    with pytest.raises(EngineUnusable) as caught:
        until_ready("http://e", never, 20.0, 30.0, clock.sleep, lambda: clock.now)
    # the waits are urllib3's (none, then 1, 2, 4, 8 s plus jitter), the last one cut at the
    # bound; the message keeps the cause and says how long it waited
    assert clock.slept[0] == 0.0 and 1.0 <= clock.slept[1] < 1.5 and 2.0 <= clock.slept[2] < 2.5
    assert sum(clock.slept) == pytest.approx(20.0)
    assert "cannot reach it (connection refused) (still after" in str(caught.value)
    assert "in 20 s; preflight_wait_s = 20)" in str(caught.value)
    assert not isinstance(caught.value, EngineNotReady)


def test_the_preflight_does_not_wait_for_what_retrying_cannot_change() -> None:
    clock = _Clock()
    calls = []

    def wrong_model() -> None:
        calls.append(1)
        raise EngineUnusable("engine http://e does not serve the tokenizer's model")

    with pytest.raises(EngineUnusable, match="does not serve"):
        until_ready("http://e", wrong_model, 20.0, 30.0, clock.sleep, lambda: clock.now)
    assert calls == [1] and clock.slept == []


def test_a_busy_engine_that_comes_up_is_used_after_the_waits() -> None:
    clock = _Clock()
    answers = iter([EngineNotReady("x: HTTP 503", "503"), EngineNotReady("x: reset",
                                                                          "connection reset")])

    def check() -> str:
        for exc in answers:
            raise exc
        return "ready"

    assert until_ready("http://e", check, 20.0, 30.0, clock.sleep, lambda: clock.now) == "ready"
    assert len(clock.slept) == 2
