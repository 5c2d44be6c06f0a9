"""`foundation/engine/load.py`: an engine's load read from SGLang's `/v1/loads` or the
`/metrics` page (SGLang's and vLLM's names; DP ranks add up, TP ranks and priorities are one
scheduler's), and which engines have no `/v1/loads`."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
import requests

from foundation.engine.load import LoadReader, parse_loads, parse_metrics, read_load
from sglang_sim.testing import SimServer
from tests.helpers import QueueSession, Reply

TIMEOUT_S = (5.0, 30.0)


def test_an_engine_without_v1_loads_is_asked_for_it_once_per_reader() -> None:
    asked: list[str] = []
    metrics = QueueSession([1])

    def get(url: str, **kw: Any) -> Reply:
        asked.append(url.rsplit("/", 1)[-1].split("?")[0])
        return metrics.get(url, **kw)

    reader = LoadReader(get)
    for _ in range(3):
        load, source = reader.read("http://e", None, (1.0, 1.0))
        assert source == "metrics" and load is not None and load["queued"] == 1
    assert asked == ["loads", "metrics", "metrics", "metrics"]
    # another reader (a restarted process: the engine may have been upgraded) asks again
    LoadReader(get).read("http://e", None, (1.0, 1.0))
    assert asked[-2:] == ["loads", "metrics"]


# -- /v1/loads --------------------------------------------------------------------------------

def test_the_ranks_of_v1_loads_add_up_and_their_usage_is_the_highest() -> None:
    doc = {"version": "0.5.23", "loads": [
        {"dp_rank": 0, "num_running_reqs": 3, "num_waiting_reqs": 1, "token_usage": 0.25,
         "gen_throughput": 100.5},
        {"dp_rank": 1, "num_running_reqs": 4, "num_waiting_reqs": 0, "token_usage": 0.5},
        "not a rank"]}
    assert parse_loads(doc) == {"running": 7.0, "queued": 1.0, "token_usage": 0.5,
                                "gen_throughput": 100.5}
    nothing = dict.fromkeys(("running", "queued", "token_usage", "gen_throughput"))
    assert parse_loads({"loads": [{"dp_rank": 0}]}) == nothing
    assert parse_loads({"loads": "busy"}) == parse_loads(["x"]) == parse_loads(None) == nothing


# -- /metrics -----------------------------------------------------------------------------------

def _sglang_series(name: str, per_dp: list[dict[str, float]], tp_per_dp: int) -> list[str]:
    """`name` as SGLang 0.5.23's SchedulerMetricsCollector exports it with DP attention,
    --enable-metrics-for-all-schedulers and --enable-priority-scheduling: labels model_name,
    engine_type, tp_rank, pp_rank, moe_ep_rank, priority ("" for the total) and dp_rank;
    every TP rank of a DP group repeats its group's values."""
    lines = [f"# HELP {name} .", f"# TYPE {name} gauge"]
    for dp, values in enumerate(per_dp):
        for t in range(tp_per_dp):
            tp = dp * tp_per_dp + t
            for prio, v in values.items():
                lines.append(f'{name}{{dp_rank="{dp}",engine_type="unified",model_name='
                             f'"Qwen/Qwen3-8B",moe_ep_rank="{tp}",pp_rank="0",priority="{prio}",'
                             f'tp_rank="{tp}"}} {v}')
    return lines


def test_load_is_the_true_running_count_with_priorities_dp_and_tp_ranks() -> None:
    # 40 running (25 on DP rank 0, 15 on rank 1) and 7 waiting, 4 TP ranks per DP rank
    page = "\n".join(
        _sglang_series("sglang:num_running_reqs",
                       [{"": 25.0, "0": 20.0, "10": 5.0}, {"": 15.0, "0": 15.0}], 4)
        + _sglang_series("sglang:num_queue_reqs", [{"": 3.0, "0": 3.0}, {"": 4.0, "10": 4.0}], 4)
        + _sglang_series("sglang:token_usage", [{"": 0.5}, {"": 0.25}], 4)) + "\n"
    load = parse_metrics(page)
    assert (load["running"], load["queued"], load["token_usage"]) == (40.0, 7.0, 0.5)
    # a plain single-scheduler page (no priority, no dp_rank) is read as it is
    plain = 'sglang:num_running_reqs{engine_type="unified",model_name="m",moe_ep_rank="0",' \
            'pp_rank="0",tp_rank="0"} 12.0\n'
    assert parse_metrics(plain)["running"] == 12.0
    # vLLM: one series per engine core (data parallel): they add up
    vllm = ('vllm:num_requests_running{engine="0",model_name="m"} 3.0\n'
            'vllm:num_requests_running{engine="1",model_name="m"} 4.0\n'
            'vllm:num_requests_waiting{engine="0",model_name="m"} 1.0\n')
    assert (parse_metrics(vllm)["running"], parse_metrics(vllm)["queued"]) == (7, 1)


