"""Parsing and validating ``/generate`` bodies the way SGLang does, and its error bodies.

Checks run in SGLang's order: body schema (HTTP 400, "Bad Request" envelope), prompt length
against the context (400 ``{"error": {"message": ...}}``), building ``SamplingParams`` (an
unknown key or a value of the wrong type raises ``TypeError`` there, which SGLang does not
catch: HTTP 500), ``SamplingParams.verify()`` (400), the scheduler's ``max_req_input_len``
(400). Messages are copied from SGLang's source.

Not simulated, and answered 400 with a message saying so: batches (a list of prompts),
``n > 1``, ``stream: true``, ``return_logprob: true``, ``input_embeds``. Of the sampling
params only ``max_new_tokens``, ``min_new_tokens``, ``ignore_eos`` and ``sampling_seed`` change
the output; the others (temperature, stop strings, grammars, ...) are validated, then ignored
(see ``sglang_sim.outputs``).
"""

from __future__ import annotations

import math
import uuid
from dataclasses import dataclass, field
from typing import Any

from sglang_sim.config import SimConfig, version
from sglang_sim.outputs import tokenize_text

# Every field of SGLang's SamplingParams msgspec Struct (API fields, then internal ones that
# its constructor also accepts). Anything else makes SamplingParams(**kwargs) raise TypeError.
SAMPLING_PARAM_FIELDS = frozenset(
    {
        "max_new_tokens", "stop", "stop_token_ids", "stop_regex", "temperature", "top_p",
        "top_k", "min_p", "frequency_penalty", "presence_penalty", "repetition_penalty",
        "min_new_tokens", "n", "json_schema", "regex", "ebnf", "structural_tag", "ignore_eos",
        "skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim",
        "custom_params", "stream_interval", "logit_bias", "sampling_seed",
        "stop_strs", "stop_regex_strs", "stop_str_max_len", "stop_regex_max_len",
        "is_normalized",
    }
)  # fmt: skip
_FLOAT_FIELDS = (
    "temperature", "top_p", "min_p", "frequency_penalty", "presence_penalty",
    "repetition_penalty",
)  # fmt: skip
_INT_FIELDS = ("top_k", "min_new_tokens", "n")
_FLOAT_DEFAULTS = {
    "temperature": 1.0, "top_p": 1.0, "min_p": 0.0, "frequency_penalty": 0.0,
    "presence_penalty": 0.0, "repetition_penalty": 1.0,
}  # fmt: skip
DEFAULT_MAX_NEW_TOKENS = 128
TOP_K_ALL = 1 << 30
# What SGLang's scheduler uses for max_new_tokens=None before clamping to the context.
UNLIMITED_NEW_TOKENS = 1 << 30
_SAMPLING_EPS = 1e-6
PENALTY_LIMIT = 2.0
NOT_SIMULATED = "not supported by simulator"


class ApiError(Exception):
    """An HTTP error reply: status, JSON body (or plain text) and extra headers."""

    def __init__(
        self, status: int, body: dict[str, Any] | str, headers: dict[str, str] | None = None
    ) -> None:
        super().__init__(f"HTTP {status}: {body}")
        self.status = status
        self.body = body
        self.headers = headers or {}


def envelope(status: int, message: str, err_type: str | None = None) -> dict[str, Any]:
    """SGLang's ErrorResponse body (HTTPException and schema-error handlers)."""
    return {
        "object": "error",
        "message": message,
        "type": err_type if err_type is not None else str(status),
        "param": None,
        "code": status,
    }


def bad_request(message: str) -> ApiError:
    """A ValueError raised while handling ``/generate``: 400 ``{"error": {"message"}}``."""
    return ApiError(400, {"error": {"message": message}})


def schema_error(message: str) -> ApiError:
    return ApiError(400, envelope(400, message, "Bad Request"))


def internal_error(message: str) -> ApiError:
    return ApiError(500, envelope(500, message, "InternalServerError"))


def queue_full() -> ApiError:
    return ApiError(503, envelope(503, "The request queue is full."))


@dataclass(frozen=True)
class GenerateRequest:
    """A parsed single-prompt request, before semantic validation."""

    rid: str
    input_ids: list[int]
    sampling_params: dict[str, Any]


