"""Engines: how they are named, how they are asked for one generation and how their replies
and errors are read. The one place that knows SGLang's native API
(`POST /generate`) and the OpenAI-compatible one (`POST /v1/completions`, vLLM).

Naming (`SGLANG_URL`, comma separated): ``http://host:30000``; a prefix picks the API,
``sglang+http://...`` or ``openai+http://...`` (default: found out from ``/v1/models``'
``owned_by``); an API key, sent as ``Authorization: Bearer``, comes from ``SGLANG_API_KEY``
or, per engine, from the URL's password (``http://:KEY@host:30000``). A key is never
printed: `EngineSpec.url` has none.

What an engine serves (`discover`, `vocab_size`) is `foundation/engine/info.py`; its load
(`/v1/loads`, `/metrics`) is `foundation/engine/load.py`.

Versions handled (read in their source: SGLang 0.4.10 to 0.5.23, vLLM 0.10.1 to 0.33):

- SGLang 0.4.x: no ``output_ids`` in a ``/generate`` reply: refused (`InvalidResponse`);
- early SGLang 0.5 releases (played by the simulator as 0.5.1 to 0.5.4): ``output_ids``
  starts with prompt ids: the last ``completion_tokens`` are kept;
- error bodies ``{"error": {"message": ...}}``, ``{"error": "..."}`` (0.5.23's schema check,
  and 401s), ``{"object": "error", "message": ...}``, or plain text (an unknown sampling key
  before 0.5.23): all read by `error_message`;
- vLLM returns token ids only with ``return_token_ids`` (0.10.2 and later); an older vLLM
  ignores the field and is refused (`InvalidResponse`);
- load from ``/v1/loads`` (0.5.9 and later), else ``/metrics``
  (`foundation/engine/load.py`).
"""

from __future__ import annotations

import logging
import os
import random
from typing import Any, NamedTuple
from urllib.parse import urlsplit, urlunsplit

import msgspec

from foundation.errors import TokencapError
from foundation.wire import ErrorKind, TokenId

log = logging.getLogger(__name__)

API_SGLANG, API_OPENAI, API_AUTO = "sglang", "openai", "auto"
API_KEY_ENV = "SGLANG_API_KEY"
SIM_MODEL = "tokencap-sglang-sim"
INFO_TIMEOUT_S = (3.05, 10.0)
# SGLang's /health runs a one-token generation and may take seconds on a busy engine (its
# own limit is 20 s): a probe waits that long before calling an engine down.
HEALTH_TIMEOUT_S = (3.05, 25.0)
# `read_timeout_s = "auto"`: a request may take a floor (queueing, prefill) plus its
# max_new_tokens at a quarter of the decode rate observed per request (at least MIN_DECODE)
READ_TIMEOUT_FLOOR_S = 600.0
READ_TIMEOUT_RATE_SHARE = 0.25
MIN_DECODE_TOK_S = 2.0
COMPLETIONS_PATH = "/v1/completions"
GENERATE_PATH = "/generate"
# Transient HTTP answers: a generation is retried on these (urllib3's Retry in the worker's
# client) and the preflight waits on them (and on any 5xx), both with urllib3's backoff
RETRY_STATUSES = frozenset({429, 502, 503, 504})
BACKOFF_FACTOR_S = 0.5
BACKOFF_JITTER_S = 0.5


def retry_delay_s(failed: int, max_s: float, jitter: float | None = None) -> float:
    """The wait after `failed` tries in a row failed, as urllib3's `Retry.get_backoff_time`
    computes it for the worker's client: none after the first, then BACKOFF_FACTOR_S x
    2^(failed-1) plus `jitter` (default: uniform in [0, BACKOFF_JITTER_S)), at most `max_s`."""
    if failed <= 1:
        return 0.0
    extra = random.random() * BACKOFF_JITTER_S if jitter is None else jitter
    return max(0.0, min(max_s, BACKOFF_FACTOR_S * 2.0 ** (failed - 1) + extra))


def transient_status(code: int) -> bool:
    """An HTTP status that a later try may not get: 429 (busy) or any 5xx."""
    return code == 429 or 500 <= code <= 599


def auto_read_timeout(max_new_tokens: int, decode_tok_s: float = 0.0) -> float:
    """How long one request may take to answer (`read_timeout_s = "auto"`)."""
    rate = max(MIN_DECODE_TOK_S, decode_tok_s * READ_TIMEOUT_RATE_SHARE)
    return READ_TIMEOUT_FLOOR_S + max_new_tokens / rate


# -- names ---------------------------------------------------------------------------------
class EngineSpec(NamedTuple):
    """One engine: its URL (no key in it), API (sglang, openai or auto) and API key."""

    url: str
    api: str = API_AUTO
    key: str | None = None

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.key}"} if self.key else {}


def parse_urls(value: str | None) -> list[str]:
    """`SGLANG_URL` style: one or several engines, comma separated (as given)."""
    return [u.strip().rstrip("/") for u in (value or "").split(",") if u.strip()]


