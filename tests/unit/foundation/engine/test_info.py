"""`foundation/engine/info.py`: what an engine serves (`discover`: API, model, version, context
length, a simulator, metrics), its vocabulary size, the smallest context of several, and why
one does not answer, asked of the simulator playing SGLang releases and vLLM."""

from __future__ import annotations

import pytest
import requests

from foundation.engine.api import SIM_MODEL, engine_spec
from foundation.engine.info import (
    EngineInfo,
    context_length,
    discover,
    healthy,
    trouble,
    vocab_size,
    why_unreachable,
)
from foundation.errors import EngineNotReady, EngineUnusable
from sglang_sim.testing import SimServer
from testing.harness import free_port


def refused_url() -> str:
    """A loopback URL nothing listens on (the port was free a moment ago)."""
    return f"http://127.0.0.1:{free_port()}"


@pytest.mark.parametrize(("engine", "api", "version"), [
    ({}, "sglang", "0.5.23"),
    ({"sglang_version": "0.5.4"}, "sglang", "0.5.4"),  # /get_server_info only
    ({"flavor": "vllm"}, "openai", "0.32.0"),  # /v1/models owned_by vllm, /version
])
def test_an_engine_says_its_api_model_version_and_context(engine: dict, api: str,
                                                           version: str) -> None:
    with SimServer(time_scale=100.0, context_length=4096, **engine) as sim:
        info = discover(engine_spec(sim.url))
        forced = discover(engine_spec(f"{api}+{sim.url}"))
    assert info == EngineInfo(url=sim.url, api=api, model=SIM_MODEL, version=version,
                              context_length=4096, simulated=True, metrics=True)
    assert forced == info


def test_a_simulator_serving_a_real_model_s_name_still_says_it_is_one() -> None:
    with SimServer(time_scale=100.0, model_path="Qwen/Qwen3-8B") as sim:
        info = discover(engine_spec(sim.url))
    assert (info.model, info.simulated) == ("Qwen/Qwen3-8B", True)


def test_a_key_refused_is_unusable_and_an_engine_away_is_not_ready() -> None:
    with SimServer(time_scale=100.0, api_key="k3y") as sim:
        with pytest.raises(EngineUnusable, match="HTTP 401") as refused:
            discover(engine_spec(sim.url))
        assert not isinstance(refused.value, EngineNotReady)
        assert "k3y" not in str(refused.value)
        assert discover(engine_spec(sim.url.replace("http://", "http://:k3y@"))).api == "sglang"
    url = refused_url()
    with pytest.raises(EngineNotReady) as away:
        discover(engine_spec(url))
    assert away.value.reason == "connection refused" and url in str(away.value)


def test_sglang_s_vocabulary_is_read_from_its_refusal_and_vllm_s_is_not_said() -> None:
    with SimServer(time_scale=100.0, vocab_size=5000, eos_token_id=2) as sim:
        assert vocab_size(engine_spec(sim.url)) == 5000
    with SimServer(time_scale=100.0, flavor="vllm") as sim:
        assert vocab_size(engine_spec(sim.url)) is None
    assert vocab_size(engine_spec(refused_url())) is None


def test_several_engines_have_the_smallest_context_any_says(caplog) -> None:
    with SimServer(time_scale=100.0, context_length=4096) as big, \
            SimServer(time_scale=100.0, context_length=2048) as small:
        specs = [engine_spec(u) for u in (big.url, refused_url(), small.url)]
        assert context_length(specs) == 2048
        assert context_length(specs[:1]) == 4096
    assert "could not read the context length" in caplog.text
    assert context_length([engine_spec(refused_url())]) is None


def test_the_trouble_of_an_engine_is_what_its_health_check_says() -> None:
    with SimServer(time_scale=100.0) as sim:
        assert trouble(engine_spec(sim.url)) == ""
        assert healthy(sim.url)
    assert trouble(engine_spec(f"http://127.0.0.1:{free_port()}")) == "connection refused"
    assert not healthy(refused_url(), timeout_s=2.0)


@pytest.mark.parametrize(("exc", "words"), [
    (requests.ConnectTimeout("pool: timed out"), "no connection within 3.05 s"),
    (requests.ReadTimeout("read timed out"), "no answer within 10 s"),
    (requests.ConnectionError("Max retries ... [Errno 111] Connection refused"),
     "connection refused"),
    (requests.ConnectionError("Failed to resolve: Name or service not known"), "unknown host"),
    (requests.ConnectionError("('Connection aborted.', RemoteDisconnected('Remote end closed "
                              "connection without response'))"), "connection closed unanswered"),
    (requests.TooManyRedirects("30 redirects"), "TooManyRedirects"),
])
def test_a_connection_failure_is_said_in_a_few_words(exc: requests.RequestException,
                                                     words: str) -> None:
    assert why_unreachable(exc, (3.05, 10.0)) == words
