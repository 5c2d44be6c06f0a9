"""The real SGLang client against the simulator: retries, errors, validation."""

from __future__ import annotations

import json
from typing import Any

import pytest

from consumers.client import (
    BadRequest,
    EngineClient,
    EngineTimeout,
    InvalidResponse,
    Overloaded,
    ServerError,
    Unreachable,
)
from consumers.routing import EnginePool
from foundation.engine.api import parse
from foundation.engine.load import LoadReader
from sglang_sim.testing import SimServer
from testing.harness import free_port

PROMPT = [151644, 872, 198, 6023, 151645, 198, 151644, 77091, 198]
SAMPLING = {"max_new_tokens": 64, "temperature": 0.0}


@pytest.fixture(scope="module")
def sim():
    with SimServer(time_scale=1000.0, context_length=4096) as s:
        yield s


@pytest.fixture(autouse=True)
def clean_faults(sim):
    sim.set_faults(error_rates={}, error_burst={}, stall_s=0.0, reset_rate=0.0,
                   bad_counts_rate=0.0, poison_token_id=None)
    sim.reset_stats()


def client(urls, read_timeout_s=10.0, retries=3) -> EngineClient:
    return EngineClient(urls, connect_timeout_s=1.0, read_timeout_s=read_timeout_s,
                        retries=retries, backoff_max_s=0.05)


def requests_seen(sim) -> int:
    return sim.stats()["requests_total"]


def test_generate_returns_validated_tokens(sim) -> None:
    gen = client([sim.url]).generate(PROMPT, SAMPLING, "chat")
    assert gen.completion_tokens == len(gen.output_ids) >= 1
    assert gen.prompt_tokens == len(PROMPT)
    assert gen.finish_reason in ("stop", "length")
    assert gen.engine == sim.url


def test_400_is_rejected_not_retried(sim) -> None:
    too_long = list(range(10, 4100))
    with pytest.raises(BadRequest) as err:
        client([sim.url]).generate(too_long, SAMPLING, "chat")
    assert "context length" in str(err.value)
    assert not err.value.retryable
    assert requests_seen(sim) == 1


@pytest.mark.parametrize("status", [429, 503, 502, 504])
def test_overload_bursts_are_retried_with_backoff(sim, status) -> None:
    sim.set_faults(error_burst={status: 2})
    gen = client([sim.url]).generate(PROMPT, SAMPLING, "chat")
    assert gen.completion_tokens >= 1
    assert requests_seen(sim) == 3  # two refusals, then the answer


def test_overload_that_never_ends_gives_up(sim) -> None:
    sim.set_faults(error_rates={503: 1.0})
    with pytest.raises(Overloaded) as err:
        client([sim.url], retries=2).generate(PROMPT, SAMPLING, "chat")
    assert err.value.retryable
    assert requests_seen(sim) == 3


def test_500_is_a_retryable_server_error_without_http_retry(sim) -> None:
    sim.set_faults(error_rates={500: 1.0})
    with pytest.raises(ServerError):
        client([sim.url]).generate(PROMPT, SAMPLING, "chat")
    assert requests_seen(sim) == 1  # left to the job-level retry, which survives a crash


def test_read_timeout(sim) -> None:
    sim.set_faults(stall_s=3.0)
    with pytest.raises(EngineTimeout, match=r"within 0 s; at 20.0 tok/s it would have made "
                                            r"about 6 of its 64 tokens"):
        client([sim.url], read_timeout_s=0.3).generate(PROMPT, SAMPLING, "chat",
                                                       decode_tok_s=20.0)


def test_the_auto_read_timeout_grows_with_max_new_tokens_and_a_slow_decode() -> None:
    from foundation.engine.api import auto_read_timeout

    c = client(["http://e"], read_timeout_s=None)  # read_timeout_s = "auto"
    # nothing observed yet: a floor plus max_new_tokens at the slowest decode assumed
    assert c.read_timeout(32768, 0.0) == auto_read_timeout(32768) > 1800.0
    # observed 40 tok/s per request: a quarter of it is still allowed
    assert c.read_timeout(32768, 40.0) == pytest.approx(600.0 + 32768 / 10.0)
    assert c.read_timeout(512, 40.0) < c.read_timeout(32768, 40.0)
    assert client(["http://e"], read_timeout_s=7.0).read_timeout(32768, 40.0) == 7.0


def test_counts_that_disagree_are_invalid(sim) -> None:
    sim.set_faults(bad_counts_rate=1.0)
    with pytest.raises(InvalidResponse):
        client([sim.url]).generate(PROMPT, SAMPLING, "chat")


