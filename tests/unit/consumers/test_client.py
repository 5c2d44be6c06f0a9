"""The engine client (`consumers/client.py`) against the simulator: retries, errors, timeouts,
validation, API keys, each SGLang release and vLLM."""

from __future__ import annotations

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


