"""`foundation/engine/api.py`: engines named (`SGLANG_URL` items, API prefixes, keys), asked
for one generation (the request of each API), and their replies and errors read: each
release's reply shape, what a training set cannot use refused."""

from __future__ import annotations

import json

import pytest

from foundation.engine.api import (
    API_KEY_ENV,
    COMPLETIONS_PATH,
    GENERATE_PATH,
    EngineSpec,
    InvalidResponse,
    ServerError,
    display,
    engine_spec,
    engine_specs,
    error_message,
    parse,
    parse_urls,
    request,
    retry_delay_s,
    transient_status,
)


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


def test_output_ids_prefixed_by_prompt_ids_are_cut_to_the_completion() -> None:
    # SGLang 0.5.1: the last prompt ids come first in output_ids
    body = json.dumps({"text": "", "output_ids": [6023, 151645, 198, 77091, 198, 9, 8, 7],
                       "meta_info": {"finish_reason": {"type": "length", "length": 3},
                                     "prompt_tokens": 9, "completion_tokens": 3}}).encode()
    assert parse("sglang", body, 9, "e", 0.1).output_ids == [9, 8, 7]


def test_a_vllm_that_ignores_return_token_ids_is_refused() -> None:
    old = json.dumps({"choices": [{"index": 0, "text": "hi", "finish_reason": "stop"}],
                      "usage": {"prompt_tokens": 9, "completion_tokens": 2}}).encode()
    with pytest.raises(InvalidResponse, match="return_token_ids"):
        parse("openai", old, 9, "e", 0.1)


def test_the_simulator_maps_vllm_fields_back_to_the_params_the_client_maps_them_from() -> None:
    # two sides of one protocol, written apart (the simulator imports nothing of tokencap)
    from foundation.engine.api import OPENAI_PARAMS
    from sglang_sim.protocol import VLLM_PARAMS

    assert {v: k for k, v in OPENAI_PARAMS.items()} == VLLM_PARAMS


# -- names -------------------------------------------------------------------------------------

def test_an_engine_is_named_with_its_api_and_key_and_printed_without_the_key(
        monkeypatch) -> None:
    monkeypatch.delenv(API_KEY_ENV, raising=False)
    assert engine_spec("http://gpu:30000/") == EngineSpec("http://gpu:30000", "auto", None)
    keyed = engine_spec("openai+http://:s3cret@gpu:8000/")
    assert keyed == EngineSpec("http://gpu:8000", "openai", "s3cret")
    assert keyed.headers() == {"Authorization": "Bearer s3cret"}
    assert EngineSpec("http://gpu:8000").headers() == {}
    assert engine_spec("sglang+http://gpu:30000/v1").url == "http://gpu:30000/v1"
    assert display("openai+http://:s3cret@gpu:8000") == "openai+http://gpu:8000"
    assert display("http://:s3cret@gpu:30000") == "http://gpu:30000"


def test_sglang_url_lists_the_engines_and_the_key_variable_serves_those_without_one(
        monkeypatch) -> None:
    assert parse_urls(" http://a:1/ , ,http://b:2 ") == ["http://a:1", "http://b:2"]
    assert parse_urls(None) == parse_urls("") == []
    monkeypatch.setenv(API_KEY_ENV, "everyone")
    a, b = engine_specs("http://a:1,http://:mine@b:2")
    assert (a.key, b.key) == ("everyone", "mine")
    assert engine_specs(["openai+http://c:3"]) == [EngineSpec("http://c:3", "openai", "everyone")]


# -- one generation asked --------------------------------------------------------------------

def test_each_api_is_asked_in_its_own_words() -> None:
    sampling = {"max_new_tokens": 8, "sampling_seed": 3, "no_stop_trim": True, "top_k": 5}
    path, body = request("sglang", [1, 2], sampling, "rid-1")
    assert path == GENERATE_PATH
    assert json.loads(body) == {"input_ids": [1, 2], "sampling_params": sampling, "rid": "rid-1"}
    path, body = request("openai", [1, 2], {**sampling, "json_schema": "{}"}, "rid-1")
    assert path == COMPLETIONS_PATH
    assert json.loads(body) == {"max_tokens": 8, "seed": 3, "include_stop_str_in_output": True,
                                "top_k": 5, "prompt": [1, 2], "return_token_ids": True,
                                "stream": False, "n": 1, "request_id": "rid-1"}


def test_retries_back_off_as_urllib3_does_within_the_bound() -> None:
    assert retry_delay_s(0, 60.0) == retry_delay_s(1, 60.0) == 0.0
    assert [retry_delay_s(n, 60.0, jitter=0.0) for n in (2, 3, 4)] == [1.0, 2.0, 4.0]
    assert retry_delay_s(3, 60.0, jitter=0.25) == 2.25
    assert retry_delay_s(20, 5.0) == 5.0
    assert all(1.0 <= retry_delay_s(2, 60.0) < 1.5 for _ in range(50))


@pytest.mark.parametrize(("code", "transient"), [
    (429, True), (500, True), (503, True), (599, True),
    (200, False), (400, False), (401, False), (404, False), (600, False)])
def test_a_busy_or_failing_engine_may_answer_later(code: int, transient: bool) -> None:
    assert transient_status(code) is transient


# -- replies and errors read --------------------------------------------------------------------

