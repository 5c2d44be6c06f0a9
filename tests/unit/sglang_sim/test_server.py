"""Tests of sglang_sim: the SGLang protocol, the batching model and the fault knobs.

Servers run in-process (``SimServer``) at high time scales; tests synchronise on the
engine's state through ``SimServer.wait_until`` (event driven), never on sleeps.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import requests
from hypothesis import given, settings
from hypothesis import strategies as st

from sglang_sim.config import DEFAULT_EOS_TOKEN_ID, LengthDist, SimConfig, version
from sglang_sim.jobs import Job
from sglang_sim.scheduler import Engine
from sglang_sim.testing import (
    SimServer,
    busy_throughput,
    start_sim_subprocess,
    throughput_at_batch,
    time_fraction_below,
)
from testing.harness import wait_until
from tests.conftest import ROOT

FAST = 1000.0  # time scale for tests that only look at protocol behaviour
TIMEOUT_S = 30.0
EOS = DEFAULT_EOS_TOKEN_ID
META_KEYS = {
    "id", "finish_reason", "prompt_tokens", "completion_tokens", "cached_tokens",
    "e2e_latency", "weight_version", "num_retractions",
}  # fmt: skip


def post(url: str, body: Any, **kw: Any) -> requests.Response:
    return requests.post(f"{url}/generate", json=body, timeout=TIMEOUT_S, **kw)


def gen(url: str, ids: list[int], **params: Any) -> dict[str, Any]:
    r = post(url, {"input_ids": ids, "sampling_params": params})
    assert r.status_code == 200, r.text
    return r.json()


@pytest.fixture
def sim() -> Any:
    with SimServer(time_scale=FAST) as server:
        yield server


# ----- /generate shape and outputs ---------------------------------------------------------


def test_reply_shape_and_eos_stop(sim: SimServer) -> None:
    r = post(sim.url, {"input_ids": [5, 6, 7], "rid": "abc", "sampling_params": {
        "max_new_tokens": 8000, "temperature": 0}})  # fmt: skip
    assert r.status_code == 200
    out = r.json()
    meta = out["meta_info"]
    assert META_KEYS <= set(meta)
    assert meta["id"] == "abc"
    assert meta["prompt_tokens"] == 3
    assert meta["finish_reason"] == {"type": "stop", "matched": EOS}
    assert out["output_ids"][-1] == EOS
    assert EOS not in out["output_ids"][:-1]
    assert len(out["output_ids"]) == meta["completion_tokens"] >= 1
    assert meta["cached_tokens"] == 0 and meta["num_retractions"] == 0
    assert out["text"] == "".join(f" t{t}" for t in out["output_ids"][:-1])
    assert all(0 <= t < SimConfig().vocab_size for t in out["output_ids"])


def test_max_new_tokens_truncates_to_a_prefix(sim: SimServer) -> None:
    full = gen(sim.url, [1, 2, 3], max_new_tokens=8000)
    n = full["meta_info"]["completion_tokens"]
    assert n > 3  # seed chosen so the natural length is long enough
    short = gen(sim.url, [1, 2, 3], max_new_tokens=3)
    assert short["meta_info"]["finish_reason"] == {"type": "length", "length": 3}
    assert short["output_ids"] == full["output_ids"][:3]
    assert short["meta_info"]["completion_tokens"] == 3


def test_default_max_new_tokens_is_128(sim: SimServer) -> None:
    out = post(sim.url, {"input_ids": [9], "sampling_params": {"ignore_eos": True}}).json()
    assert out["meta_info"]["finish_reason"] == {"type": "length", "length": 128}
    assert len(out["output_ids"]) == 128 and EOS not in out["output_ids"]


def test_outputs_are_deterministic(sim: SimServer) -> None:
    a = gen(sim.url, [4, 4, 4], max_new_tokens=2000)
    b = gen(sim.url, [4, 4, 4], max_new_tokens=2000)
    assert a["output_ids"] == b["output_ids"] and a["meta_info"]["id"] != b["meta_info"]["id"]
    seeded = [gen(sim.url, [4, 4, 4], max_new_tokens=2000, sampling_seed=s) for s in (1, 2)]
    assert seeded[0]["output_ids"] != seeded[1]["output_ids"]
    with SimServer(time_scale=FAST, seed=7) as other:
        assert gen(other.url, [4, 4, 4], max_new_tokens=2000)["output_ids"] != a["output_ids"]


def test_text_prompt_is_one_token_per_word(sim: SimServer) -> None:
    r = post(
        sim.url, {"text": "The capital of  France is", "sampling_params": {"max_new_tokens": 4}}
    )
    assert r.status_code == 200
    assert r.json()["meta_info"]["prompt_tokens"] == 5


def test_category_header_selects_length_distribution() -> None:
    profiles = {"short": LengthDist(mean_tokens=5.0, sigma=0.0)}
    with SimServer(time_scale=FAST, length_profiles=profiles) as sim:
        body = {"input_ids": [3, 1, 4], "sampling_params": {"max_new_tokens": 1000}}
        short = post(sim.url, body, headers={"X-Tokencap-Category": "short"}).json()
        assert short["meta_info"]["finish_reason"] == {"type": "stop", "matched": EOS}
        assert short["meta_info"]["completion_tokens"] == 5
        unknown = post(sim.url, body, headers={"X-Tokencap-Category": "nope"}).json()
        assert unknown["output_ids"] == post(sim.url, body).json()["output_ids"]


# ----- errors ------------------------------------------------------------------------------


@pytest.mark.parametrize(("release", "equal_ok"), [("0.5.9", False), ("0.5.15", True),
                                                  ("0.5.23", True)])
def test_input_longer_than_context_is_400(release: str, equal_ok: bool) -> None:
    with SimServer(time_scale=FAST, sglang_version=release) as sim:
        r = post(sim.url, {"input_ids": [1] * 32768})
        assert r.status_code == 400
        assert r.json() == {"error": {"message": (
            "The input (32768 tokens) is longer than the model's context length (32768 tokens)."
        )}}  # fmt: skip
        # input + max_new_tokens one past the context: refused by every release
        r = post(sim.url, {"input_ids": [1] * 100, "sampling_params": {"max_new_tokens": 32669}})
        assert r.status_code == 400
        assert r.json()["error"]["message"].startswith(
            "Requested token count exceeds the model's maximum context length of 32768 tokens. "
            "You requested a total of 32769 tokens: 100 tokens from the input messages and "
            "32669 tokens for the completion."
        )  # fmt: skip
        # exactly the context: refused before 0.5.15 (`>=`), accepted from then on (`>`)
        r = post(sim.url, {"input_ids": [1] * 100, "sampling_params": {
            "max_new_tokens": 32668, "ignore_eos": False}})
        assert (r.status_code == 200) is equal_ok, r.text


def test_input_longer_than_kv_pool_is_400() -> None:
    with SimServer(time_scale=FAST, max_total_tokens=1000) as sim:
        r = post(sim.url, {"input_ids": [1] * 995})
        assert r.status_code == 400
        assert r.json()["error"]["message"] == (
            "Input length (995 tokens) exceeds the maximum allowed length (994 tokens). "
            "Use a shorter input or enable --allow-auto-truncate."
        )


@pytest.mark.parametrize("release", ["0.5.9", "0.5.15"])
def test_unknown_sampling_key_is_a_plain_text_500_before_0_5_23(release: str) -> None:
    with SimServer(time_scale=FAST, sglang_version=release) as sim:
        r = post(sim.url, {"input_ids": [1], "sampling_params": {"logprobs": 5}})
        assert r.status_code == 500 and r.text == "Internal Server Error"


def test_unknown_sampling_key_is_a_400_with_an_error_string_from_0_5_23(sim: SimServer) -> None:
    r = post(sim.url, {"input_ids": [1], "sampling_params": {"logprobs": 5}})
    assert r.status_code == 400
    message = r.json()["error"]
    assert isinstance(message, str) and "unknown field `logprobs`" in message


@pytest.mark.parametrize(
    ("params", "message"),
    [
        ({"top_p": 0}, "top_p must be in (0, 1], got 0."),
        ({"temperature": -1}, "temperature must be a non-negative finite number, got -1."),
        ({"top_k": 0}, "top_k must be -1 (disable) or at least 1, got 0."),
        ({"max_new_tokens": -1}, "max_new_tokens must be at least 0, got -1."),
    ],
)
def test_bad_sampling_values_are_400(sim: SimServer, params: dict, message: str) -> None:
    r = post(sim.url, {"input_ids": [1], "sampling_params": params})
    assert r.status_code == 400
    assert r.json() == {"error": {"message": message}}


@pytest.mark.parametrize(
    "body",
    [
        {"input_ids": [[1], [2]]},
        {"text": ["a", "b"]},
        {"input_ids": []},
        {},
        {"input_ids": [1], "text": "a"},
    ],
)
def test_malformed_or_batch_requests_are_400(sim: SimServer, body: dict) -> None:
    r = post(sim.url, body)
    assert r.status_code == 400
    assert "message" in r.json()["error"]


def test_queue_full_is_503_and_aborts_answer_200() -> None:
    with SimServer(time_scale=1.0, max_running_requests=1, max_queued_requests=1) as sim:
        long = {"max_new_tokens": 10_000, "ignore_eos": True}
        with ThreadPoolExecutor(max_workers=2) as pool:
            running = pool.submit(post, sim.url, {"input_ids": [1], "rid": "run-1",
                                                  "sampling_params": long})  # fmt: skip
            sim.wait_until(lambda s: s["running"] == 1)
            queued = pool.submit(post, sim.url, {"input_ids": [2], "rid": "queued-1",
                                                 "sampling_params": long})  # fmt: skip
            sim.wait_until(lambda s: s["queued"] == 1)
            duplicate = post(sim.url, {"input_ids": [1], "rid": "run-1"})
            assert duplicate.json() == {
                "error": {"message": "Duplicate request ID detected: run-1"}
            }
            full = post(sim.url, {"input_ids": [3], "sampling_params": long})
            assert full.status_code == 503
            assert full.json() == {"object": "error", "message": "The request queue is full.",
                                   "type": "503", "param": None, "code": 503}  # fmt: skip
            abort = requests.post(f"{sim.url}/abort_request", json={"rid": "queued"}, timeout=5)
            assert abort.status_code == 200
            q = queued.result(TIMEOUT_S)
            assert q.status_code == 200
            assert q.json()["meta_info"]["finish_reason"] == {
                "type": "abort", "message": "Abort in waiting queue"}  # fmt: skip
            assert q.json()["output_ids"] == []
            requests.post(f"{sim.url}/abort_request", json={"abort_all": True}, timeout=5)
            r = running.result(TIMEOUT_S).json()
        assert r["meta_info"]["finish_reason"] == {
            "type": "abort",
            "message": "Aborted",
            "status_code": None,
            "err_type": None,
        }
        assert 1 <= r["meta_info"]["completion_tokens"] == len(r["output_ids"]) < 10_000
        stats = sim.stats()
        assert stats["aborted_total"] == 2 and stats["rejected_queue_full_total"] == 1


def test_client_disconnect_aborts_request() -> None:
    with SimServer(time_scale=1.0) as sim:
        body = {"input_ids": [1], "sampling_params": {"max_new_tokens": 10_000, "ignore_eos": True}}
        with pytest.raises(requests.exceptions.ReadTimeout):
            requests.post(f"{sim.url}/generate", json=body, timeout=0.2)
        stats = sim.wait_until(lambda s: s["aborted_total"] == 1)
        assert stats["running"] == 0


# ----- other endpoints ---------------------------------------------------------------------


def _parse_metrics(text: str) -> dict[str, float]:
    values = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name_labels, value = line.rsplit(" ", 1)
            name = name_labels.split("{", 1)[0]
            le = name_labels.split('le="', 1)[1].split('"')[0] if 'le="' in name_labels else None
            values[f"{name}[{le}]" if le else name] = float(value)
            assert 'model_name="tokencap-sglang-sim"' in name_labels
    return values


def test_metrics_match_requests_done(sim: SimServer) -> None:
    outs = [gen(sim.url, [i, i + 1], max_new_tokens=50) for i in range(5)]
    m = _parse_metrics(requests.get(f"{sim.url}/metrics", timeout=5).text)
    assert m["sglang:num_requests_total"] == 5
    assert m["sglang:prompt_tokens_total"] == 10
    assert m["sglang:generation_tokens_total"] == sum(len(o["output_ids"]) for o in outs)
    assert m["sglang:num_running_reqs"] == 0 and m["sglang:num_queue_reqs"] == 0
    assert m["sglang:num_aborted_requests_total"] == 0
    assert m["sglang:token_usage"] == 0 and "sglang:gen_throughput" in m
    assert m["sglang:e2e_request_latency_seconds_count"] == 5
    assert m["sglang:e2e_request_latency_seconds_bucket[+Inf]"] == 5


def test_info_endpoints(sim: SimServer) -> None:
    for path in ("/health", "/health_generate"):
        r = requests.get(sim.url + path, timeout=5)
        assert r.status_code == 200 and r.content == b""
    for path in ("/server_info", "/get_server_info"):
        info = requests.get(sim.url + path, timeout=5).json()
        assert info["simulator"] is True and info["context_length"] == 32768
        assert info["max_running_requests"] == 72 and info["max_queued_requests"] is None
        assert info["max_total_tokens"] == 400_000 and info["max_req_input_len"] == 32762
        assert info["version"] == "0.5.23" and "simulator_version" in info
        assert "last_gen_throughput" in info["internal_states"][0]
    for path in ("/model_info", "/get_model_info"):
        assert requests.get(sim.url + path, timeout=5).json()["model_path"] == "tokencap-sglang-sim"
    models = requests.get(sim.url + "/v1/models", timeout=5).json()
    assert models["data"][0]["max_model_len"] == 32768
    assert models["data"][0]["owned_by"] == "sglang"
    loads = requests.get(sim.url + "/v1/loads", timeout=5).json()["loads"]
    assert loads[0]["dp_rank"] == 0 and loads[0]["num_running_reqs"] == 0
    assert requests.get(sim.url + "/get_load", timeout=5).status_code == 404  # gone in 0.5.23
    assert requests.post(sim.url + "/flush_cache", timeout=5).text.startswith("Cache flushed.")


@pytest.mark.parametrize(("release", "present", "absent"), [
    ("0.5.4", ["/get_server_info", "/get_model_info", "/get_load"],
     ["/server_info", "/model_info", "/v1/loads"]),
    ("0.5.9", ["/server_info", "/get_server_info", "/get_load", "/v1/loads"], []),
    ("0.5.23", ["/server_info", "/v1/loads"], ["/get_load"]),
])  # fmt: skip
def test_routes_follow_the_sglang_release(release: str, present: list[str],
                                          absent: list[str]) -> None:
    with SimServer(time_scale=FAST, sglang_version=release, context_length_flag=False) as sim:
        for path in present:
            assert requests.get(sim.url + path, timeout=5).status_code == 200, path
        for path in absent:
            assert requests.get(sim.url + path, timeout=5).status_code == 404, path
        info_path = "/server_info" if version(release) >= (0, 5, 9) else "/get_server_info"
        info = requests.get(sim.url + info_path, timeout=5).json()
        # without --context-length SGLang reports none there; /v1/models has it
        assert info["context_length"] is None and info["version"] == release
        models = requests.get(sim.url + "/v1/models", timeout=5).json()
        assert models["data"][0]["max_model_len"] == 32768


@pytest.mark.parametrize(("release", "prefixed", "has_ids"), [
    ("0.4.10", 0, False), ("0.5.1", 5, True), ("0.5.9", 0, True), ("0.5.23", 0, True)])
def test_reply_shape_follows_the_sglang_release(release: str, prefixed: int,
                                                has_ids: bool) -> None:
    with SimServer(time_scale=FAST, sglang_version=release) as sim:
        prompt = [11, 12, 13, 14, 15, 16, 17]
        out = gen(sim.url, prompt, max_new_tokens=4, ignore_eos=True)
        n = out["meta_info"]["completion_tokens"]
        assert n == 4
        if not has_ids:
            assert "output_ids" not in out
            return
        assert len(out["output_ids"]) == n + prefixed
        assert out["output_ids"][:prefixed] == prompt[-prefixed:][:prefixed]


# ----- the batching model ------------------------------------------------------------------


async def _burst(url: str, n: int, max_new_tokens: int) -> list[dict[str, Any]]:
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as session:

        async def one(i: int) -> dict[str, Any]:
            body = {"input_ids": [i % 1000, 7, 7, 7], "sampling_params": {
                "max_new_tokens": max_new_tokens}}  # fmt: skip
            async with session.post(f"{url}/generate", json=body) as r:
                assert r.status == 200
                return await r.json()

        return await asyncio.gather(*(one(i) for i in range(n)))


def test_default_profile_gives_1000_tok_s_at_batch_72() -> None:
    with SimServer(time_scale=200.0) as sim, ThreadPoolExecutor(max_workers=1) as pool:
        sim.pause()
        burst = pool.submit(asyncio.run, _burst(sim.url, 3 * 72, 2048))
        sim.wait_until(lambda s: s["submitted_total"] == 3 * 72)
        sim.resume()
        outs = burst.result(TIMEOUT_S)
        stats = sim.stats()
    assert all(len(o["output_ids"]) == o["meta_info"]["completion_tokens"] for o in outs)
    assert stats["generated_tokens_total"] == sum(len(o["output_ids"]) for o in outs)
    assert 800 <= throughput_at_batch(stats, 72) <= 1200
    # The drain at the end (lognormal tail, a few long outputs alone) lowers the average.
    assert 600 <= busy_throughput(stats) <= 1000
    assert max(int(b) for b in stats["batch_size_sim_s"]) == 72
    below = time_fraction_below(stats, 72)
    assert below == pytest.approx(1 - stats["batch_size_sim_s"]["72"] / stats["busy_sim_s"])
    assert 0 < below < 1


@pytest.mark.parametrize("time_scale", [500.0, 5000.0])
def test_engine_timeline_is_exact_and_time_scale_invariant(time_scale: float) -> None:
    """144 equal jobs at once: two full waves of 72, each 100 steps of 72 ms plus prefill."""
    config = SimConfig(time_scale=time_scale)

    async def scenario() -> dict[str, Any]:
        engine = Engine(config)
        runner = asyncio.create_task(engine.run())
        engine.pause()  # queue every job at the same simulated instant
        jobs = [Job(f"r{i}", 10, 100, 100, {"type": "length", "length": 100}) for i in range(144)]
        futures = [engine.submit(j) for j in jobs]
        engine.resume()
        done = await asyncio.gather(*futures)
        stats = engine.stats()
        engine.close()
        await runner
        assert all(c.completion_tokens == 100 for c in done)
        return stats

    stats = asyncio.run(scenario())
    wave_s = 100 * (0.036 + 0.0005 * 72) + 72 * 10 * 2e-5
    assert stats["busy_sim_s"] == pytest.approx(2 * wave_s, rel=1e-6)
    assert stats["batch_size_tokens"] == {"72": 14_400}
    assert throughput_at_batch(stats, 72) == pytest.approx(14_400 / (2 * wave_s), rel=1e-6)


def test_kv_pressure_retracts_and_everything_finishes() -> None:
    with SimServer(time_scale=FAST, max_total_tokens=3000, admit_headroom_tokens=16) as sim, \
            ThreadPoolExecutor(max_workers=1) as pool:
        sim.pause()  # all 20 arrive at one simulated instant, however slow the machine is
        burst = pool.submit(lambda: asyncio.run(_burst(sim.url, 20, 400)))
        wait_until(lambda: sim.stats()["submitted_total"] >= 20, 30, "20 requests queued")
        sim.resume()
        outs = burst.result(timeout=120)
        stats = sim.stats()
    assert stats["retractions_total"] > 0
    assert sum(o["meta_info"]["num_retractions"] for o in outs) == stats["retractions_total"]
    assert stats["finished_total"] == 20 and stats["kv_used_tokens"] == 0
    assert all(len(o["output_ids"]) == o["meta_info"]["completion_tokens"] for o in outs)


# ----- faults ------------------------------------------------------------------------------


def test_fault_429_has_retry_after(sim: SimServer) -> None:
    sim.set_faults(error_rates={429: 1.0})
    r = post(sim.url, {"input_ids": [1]})
    assert r.status_code == 429 and r.headers["Retry-After"] == "0"
    assert r.json()["type"] == "rate_limit_error"
    sim.set_faults(error_rates={})
    assert post(sim.url, {"input_ids": [1]}).status_code == 200
    assert sim.stats()["faults_injected"] == {"429": 1}


def test_fault_burst_then_recover(sim: SimServer) -> None:
    r = requests.post(f"{sim.url}/_sim/faults", json={"error_burst": {"503": 2}}, timeout=5)
    assert r.json()["error_burst"] == {"503": 2}
    codes = [post(sim.url, {"input_ids": [1]}).status_code for _ in range(4)]
    assert codes == [503, 503, 200, 200]
    stats = sim.stats()
    assert stats["requests_total"] == 4 and stats["responses_by_status"] == {"200": 2, "503": 2}
    sim.reset_stats()
    assert sim.stats()["requests_total"] == 0
    assert requests.get(f"{sim.url}/_sim/faults", timeout=5).json()["error_burst"] == {"503": 0}


def test_fault_poison_token_fails_every_time(sim: SimServer) -> None:
    sim.set_faults(poison_token_id=666)
    assert [post(sim.url, {"input_ids": [1, 666]}).status_code for _ in range(3)] == [500] * 3
    assert post(sim.url, {"input_ids": [1, 667]}).status_code == 200
    assert sim.stats()["faults_injected"] == {"poison": 3}


def test_fault_reset_and_bad_counts(sim: SimServer) -> None:
    sim.set_faults(reset_rate=1.0)
    with pytest.raises(requests.exceptions.ConnectionError):
        post(sim.url, {"input_ids": [1]})
    sim.set_faults(reset_rate=0.0, bad_counts_rate=1.0)
    out = post(sim.url, {"input_ids": [1]}).json()
    assert out["meta_info"]["completion_tokens"] != len(out["output_ids"])
    assert sim.stats()["faults_injected"] == {"bad_counts": 1, "reset": 1}


def test_invalid_faults_are_rejected(sim: SimServer) -> None:
    r = requests.post(f"{sim.url}/_sim/faults", json={"error_rates": {"418": 0.5}}, timeout=5)
    assert r.status_code == 400
    assert requests.get(f"{sim.url}/_sim/faults", timeout=5).json()["error_rates"] == {}


# ----- command line ------------------------------------------------------------------------


def test_cli_subprocess_serves() -> None:
    proc, url = start_sim_subprocess(["--profile", "tiny", "--time-scale", "100"])
    try:
        info = requests.get(f"{url}/server_info", timeout=5).json()
        assert info["simulator"] is True and info["max_running_requests"] == 8
        assert gen(url, [1, 2], max_new_tokens=16)["meta_info"]["completion_tokens"] >= 1
    finally:
        proc.terminate()
        assert proc.wait(TIMEOUT_S) == 0


def test_cli_help_describes_simulator() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "sglang_sim", "--help"],
        capture_output=True,
        text=True,
        check=True,
        cwd=ROOT,
    ).stdout
    assert "SIMULATOR" in out and "--max-queued-requests" in out and "--time-scale" in out


def test_fault_error_rates_are_seeded_and_stall_delays() -> None:
    def statuses(seed: int) -> list[int]:
        with SimServer(time_scale=FAST, seed=seed) as sim:
            sim.set_faults(error_rates={"500": 0.2, "502": 0.2, "504": 0.2})
            codes = [post(sim.url, {"input_ids": [1]}).status_code for _ in range(30)]
            injected = sim.stats()["faults_injected"]
        assert sum(injected.values()) == sum(c != 200 for c in codes)
        return codes

    first = statuses(3)
    assert first == statuses(3)
    assert {500, 502, 504, 200} == set(first)
    with SimServer(time_scale=FAST) as sim:
        sim.set_faults(stall_s=0.3)
        r = post(sim.url, {"input_ids": [1], "sampling_params": {"max_new_tokens": 1}})
        assert r.status_code == 200 and r.elapsed.total_seconds() >= 0.3
        assert sim.stats()["faults_injected"] == {"stall": 1}


def test_cli_flags_and_length_profile_file(tmp_path: Path) -> None:
    from sglang_sim.__main__ import build_parser, config_from_args

    profile = tmp_path / "lengths.json"
    profile.write_text(
        '{"default": {"mean_tokens": 40, "sigma": 0.1},'
        ' "categories": {"B1_glaive": {"mean_tokens": 300, "sigma": 0.6}}}'
    )
    ns = build_parser().parse_args(
        [
            "--time-scale",
            "50",
            "--max-queued-requests",
            "4",
            "--length-profile",
            str(profile),
            "--faults",
            '{"error_rates": {"429": 0.5}}',
        ]  # fmt: skip
    )
    config = config_from_args(ns)
    assert config.time_scale == 50 and config.max_queued_requests == 4
    assert config.max_running_requests == SimConfig().max_running_requests
    assert config.default_length == LengthDist(40, 0.1)
    assert config.length_for("B1_glaive") == LengthDist(300, 0.6)
    assert config.faults.error_rates == {429: 0.5}


@settings(max_examples=25, deadline=None)
@given(
    max_running=st.integers(1, 6),
    kv_tokens=st.integers(400, 2000),
    jobs=st.lists(st.tuples(st.integers(1, 150), st.integers(0, 120)), min_size=1, max_size=25),
)
def test_engine_finishes_every_job_within_limits(
    max_running: int, kv_tokens: int, jobs: list[tuple[int, int]]
) -> None:
    """Whatever the load, every job finishes with its target; KV and batch stay in bounds."""
    config = SimConfig(
        time_scale=1e6,
        max_running_requests=max_running,
        max_total_tokens=kv_tokens,
        admit_headroom_tokens=8,
    )

    async def scenario() -> tuple[list[Any], dict[str, Any]]:
        engine = Engine(config)
        runner = asyncio.create_task(engine.run())
        engine.pause()
        futures = [
            engine.submit(Job(f"j{i}", prompt, target, target, {"type": "length"}))
            for i, (prompt, target) in enumerate(jobs)
        ]
        engine.resume()
        done = await asyncio.wait_for(asyncio.gather(*futures), TIMEOUT_S)
        stats = engine.stats()
        engine.close()
        await runner
        return done, stats

    done, stats = asyncio.run(scenario())
    assert [c.completion_tokens for c in done] == [t for _p, t in jobs]
    assert stats["generated_tokens_total"] == sum(t for _p, t in jobs)
    assert stats["kv_used_tokens"] == 0 and stats["running"] == stats["queued"] == 0
    assert max(int(b) for b in stats["batch_size_sim_s"]) <= max_running