def test_connection_reset_is_retryable(sim) -> None:
    sim.set_faults(reset_rate=1.0)
    with pytest.raises(ServerError) as err:
        client([sim.url]).generate(PROMPT, SAMPLING, "chat")
    assert err.value.retryable


def test_dead_engine_is_skipped_for_a_live_one(sim) -> None:
    dead = f"http://127.0.0.1:{free_port()}"
    c = client([dead, sim.url])
    for _ in range(3):
        assert c.generate(PROMPT, SAMPLING, "chat").engine == sim.url


def test_all_engines_down_is_unreachable() -> None:
    with pytest.raises(Unreachable):
        client([f"http://127.0.0.1:{free_port()}"], retries=1).generate(PROMPT, SAMPLING, "x")


def test_parse_trims_prompt_prefix_bug() -> None:
    body = (b'{"text":"x","output_ids":[1,2,3,4,5],"meta_info":{"finish_reason":'
            b'{"type":"stop","matched":5},"prompt_tokens":2,"completion_tokens":3}}')
    gen = parse("sglang", body, 2, "e", 0.1)
    assert gen.output_ids == [3, 4, 5]


@pytest.mark.parametrize("body", [
    b'{"meta_info":{"finish_reason":null,"prompt_tokens":1,"completion_tokens":1},'
    b'"output_ids":[1]}',
    b'{"meta_info":{"finish_reason":{"type":"stop"},"prompt_tokens":1},"output_ids":[1]}',
    b'{"meta_info":{"finish_reason":{"type":"stop"},"prompt_tokens":1,"completion_tokens":1}}',
    b'not json',
])
def test_parse_refuses_unusable_replies(body) -> None:
    with pytest.raises(InvalidResponse):
        parse("sglang", body, 1, "e", 0.1)


def test_abort_finish_is_a_server_error() -> None:
    body = (b'{"text":"","output_ids":[],"meta_info":{"finish_reason":{"type":"abort",'
            b'"message":"Aborted"},"prompt_tokens":1,"completion_tokens":0}}')
    with pytest.raises(ServerError):
        parse("sglang", body, 1, "e", 0.1)


class _Reply:
    def __init__(self, status_code: int, text: str = "") -> None:
        self.status_code, self.text = status_code, text

    def raise_for_status(self) -> None:
        assert self.status_code < 400

    def json(self) -> Any:
        return json.loads(self.text)