@dataclass(frozen=True)
class ValidRequest:
    """A request that passed every check; ``max_new_tokens`` is the effective cap.
    ``sampling`` holds SGLang's SamplingParams after its ``__post_init__`` (defaults filled,
    temperature 0 turned into temperature 1 with top_k 1, top_k -1 into ``TOP_K_ALL``):
    what an engine that really samples (gpu_check's) applies."""

    rid: str
    input_ids: list[int]
    max_new_tokens: int
    min_new_tokens: int
    ignore_eos: bool
    sampling_seed: int | None
    sampling: dict[str, Any] = field(default_factory=dict)
    stop_token_ids: tuple[int, ...] = ()


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def parse_generate(body: Any, config: SimConfig) -> GenerateRequest:
    """Check the body's shape and turn ``text`` into token ids; raise ApiError."""
    if not isinstance(body, dict):
        raise schema_error("Input should be a valid dictionary or object")
    text, input_ids = body.get("text"), body.get("input_ids")
    if body.get("input_embeds") is not None:
        raise bad_request(f"input_embeds {NOT_SIMULATED}")
    if (text is None) == (input_ids is None):
        raise bad_request("Either text, input_ids or input_embeds should be provided.")
    if isinstance(text, list) or (
        isinstance(input_ids, list) and input_ids and isinstance(input_ids[0], list)
    ):
        raise bad_request(f"batch {NOT_SIMULATED}")
    if body.get("stream"):
        raise bad_request(f"stream {NOT_SIMULATED}")
    if body.get("return_logprob"):
        raise bad_request(f"return_logprob {NOT_SIMULATED}")
    if text is not None:
        if not isinstance(text, str):
            raise schema_error("text: Input should be a valid string")
        ids = tokenize_text(text, config.vocab_size, config.eos_token_id)
    else:
        if not isinstance(input_ids, list) or not all(_is_int(t) for t in input_ids):
            raise schema_error("input_ids: Input should be a valid list of integers")
        ids = list(input_ids)
    if not ids:
        raise bad_request("input_ids cannot be empty.")
    bad = next((t for t in ids if not 0 <= t < config.vocab_size), None)
    if bad is not None:
        raise bad_request(f"Token id {bad} is out of the vocabulary [0, {config.vocab_size}).")
    params = body.get("sampling_params")
    if params is None:
        params = {}
    if isinstance(params, list):
        raise bad_request(f"batch {NOT_SIMULATED}")
    if not isinstance(params, dict):
        raise schema_error("sampling_params: Input should be a valid dictionary")
    rid = body.get("rid")
    if rid is None:
        rid = uuid.uuid4().hex
    elif not isinstance(rid, str):
        raise schema_error("rid: Input should be a valid string")
    return GenerateRequest(rid=rid, input_ids=ids, sampling_params=params)


# vLLM's /v1/completions field -> SGLang's sampling param (the same generation)
VLLM_PARAMS = {
    "max_tokens": "max_new_tokens", "min_tokens": "min_new_tokens", "seed": "sampling_seed",
    "include_stop_str_in_output": "no_stop_trim", "temperature": "temperature",
    "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
    "frequency_penalty": "frequency_penalty", "presence_penalty": "presence_penalty",
    "repetition_penalty": "repetition_penalty", "stop": "stop",
    "stop_token_ids": "stop_token_ids", "ignore_eos": "ignore_eos",
    "skip_special_tokens": "skip_special_tokens", "logit_bias": "logit_bias",
}  # fmt: skip
VLLM_DEFAULT_MAX_TOKENS = 16