def test_parse_tolerates_labels_comments_and_missing_metrics() -> None:
    text = "\n".join([
        "# HELP sglang:num_running_reqs The number of running requests.",
        "# TYPE sglang:num_running_reqs gauge",
        'sglang:num_running_reqs{model_name="m",dp_rank="0"} 3',
        'sglang:num_running_reqs{model_name="odd } \\" label",dp_rank="1"} 4.0 1700000000000',
        "sglang:num_queue_reqs 2",
        'sglang:token_usage{dp_rank="0"} 0.25',
        'sglang:token_usage{dp_rank="1"} 0.5',
        'sglang:token_usage{dp_rank="2"} NaN',
        "sglang:num_running_reqs_total 99",  # another metric with the same prefix
        "garbage line without a value",
        "",
    ])
    parsed = parse_metrics(text)
    assert parsed == {"running": 7.0, "queued": 2.0, "token_usage": 0.5,
                      "gen_throughput": None}
    assert parse_metrics("") == dict.fromkeys(parsed)


def test_vllm_s_cache_usage_is_read_by_its_new_name_before_its_old_one() -> None:
    page = ('vllm:gpu_cache_usage_perc{engine="0"} 0.9\n'
            'vllm:kv_cache_usage_perc{engine="0"} 0.3\n'
            'vllm:kv_cache_usage_perc{engine="1"} 0.4\n')
    assert parse_metrics(page)["token_usage"] == 0.4
    assert parse_metrics('vllm:gpu_cache_usage_perc{engine="0"} 0.9\n')["token_usage"] == 0.9


# -- reading an engine ----------------------------------------------------------------------------

class _Session:
    """A session answering each path with a scripted `Reply`; 404 for any other."""

    def __init__(self, replies: dict[str, Reply]) -> None:
        self.replies = replies

    def get(self, url: str, timeout: object = None, headers: object = None) -> Reply:
        path = "/" + url.split("/", 3)[3]
        return self.replies.get(path.split("?")[0], Reply(404))


def test_a_load_is_read_where_the_engine_has_it_or_not_at_all() -> None:
    metrics = Reply(200, "sglang:num_running_reqs 2\nsglang:num_queue_reqs 1\n")
    loads = Reply(200, '{"loads": [{"num_running_reqs": 5, "num_waiting_reqs": 0}]}')
    both = _Session({"/v1/loads": loads, "/metrics": metrics}).get
    assert read_load(both, "http://e", None, TIMEOUT_S)[1] == "loads"
    assert read_load(both, "http://e", None, TIMEOUT_S, try_loads=False) == (
        {"running": 2.0, "queued": 1.0, "token_usage": None, "gen_throughput": None}, "metrics")
    # /v1/loads that is not JSON (another server's page): /metrics then
    odd = _Session({"/v1/loads": Reply(200, "<html>"), "/metrics": metrics}).get
    assert read_load(odd, "http://e", None, TIMEOUT_S)[1] == "metrics"
    # a router: neither
    assert read_load(_Session({}).get, "http://e", None, TIMEOUT_S) == (None, "")
    # an engine failing is raised, not read as no load
    failing = _Session({"/metrics": Reply(503)}).get
    with pytest.raises(requests.RequestException):
        read_load(failing, "http://e", None, TIMEOUT_S)
    with pytest.raises(requests.RequestException):
        read_load(_Session({"/v1/loads": Reply(500)}).get, "http://e", None, TIMEOUT_S)


@pytest.mark.parametrize(("engine", "source"), [
    ({"sglang_version": "0.5.23", "metrics_dp_ranks": 2}, "loads"),
    ({"sglang_version": "0.5.4"}, "metrics"),
    ({"flavor": "vllm"}, "metrics")])
def test_a_busy_simulator_s_load_is_its_running_and_waiting_requests(engine: dict,
                                                                      source: str) -> None:
    vllm = engine.get("flavor") == "vllm"
    path, body = ("/v1/completions", {"prompt": [1, 2, 3], "max_tokens": 8}) if vllm else (
        "/generate", {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 8}})
    with SimServer(time_scale=100, max_running_requests=2, **engine) as sim, \
            ThreadPoolExecutor(max_workers=3) as pool:
        sim.pause()
        posts = [pool.submit(requests.post, f"{sim.url}{path}", json=body, timeout=30)
                 for _ in range(3)]
        sim.wait_until(lambda s: s["running"] == 2 and s["queued"] == 1)
        load, read_from = LoadReader().read(sim.url, None, TIMEOUT_S)
        sim.resume()
        assert all(p.result(30).status_code == 200 for p in posts)
    assert read_from == source
    assert load is not None and (load["running"], load["queued"]) == (2.0, 1.0)