class _Metrics:
    """A session whose load reading says the engine's queue is queue[i] at the i-th read (the
    last value from then on): on `/metrics` (`sglang:num_queue_reqs`; `/v1/loads` is 404, an
    SGLang before 0.5.9) or, with `loads`, on `/v1/loads` (two DP ranks sharing the queue)."""

    def __init__(self, queue: list[int], loads: bool = False) -> None:
        self.queue = queue
        self.loads = loads
        self.reads = 0

    def get(self, url: str, timeout: object = None, headers: object = None) -> _Reply:
        if "/v1/loads" in url and not self.loads:
            return _Reply(404)
        value = self.queue[min(self.reads, len(self.queue) - 1)]
        self.reads += 1
        if self.loads:
            ranks = [{"dp_rank": 0, "num_running_reqs": 1, "num_waiting_reqs": value // 2},
                     {"dp_rank": 1, "num_running_reqs": 1, "num_waiting_reqs": value - value // 2}]
            return _Reply(200, json.dumps({"version": "0.5.23", "loads": ranks}))
        return _Reply(200, f"sglang:num_queue_reqs {value}\n")


def test_an_engine_without_v1_loads_is_asked_for_it_once_per_reader() -> None:
    asked: list[str] = []
    metrics = _Metrics([1])

    def get(url: str, **kw: Any) -> _Reply:
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


class _Draw:
    """A stand-in for the pool's random source: random() always gives `r`."""

    def __init__(self, r: float) -> None:
        self.r = r

    def random(self) -> float:
        return self.r


def test_adaptive_gate_passes_only_on_a_reading_below_the_bound(monkeypatch) -> None:
    from consumers import routing as engines

    monkeypatch.setattr(engines, "GATE_WAIT_S", 0.001)
    monkeypatch.setattr(engines, "GATE_REFRESH_S", 0.0)  # every look is a new reading
    for loads in (False, True):
        metrics = _Metrics([2, 3, 2, 2, 0], loads)
        pool = EnginePool(["http://e"], adaptive_max_queue=2, session=metrics)
        # queue at the bound (2), above (3), at it twice more: four waits, through on the fifth
        assert pool.gate("http://e") == 4 and metrics.reads == 5
    assert EnginePool(["http://e"], session=_Metrics([50])).gate("http://e") == 0  # no gate


def test_adaptive_gate_thins_the_passes_as_the_queue_fills(monkeypatch) -> None:
    from consumers import routing as engines

    monkeypatch.setattr(engines, "GATE_WAIT_S", 0.001)
    monkeypatch.setattr(engines, "GATE_REFRESH_S", 0.0)
    # bound 4: a reading of q passes a worker whose draw r has r * 4 < 4 - q
    for queue, r, waits in (([0], 0.99, 0), ([3, 0], 0.3, 1), ([3, 3, 1], 0.3, 2),
                            ([2, 1], 0.6, 1)):
        pool = EnginePool(["http://e"], adaptive_max_queue=4, session=_Metrics(queue))
        pool._rng = _Draw(r)  # type: ignore[assignment]
        assert pool.gate("http://e") == waits, (queue, r)


def test_adaptive_gate_counts_its_own_requests_until_the_next_reading(monkeypatch) -> None:
    from consumers import routing as engines

    monkeypatch.setattr(engines, "GATE_WAIT_S", 0.001)
    monkeypatch.setattr(engines, "GATE_REFRESH_S", 3600.0)  # the first reading stays
    metrics = _Metrics([0])
    pool = EnginePool(["http://e"], adaptive_max_queue=2, session=metrics)
    pool._rng = _Draw(0.0)  # type: ignore[assignment]
    assert pool.gate("http://e") == 0  # 0 < 2
    pool.done()  # the request ended: the next one is not back from idle
    assert pool.gate("http://e") == 0 and metrics.reads == 1  # 0 + 1 < 2 on the same reading
    pool.done()
    monkeypatch.setattr(engines, "GATE_REFRESH_S", 0.0)  # 0 + 2 is the bound: a new reading
    assert pool.gate("http://e") == 0 and metrics.reads == 2


def test_a_worker_back_from_idle_reads_the_queue_afresh(monkeypatch) -> None:
    from consumers import routing as engines

    monkeypatch.setattr(engines, "GATE_WAIT_S", 0.001)
    monkeypatch.setattr(engines, "GATE_REFRESH_S", 3600.0)
    metrics = _Metrics([0, 1, 2, 3])
    pool = EnginePool(["http://e"], adaptive_max_queue=8, session=metrics)
    pool._rng = _Draw(0.0)
    pool.gate("http://e")
    pool.done()
    pool.gate("http://e")  # busy: the old reading serves
    assert metrics.reads == 1
    monkeypatch.setattr(engines, "GATE_IDLE_S", 0.0)  # now every gap counts as idle
    pool.gate("http://e")
    assert metrics.reads == 2


# -- engines as they are: keys, release families, vLLM ---------------------------------------


def test_the_api_key_is_sent_as_a_bearer_token_and_never_logged(monkeypatch, caplog) -> None:
    caplog.set_level("DEBUG")
    with SimServer(time_scale=1000.0, api_key="s3cret-key") as s:
        with pytest.raises(Unreachable, match="HTTP 401"):  # no key: refused at discovery
            client([s.url], retries=0).generate(PROMPT, SAMPLING, "chat")
        # per engine, in the URL's password
        keyed = f"http://:s3cret-key@{s.url.removeprefix('http://')}"
        gen = client([keyed]).generate(PROMPT, SAMPLING, "chat")
        assert gen.engine == s.url and gen.completion_tokens == len(gen.output_ids)
        # for every engine, from SGLANG_API_KEY
        monkeypatch.setenv("SGLANG_API_KEY", "s3cret-key")
        assert client([s.url]).generate(PROMPT, SAMPLING, "chat").engine == s.url
    assert "s3cret-key" not in caplog.text


@pytest.mark.parametrize("release", ["0.5.1", "0.5.4", "0.5.9", "0.5.15", "0.5.23"])
def test_every_sglang_release_from_0_5_1_gives_just_the_generated_ids(release: str) -> None:
    with SimServer(time_scale=1000.0, sglang_version=release) as s:
        c = client([s.url])
        gen = c.generate(PROMPT, {**SAMPLING, "ignore_eos": True}, "chat")
        assert c.info(s.url).version == release
    assert gen.completion_tokens == len(gen.output_ids) == 64
    assert gen.engine_version == release


def test_output_ids_prefixed_by_prompt_ids_are_cut_to_the_completion() -> None:
    # SGLang 0.5.1: the last prompt ids come first in output_ids
    body = json.dumps({"text": "", "output_ids": [6023, 151645, 198, 77091, 198, 9, 8, 7],
                       "meta_info": {"finish_reason": {"type": "length", "length": 3},
                                     "prompt_tokens": 9, "completion_tokens": 3}}).encode()
    assert parse("sglang", body, 9, "e", 0.1).output_ids == [9, 8, 7]


def test_a_reply_the_engine_clamped_to_its_context_is_logged(caplog) -> None:
    # SGLang 0.5.15+: input + max_new_tokens equal to the context is accepted, then clamped
    with SimServer(time_scale=1000.0, context_length=256) as s:
        gen = client([s.url]).generate(list(range(10, 110)), {
            "max_new_tokens": 156, "temperature": 0.0, "ignore_eos": True}, "chat")
    assert gen.finish_reason == "length" and gen.completion_tokens < 156
    assert f"clamped max_new_tokens from 156 to {gen.completion_tokens}" in caplog.text


def test_vllm_completions_give_token_ids_finish_reason_and_usage() -> None:
    with SimServer(time_scale=1000.0, flavor="vllm", context_length=4096) as s:
        c = client([s.url])
        gen = c.generate(PROMPT, {**SAMPLING, "ignore_eos": True}, "chat")
        assert c.info(s.url).api == "openai" and c.info(s.url).version  # found out
        stop = client([f"openai+{s.url}"]).generate(PROMPT, {"max_new_tokens": 4000}, "chat")
        with pytest.raises(BadRequest, match="maximum context length"):
            c.generate(list(range(10, 4200)), SAMPLING, "chat")
    assert (gen.finish_reason, gen.completion_tokens, len(gen.output_ids)) == ("length", 64, 64)
    assert stop.finish_reason == "stop" and stop.output_ids[-1] == stop.finish["matched"]


def test_a_vllm_that_ignores_return_token_ids_is_refused() -> None:
    from foundation.engine.api import parse

    old = json.dumps({"choices": [{"index": 0, "text": "hi", "finish_reason": "stop"}],
                      "usage": {"prompt_tokens": 9, "completion_tokens": 2}}).encode()
    with pytest.raises(InvalidResponse, match="return_token_ids"):
        parse("openai", old, 9, "e", 0.1)


def test_the_simulator_maps_vllm_fields_back_to_the_params_the_client_maps_them_from() -> None:
    # two sides of one protocol, written apart (the simulator imports nothing of tokencap)
    from foundation.engine.api import OPENAI_PARAMS
    from sglang_sim.protocol import VLLM_PARAMS

    assert {v: k for k, v in OPENAI_PARAMS.items()} == VLLM_PARAMS


class _Loads:
    """A session whose /metrics says each engine runs `running[url]` requests (mutable)."""

    def __init__(self, running: dict[str, int]) -> None:
        self.running = running

    def get(self, url: str, timeout: object = None, headers: object = None) -> _Reply:
        base = url.split("/v1/loads")[0].split("/metrics")[0].split("/health")[0]
        if "/v1/loads" in url:
            return _Reply(404)
        if url.endswith("/health"):
            return _Reply(200)
        return _Reply(200, f"sglang:num_running_reqs {self.running[base]}\n"
                           "sglang:num_queue_reqs 0\n")


ENGINES = [f"http://e{i}" for i in range(4)]


def test_a_turn_goes_to_the_engine_of_the_turn_before_unless_it_is_much_busier() -> None:
    loads = _Loads(dict.fromkeys(ENGINES, 10))
    pool = EnginePool(ENGINES, session=loads)
    assert all(pool.order(prefer="http://e2")[0] == "http://e2" for _ in range(20))
    loads.running["http://e2"] = 30  # well above every other: least loaded of two instead
    for e in pool.engines:
        e.load_at = -1e9  # a fresh reading
    firsts = {pool.order(prefer="http://e2")[0] for _ in range(20)}
    assert "http://e2" not in firsts
    pool.mark_down("http://e1")  # down: never first, whatever it is preferred for
    loads.running["http://e2"] = 10
    assert all(pool.order(prefer="http://e1")[0] != "http://e1" for _ in range(20))


def test_an_affinity_key_picks_one_engine_in_every_worker_and_keys_spread() -> None:
    loads = _Loads(dict.fromkeys(ENGINES, 5))
    pools = [EnginePool(ENGINES, session=loads) for _ in range(3)]  # three worker processes
    keys = [f"{k:016x}" for k in range(400)]
    chosen = {}
    for key in keys:
        picks = {p.order(affinity=key)[0] for p in pools}
        assert len(picks) == 1, key  # the same engine, with no coordination
        chosen[key] = picks.pop()
    spread = {url: sum(1 for v in chosen.values() if v == url) for url in ENGINES}
    assert min(spread.values()) > 60, spread  # 100 each expected
    # without a key nor a preference: the least loaded of two random picks
    loads.running.update({"http://e0": 0, "http://e1": 50, "http://e2": 50, "http://e3": 50})
    pool = EnginePool(ENGINES, session=loads)
    assert sum(pool.order()[0] == "http://e0" for _ in range(200)) > 60