def parse_completion(body: Any, config: SimConfig) -> tuple[GenerateRequest, bool, int]:
    """vLLM's /v1/completions body as the simulator's request; also whether the reply carries
    token ids (`return_token_ids`) and the max_tokens asked. Unknown fields are ignored, as
    vLLM does; max_tokens past the context is clamped (vLLM 0.11 and later)."""
    if not isinstance(body, dict):
        raise schema_error("Input should be a valid dictionary or object")
    model = body.get("model")
    if model is not None and model != config.model_path:
        raise ApiError(404, {"error": f"The model `{model}` does not exist."})
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        prompt = tokenize_text(prompt, config.vocab_size, config.eos_token_id)
    if not isinstance(prompt, list) or not prompt or not all(_is_int(t) for t in prompt):
        raise bad_request("prompt must be a string or a non-empty list of token ids "
                          f"(batches {NOT_SIMULATED})")
    if body.get("stream"):
        raise bad_request(f"stream {NOT_SIMULATED}")
    bad = next((t for t in prompt if not 0 <= t < config.vocab_size), None)
    if bad is not None:
        raise bad_request(f"Token id {bad} is out of vocabulary")
    if len(prompt) >= config.context_length:  # vLLM 0.32's words
        raise ApiError(400, {"error": {
            "message": f"This model's maximum context length is {config.context_length} "
                       f"tokens. However, your prompt contains {len(prompt)} input tokens, "
                       "which exceeds this limit even without any output tokens. Please "
                       "reduce the length of the input prompt. (parameter=input_tokens, "
                       f"value={len(prompt)})",
            "type": "BadRequestError", "param": "input_tokens", "code": 400}})
    params = {VLLM_PARAMS[k]: v for k, v in body.items() if k in VLLM_PARAMS and v is not None}
    asked = params.get("max_new_tokens", VLLM_DEFAULT_MAX_TOKENS)
    if _is_int(asked):
        params["max_new_tokens"] = min(asked, config.context_length - len(prompt))
    else:
        params["max_new_tokens"] = asked
    given = body.get("request_id")  # vLLM's: the client's, else a random one
    rid = given if isinstance(given, str) and given else uuid.uuid4().hex
    return (GenerateRequest(rid=rid, input_ids=list(prompt), sampling_params=params),
            bool(body.get("return_token_ids")), asked if _is_int(asked) else 0)


def _check_context(num_input: int, max_new: Any, config: SimConfig) -> None:
    """tokenizer_manager._validate_one_request (without --allow-auto-truncate): input plus
    max_new_tokens must stay below the context up to 0.5.9, may equal it from 0.5.15."""
    context = config.context_length
    if num_input >= context:
        raise bad_request(
            f"The input ({num_input} tokens) is longer than the model's "
            f"context length ({context} tokens)."
        )
    equal_ok = version(config.sglang_version) >= (0, 5, 15)
    if _is_number(max_new) and (max_new + num_input > context or (
            max_new + num_input == context and not equal_ok)):
        total = max_new + num_input
        raise bad_request(
            f"Requested token count exceeds the model's maximum context length "
            f"of {context} tokens. You requested a total of {total} "
            f"tokens: {num_input} tokens from the input messages and "
            f"{max_new} tokens for the completion. Please reduce the number "
            f"of tokens in the input messages or the completion to fit within the limit."
        )


def _build_sampling(params: dict[str, Any], release: tuple[int, ...] = (0, 5, 23)
                    ) -> dict[str, Any]:
    """SamplingParams(**params) and its __post_init__. An unknown key: a TypeError SGLang
    does not catch (500, plain text) up to 0.5.15; its schema check's 400 from 0.5.23."""
    unknown = sorted(set(params) - SAMPLING_PARAM_FIELDS)
    if unknown:
        if release >= (0, 5, 23):
            expected = ", ".join(f"`{f}`" for f in sorted(SAMPLING_PARAM_FIELDS))
            raise ApiError(400, {"error": f"unknown field `{unknown[0]}`, expected one of "
                                          f"{expected}"})
        raise ApiError(500, "Internal Server Error")
    sp: dict[str, Any] = {k: params.get(k) for k in (*_FLOAT_FIELDS, *_INT_FIELDS)}
    for name in _FLOAT_FIELDS:
        if sp[name] is None:
            sp[name] = _FLOAT_DEFAULTS[name]
        elif not _is_number(sp[name]):
            raise internal_error(f"TypeError: sampling param '{name}' must be a number")
    for name, default in (("top_k", -1), ("min_new_tokens", 0), ("n", 1)):
        if sp[name] is None:
            sp[name] = default
        elif not _is_int(sp[name]):
            raise internal_error(f"TypeError: sampling param '{name}' must be an integer")
    max_new = params.get("max_new_tokens", DEFAULT_MAX_NEW_TOKENS)
    if max_new is not None and not _is_int(max_new):
        raise internal_error("TypeError: sampling param 'max_new_tokens' must be an integer")
    seed = params.get("sampling_seed")
    if seed is not None and not _is_int(seed):
        raise internal_error("TypeError: sampling param 'sampling_seed' must be an integer")
    sp["max_new_tokens"] = max_new
    if 0 <= sp["temperature"] < _SAMPLING_EPS:
        sp["temperature"], sp["top_k"] = 1.0, 1
    if sp["top_k"] == -1:
        sp["top_k"] = TOP_K_ALL
    for key in ("logit_bias", "json_schema", "regex", "ebnf", "ignore_eos", "sampling_seed"):
        sp[key] = params.get(key)
    return sp