def engine_spec(item: str, default_key: str | None = None) -> EngineSpec:
    """One `SGLANG_URL` item as an `EngineSpec` (module docstring)."""
    api = API_AUTO
    for prefix in (API_SGLANG, API_OPENAI):
        if item.startswith(prefix + "+"):
            api, item = prefix, item[len(prefix) + 1:]
    parts = urlsplit(item)
    key = parts.password or default_key
    netloc = parts.hostname or ""
    if parts.port:
        netloc += f":{parts.port}"
    url = urlunsplit((parts.scheme, netloc, parts.path, parts.query, "")).rstrip("/")
    return EngineSpec(url, api, key)


def engine_specs(value: str | list[str] | None) -> list[EngineSpec]:
    """Every engine of `SGLANG_URL` (a string or its items), keys from `SGLANG_API_KEY`."""
    items = parse_urls(value) if isinstance(value, str) or value is None else value
    default_key = os.environ.get(API_KEY_ENV) or None
    return [engine_spec(i, default_key) for i in items]


def display(item: str) -> str:
    """An `SGLANG_URL` item fit to print: any key taken out."""
    spec = engine_spec(item)
    return spec.url if spec.api == API_AUTO else f"{spec.api}+{spec.url}"


# -- errors ----------------------------------------------------------------------------------
class EngineError(TokencapError):
    """A request that did not give a usable result. `kind` says why; `retryable` whether a
    later attempt (another job run) may succeed."""

    kind = ErrorKind.SERVER_ERROR
    retryable = True

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


class BadRequest(EngineError):
    kind = ErrorKind.BAD_REQUEST
    retryable = False


class Overloaded(EngineError):
    kind = ErrorKind.OVERLOAD


class EngineTimeout(EngineError):
    kind = ErrorKind.TIMEOUT


class Unreachable(EngineError):
    kind = ErrorKind.UNREACHABLE


class InvalidResponse(EngineError):
    kind = ErrorKind.INVALID_RESPONSE


class ServerError(EngineError):
    kind = ErrorKind.SERVER_ERROR


class BadStates(EngineError):
    """A hidden-state file the engine wrote that fails its checks: sent again, then dead."""

    kind = ErrorKind.BAD_STATES


def error_message(body: bytes | str) -> str:
    """The message of an error reply, whatever its shape (module docstring)."""
    text = body.decode(errors="replace") if isinstance(body, bytes) else body
    try:
        doc = msgspec.json.decode(text)
    except msgspec.DecodeError:
        return text.strip()[:300]
    if isinstance(doc, dict):
        err = doc.get("error")
        if isinstance(err, dict):
            return str(err.get("message", err))[:300]
        if isinstance(err, str):
            return err[:300]
        return str(doc.get("message", doc))[:300]
    return str(doc)[:300]


# -- one generation ------------------------------------------------------------------------
class Generation(msgspec.Struct, frozen=True):
    """A validated reply: the generated ids and what the engine said of them."""

    output_ids: list[int]
    text: str
    prompt_tokens: int
    completion_tokens: int
    finish_reason: str
    finish: dict[str, Any]
    latency_s: float
    engine: str
    model: str = ""
    engine_version: str = ""
    simulated: bool = False
    # the prompt's prefix the engine served from its prefix cache (SGLang's
    # meta_info.cached_tokens; vLLM's usage.prompt_tokens_details.cached_tokens, given with
    # --enable-prompt-tokens-details); None when the engine does not say
    cached_tokens: int | None = None
    # vLLM with `extract_hidden_states`: the file its KV connector wrote the prompt's hidden
    # states to (`kv_transfer_params.hidden_states_path`)
    hidden_states_path: str | None = None


# SGLang sampling param -> the OpenAI completions field (vLLM's names)
OPENAI_PARAMS = {
    "max_new_tokens": "max_tokens", "min_new_tokens": "min_tokens", "sampling_seed": "seed",
    "no_stop_trim": "include_stop_str_in_output", "temperature": "temperature",
    "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
    "frequency_penalty": "frequency_penalty", "presence_penalty": "presence_penalty",
    "repetition_penalty": "repetition_penalty", "stop": "stop",
    "stop_token_ids": "stop_token_ids", "ignore_eos": "ignore_eos",
    "skip_special_tokens": "skip_special_tokens", "logit_bias": "logit_bias",
}  # fmt: skip


def request(api: str, input_ids: list[int], sampling: dict[str, Any], rid: str
            ) -> tuple[str, bytes]:
    """The path and JSON body that ask `api` for one generation of `input_ids`."""
    if api == API_OPENAI:
        body: dict[str, Any] = {OPENAI_PARAMS[k]: v for k, v in sampling.items()
                                if k in OPENAI_PARAMS}
        # request_id: vLLM's own (its hidden-state connector names the file after it)
        body.update(prompt=input_ids, return_token_ids=True, stream=False, n=1,
                    request_id=rid)
        return COMPLETIONS_PATH, msgspec.json.encode(body)
    return GENERATE_PATH, msgspec.json.encode(
        {"input_ids": input_ids, "sampling_params": sampling, "rid": rid})