@pytest.mark.parametrize(("body", "message"), [
    (b'{"error": {"message": "too long", "code": 400}}', "too long"),  # SGLang
    (b'{"error": "Unauthorized"}', "Unauthorized"),  # a 401, SGLang 0.5.23's schema check
    (b'{"object": "error", "message": "maximum context length is 4096"}',
     "maximum context length is 4096"),  # vLLM
    ("Unknown sampling param 'foo'\n", "Unknown sampling param 'foo'"),  # plain text
    (b"\xff not utf-8", "\ufffd not utf-8"),
    (b'["a", "list"]', "['a', 'list']"),
])
def test_an_error_reply_s_message_is_read_whatever_its_shape(body, message: str) -> None:
    assert error_message(body) == message


def test_an_error_message_is_cut_to_a_line_s_worth() -> None:
    assert len(error_message(b"x" * 5000)) == 300
    assert len(error_message(b'{"error": {"message": "' + b"y" * 5000 + b'"}}')) == 300


def _sglang(meta: dict, **reply: object) -> bytes:
    return json.dumps({"text": "t", "output_ids": [7, 8], **reply, "meta_info": {
        "finish_reason": {"type": "stop", "matched": 8}, "prompt_tokens": 3,
        "completion_tokens": 2, **meta}}).encode()


def test_an_sglang_reply_gives_the_engine_s_counts_latency_and_cache(caplog) -> None:
    gen = parse("sglang", _sglang({"e2e_latency": 1.5, "cached_tokens": 2}), 3, "http://e", 9.0)
    assert (gen.output_ids, gen.text, gen.finish_reason, gen.finish) == (
        [7, 8], "t", "stop", {"type": "stop", "matched": 8})
    assert (gen.prompt_tokens, gen.completion_tokens, gen.latency_s, gen.cached_tokens) == (
        3, 2, 1.5, 2)
    assert parse("sglang", _sglang({}), 3, "e", 9.0).latency_s == 9.0  # measured: not said
    assert parse("sglang", _sglang({}), 3, "e", 9.0).cached_tokens is None
    # the engine counted other prompt tokens than were sent: its count, and a warning
    assert parse("sglang", _sglang({}), 5, "http://e", 0.1).prompt_tokens == 3
    assert "engine http://e counted 3 prompt tokens, sent 5" in caplog.text


def test_an_sglang_before_0_5_1_gives_no_output_ids_and_is_refused() -> None:
    body = json.dumps({"text": "t", "meta_info": {"finish_reason": {"type": "stop"},
                                                  "prompt_tokens": 1,
                                                  "completion_tokens": 1}}).encode()
    with pytest.raises(InvalidResponse, match="older than 0.5.1"):
        parse("sglang", body, 1, "e", 0.1)


def _completion(finish: str | None, ids: tuple[int, ...] | None = (5, 6, 7),
                completion: int = 3, **extra: object) -> bytes:
    choice = {"index": 0, "text": "abc", "finish_reason": finish,
              **({"token_ids": list(ids)} if ids is not None else {})}
    return json.dumps({"choices": [choice], "usage": {"prompt_tokens": 2,
                                                      "completion_tokens": completion},
                       **extra}).encode()


def test_a_completion_reply_says_its_finish_as_sglang_would() -> None:
    cut = parse("openai", _completion("length"), 2, "e", 0.3)
    assert (cut.output_ids, cut.finish_reason, cut.finish) == (
        [5, 6, 7], "length", {"type": "length", "length": 3})
    stop = parse("openai", _completion("stop"), 2, "e", 0.3)
    assert stop.finish == {"type": "stop", "matched": 7}  # the last id: the stop token
    body = json.loads(_completion("stop"))
    body["choices"][0]["stop_reason"] = "</s>"
    assert parse("openai", json.dumps(body).encode(), 2, "e", 0.3).finish == {
        "type": "stop", "matched": "</s>"}


def test_a_completion_reply_gives_its_cache_and_hidden_states_file() -> None:
    doc = json.loads(_completion("length", kv_transfer_params={
        "hidden_states_path": "/shared/r1.safetensors"}))
    doc["usage"] = {"prompt_tokens": 2, "completion_tokens": 3,
                    "prompt_tokens_details": {"cached_tokens": 2}}
    gen = parse("openai", json.dumps(doc).encode(), 2, "e", 0.3)
    assert (gen.cached_tokens, gen.hidden_states_path) == (2, "/shared/r1.safetensors")
    plain = parse("openai", _completion("stop"), 2, "e", 0.3)
    assert (plain.cached_tokens, plain.hidden_states_path) == (None, None)


@pytest.mark.parametrize(("body", "error"), [
    (_completion("abort"), ServerError),
    (_completion("error"), ServerError),
    (_completion(None), InvalidResponse),
    (_completion("stop", completion=2), InvalidResponse),  # 3 ids, 2 counted
    (json.dumps({"choices": []}).encode(), InvalidResponse),
    (json.dumps({"choices": [{"finish_reason": "stop", "token_ids": [1]}]}).encode(),
     InvalidResponse),  # no usage
    (b"<html>502</html>", InvalidResponse),
])
def test_a_completion_reply_a_training_set_cannot_use_is_refused(body: bytes, error) -> None:
    with pytest.raises(error):
        parse("openai", body, 2, "e", 0.1)