def _verify(sp: dict[str, Any], vocab_size: int) -> None:
    """SamplingParams.verify(), same checks and messages."""
    temp, top_p, min_p = sp["temperature"], sp["top_p"], sp["min_p"]
    if not math.isfinite(temp) or temp < 0.0:
        raise bad_request(f"temperature must be a non-negative finite number, got {temp}.")
    if not 0.0 < top_p <= 1.0:
        raise bad_request(f"top_p must be in (0, 1], got {top_p}.")
    if not 0.0 <= min_p <= 1.0:
        raise bad_request(f"min_p must be in [0, 1], got {min_p}.")
    if sp["top_k"] < 1:
        raise bad_request(f"top_k must be -1 (disable) or at least 1, got {sp['top_k']}.")
    for name in ("frequency_penalty", "presence_penalty"):
        if not -PENALTY_LIMIT <= sp[name] <= PENALTY_LIMIT:
            raise bad_request(f"{name} must be in [-2, 2], got {sp[name]}.")
    if not 0.0 < sp["repetition_penalty"] <= PENALTY_LIMIT:
        raise bad_request(
            "repetition_penalty must be in (0, 2] (1.0 = no penalty), "
            f"got {sp['repetition_penalty']}."
        )
    min_new, max_new = sp["min_new_tokens"], sp["max_new_tokens"]
    if min_new < 0:
        raise bad_request(f"min_new_tokens must be in [0, max_new_tokens], got {min_new}.")
    if max_new is not None:
        if max_new < 0:
            raise bad_request(f"max_new_tokens must be at least 0, got {max_new}.")
        if min_new > max_new:
            raise bad_request(
                f"min_new_tokens must be in [0, max_new_tokens({max_new})], got {min_new}."
            )
    for token_id in sp["logit_bias"] or {}:
        try:
            in_vocab = 0 <= int(token_id) < vocab_size
        except (TypeError, ValueError) as exc:
            raise bad_request(str(exc)) from exc
        if not in_vocab:
            raise bad_request(f"logit_bias must has keys in [0, {vocab_size - 1}], got {token_id}.")
    if sum(sp[g] is not None for g in ("json_schema", "regex", "ebnf")) > 1:
        raise bad_request("Only one of regex, json_schema, or ebnf can be set.")


def validate_generate(req: GenerateRequest, config: SimConfig) -> ValidRequest:
    """Run SGLang's checks on a parsed request; raise ApiError with SGLang's reply."""
    num_input = len(req.input_ids)
    vllm = config.flavor == "vllm"  # parse_completion checked and clamped to the context
    if not vllm:
        _check_context(num_input, req.sampling_params.get("max_new_tokens"), config)
    sp = _build_sampling(req.sampling_params, version(config.sglang_version))
    _verify(sp, config.vocab_size)
    if sp["n"] != 1:
        raise bad_request(f"n > 1 (parallel sampling) {NOT_SIMULATED}")
    if not vllm and num_input > config.max_req_input_len:
        raise bad_request(
            f"Input length ({num_input} tokens) exceeds the maximum allowed length "
            f"({config.max_req_input_len} tokens). Use a shorter input or enable "
            "--allow-auto-truncate."
        )
    # Scheduler.init_req_max_new_tokens: cap to what fits in max_req_len.
    requested = sp["max_new_tokens"]
    if requested is None:
        requested = UNLIMITED_NEW_TOKENS
    cap = max(0, min(requested, config.context_length - num_input if vllm else
                     config.max_req_len - num_input - 1))
    return ValidRequest(
        rid=req.rid,
        input_ids=req.input_ids,
        max_new_tokens=cap,
        min_new_tokens=sp["min_new_tokens"],
        ignore_eos=bool(sp["ignore_eos"]),
        sampling_seed=sp["sampling_seed"],
        sampling=sp,
        stop_token_ids=tuple(_stop_token_ids(req.sampling_params.get("stop_token_ids"))),
    )


def _stop_token_ids(value: Any) -> list[int]:
    """SamplingParams.stop_token_ids: a list of ints, or None."""
    if value is None:
        return []
    if not isinstance(value, list) or not all(_is_int(t) for t in value):
        raise internal_error("TypeError: sampling param 'stop_token_ids' must be a list of ints")
    return list(value)