class _Meta(msgspec.Struct):
    finish_reason: Any = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    e2e_latency: float | None = None
    cached_tokens: int | None = None


class _Reply(msgspec.Struct):
    meta_info: _Meta
    output_ids: list[TokenId] | None = None
    text: str = ""


class _PromptDetails(msgspec.Struct):
    cached_tokens: int | None = None


class _Usage(msgspec.Struct):
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    prompt_tokens_details: _PromptDetails | None = None


class _Choice(msgspec.Struct):
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[TokenId] | None = None
    text: str = ""


class _Completion(msgspec.Struct):
    choices: list[_Choice]
    usage: _Usage | None = None
    kv_transfer_params: dict[str, Any] | None = None


_reply = msgspec.json.Decoder(_Reply)
_completion = msgspec.json.Decoder(_Completion)


def parse(api: str, body: bytes, n_prompt: int, engine: str, latency_s: float) -> Generation:
    """Validate a 200 reply; raise `InvalidResponse` for anything a training set cannot use,
    `ServerError` for a request the engine aborted."""
    if api == API_OPENAI:
        return _parse_completion(body, n_prompt, engine, latency_s)
    try:
        reply = _reply.decode(body)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise InvalidResponse(f"unparseable /generate reply: {exc}") from None
    meta = reply.meta_info
    fr = meta.finish_reason
    if not isinstance(fr, dict) or "type" not in fr:
        raise InvalidResponse(f"finish_reason missing or not a dict: {fr!r}")
    if fr["type"] == "abort":
        raise ServerError(f"request aborted by the engine: {fr.get('message')}")
    if reply.output_ids is None:
        raise InvalidResponse("reply has no output_ids: SGLang older than 0.5.1 (it returns "
                              "them since August 2025); upgrade the engine")
    if meta.completion_tokens is None or meta.prompt_tokens is None:
        raise InvalidResponse("meta_info lacks prompt_tokens/completion_tokens")
    ids = reply.output_ids
    n = meta.completion_tokens
    if len(ids) > n >= 1:
        # early SGLang 0.5 releases (#10896, #17240): output_ids start with prompt ids
        ids = ids[-n:]
    return _checked(ids, meta.prompt_tokens, n, n_prompt, str(fr["type"]), fr, reply.text,
                    meta.e2e_latency if meta.e2e_latency is not None else latency_s, engine,
                    meta.cached_tokens)


def _parse_completion(body: bytes, n_prompt: int, engine: str, latency_s: float
                      ) -> Generation:
    try:
        reply = _completion.decode(body)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise InvalidResponse(f"unparseable /v1/completions reply: {exc}") from None
    if len(reply.choices) != 1:
        raise InvalidResponse(f"expected one choice, got {len(reply.choices)}")
    choice, usage = reply.choices[0], reply.usage or _Usage()
    if choice.finish_reason in ("abort", "error"):
        raise ServerError(f"request ended by the engine: {choice.finish_reason}")
    if choice.finish_reason not in ("stop", "length"):
        raise InvalidResponse(f"unexpected finish_reason {choice.finish_reason!r}")
    if choice.token_ids is None:
        raise InvalidResponse("reply has no token_ids: the engine ignored return_token_ids "
                              "(vLLM older than 0.10.2?); upgrade the engine")
    if usage.completion_tokens is None or usage.prompt_tokens is None:
        raise InvalidResponse("usage lacks prompt_tokens/completion_tokens")
    ids = choice.token_ids
    if choice.finish_reason == "length":
        fr: dict[str, Any] = {"type": "length", "length": usage.completion_tokens}
    else:
        matched = choice.stop_reason if choice.stop_reason is not None else (
            ids[-1] if ids else None)
        fr = {"type": "stop", "matched": matched}
    details = usage.prompt_tokens_details
    gen = _checked(ids, usage.prompt_tokens, usage.completion_tokens, n_prompt, fr["type"],
                   fr, choice.text, latency_s, engine,
                   details.cached_tokens if details is not None else None)
    path = (reply.kv_transfer_params or {}).get("hidden_states_path")
    return msgspec.structs.replace(gen, hidden_states_path=path) if isinstance(path, str) \
        else gen


def _checked(ids: list[int], n_prompt_engine: int, n: int, n_prompt: int, reason: str,
             fr: dict[str, Any], text: str, latency_s: float, engine: str,
             cached: int | None = None) -> Generation:
    if len(ids) != n:
        raise InvalidResponse(f"completion_tokens={n} but {len(ids)} ids returned")
    if n_prompt_engine != n_prompt:
        log.warning("engine %s counted %d prompt tokens, sent %d", engine, n_prompt_engine,
                    n_prompt)
    return Generation(output_ids=ids, text=text, prompt_tokens=n_prompt_engine,
                      completion_tokens=n, finish_reason=reason, finish=fr,
                      latency_s=latency_s, engine=engine, cached_tokens=cached)
