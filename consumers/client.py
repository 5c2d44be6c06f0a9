"""SGLang `/generate` client: one `requests.Session` per process, timeouts always set,
retries with backoff on 429/502/503/504 and connection errors, responses validated.

HTTP errors are translated to `EngineError` subclasses here and nowhere else. No
`transformers` import: a worker stays small.
"""

from __future__ import annotations

import logging
import os
import time
import uuid
from typing import Any

import msgspec
import requests
from requests.adapters import HTTPAdapter
from urllib3.exceptions import (
    ConnectTimeoutError,
    MaxRetryError,
    NewConnectionError,
    ReadTimeoutError,
)
from urllib3.util.retry import Retry

from consumers.engines import EnginePool
from consumers.stats import EngineStats
from foundation.errors import TokencapError
from foundation.wire import ErrorKind, TokenId

log = logging.getLogger(__name__)

RETRY_STATUSES = frozenset({429, 502, 503, 504})
BACKOFF_FACTOR_S = 0.5
BACKOFF_JITTER_S = 0.5
CATEGORY_HEADER = "X-Tokencap-Category"


class EngineError(Exception):
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


class Generation(msgspec.Struct, frozen=True):
    """A validated `/generate` reply."""

    output_ids: list[int]
    text: str
    prompt_tokens: int
    completion_tokens: int
    finish_reason: str
    finish: dict[str, Any]
    latency_s: float
    engine: str


class _Meta(msgspec.Struct):
    finish_reason: Any = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    e2e_latency: float | None = None


class _Reply(msgspec.Struct):
    meta_info: _Meta
    output_ids: list[TokenId] | None = None
    text: str = ""


_reply_decoder = msgspec.json.Decoder(_Reply)


def parse_reply(body: bytes, n_prompt: int, engine: str, latency_s: float) -> Generation:
    """Validate a 200 reply; raise InvalidResponse on anything a training set cannot use."""
    try:
        reply = _reply_decoder.decode(body)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise InvalidResponse(f"unparseable /generate reply: {exc}") from None
    meta = reply.meta_info
    fr = meta.finish_reason
    if not isinstance(fr, dict) or "type" not in fr:
        raise InvalidResponse(f"finish_reason missing or not a dict: {fr!r}")
    if fr["type"] == "abort":
        raise ServerError(f"request aborted by the engine: {fr.get('message')}")
    if reply.output_ids is None:
        raise InvalidResponse("reply has no output_ids (SGLang older than Aug 2025?)")
    if meta.completion_tokens is None or meta.prompt_tokens is None:
        raise InvalidResponse("meta_info lacks prompt_tokens/completion_tokens")
    ids = reply.output_ids
    n = meta.completion_tokens
    if len(ids) > n >= 1:
        # known SGLang bug (#10896): output_ids may start inside the prompt
        ids = ids[-n:]
    if len(ids) != n:
        raise InvalidResponse(f"completion_tokens={n} but len(output_ids)={len(ids)}")
    if meta.prompt_tokens != n_prompt:
        log.warning("engine %s counted %d prompt tokens, sent %d", engine, meta.prompt_tokens,
                    n_prompt)
    return Generation(
        output_ids=ids,
        text=reply.text,
        prompt_tokens=meta.prompt_tokens,
        completion_tokens=n,
        finish_reason=str(fr["type"]),
        finish=fr,
        latency_s=meta.e2e_latency if meta.e2e_latency is not None else latency_s,
        engine=engine,
    )


def _error_message(resp: requests.Response) -> str:
    try:
        body = resp.json()
    except ValueError:
        return resp.text[:300]
    if isinstance(body, dict):
        err = body.get("error")
        if isinstance(err, dict):
            return str(err.get("message", err))
        return str(body.get("message", body))
    return str(body)[:300]


class EngineClient:
    """Sends single `/generate` requests to one of several engines, chosen by `EnginePool`
    (less loaded of two random picks; unreachable engines taken out, put back when healthy;
    optional adaptive gate on the engine's queue)."""

    def __init__(
        self,
        urls: list[str],
        *,
        connect_timeout_s: float,
        read_timeout_s: float,
        retries: int,
        backoff_max_s: float,
        adaptive_max_queue: int | None = None,
    ) -> None:
        if not urls:
            raise TokencapError("no engine: set --sglang-url or SGLANG_URL")
        self.urls = [u.rstrip("/") for u in urls]
        self.timeout = (connect_timeout_s, read_timeout_s)
        self.retries = retries
        self.backoff_max_s = backoff_max_s
        self.pool = EnginePool(self.urls, adaptive_max_queue)
        self.stats = EngineStats()
        self._session: requests.Session | None = None
        self._pid = -1

    def _retry(self) -> Retry:
        return Retry(
            total=self.retries,
            connect=self.retries,
            read=0,
            status=self.retries,
            other=0,
            backoff_factor=BACKOFF_FACTOR_S,
            backoff_jitter=BACKOFF_JITTER_S,
            backoff_max=self.backoff_max_s,
            status_forcelist=RETRY_STATUSES,
            allowed_methods=None,
            respect_retry_after_header=True,
            raise_on_status=False,
        )

    @property
    def session(self) -> requests.Session:
        if self._session is None or self._pid != os.getpid():
            s = requests.Session()
            s.trust_env = False  # no proxy/netrc lookups per request (measured: -25% CPU)
            adapter = HTTPAdapter(max_retries=self._retry(), pool_connections=4, pool_maxsize=4)
            s.mount("http://", adapter)
            s.mount("https://", adapter)
            self._session, self._pid = s, os.getpid()
        return self._session

    def generate(self, input_ids: list[int], sampling: dict[str, Any], category: str) -> Generation:
        last: EngineError | None = None
        for url in self.pool.order():
            waits = self.pool.gate(url)
            if waits:
                self.stats.gate_waits(url, waits)
            t0 = time.monotonic()
            try:
                gen = self._generate_one(url, input_ids, sampling, category)
            except Unreachable as exc:
                self.pool.mark_down(url)
                self.stats.record(url, exc.kind.value, time.monotonic() - t0)
                log.warning("engine %s unreachable, trying another: %s", url, exc)
                last = exc
                continue
            except EngineError as exc:
                self.stats.record(url, exc.kind.value, time.monotonic() - t0)
                raise
            self.stats.record(url, "ok", time.monotonic() - t0)
            return gen
        assert last is not None
        raise last

    def _generate_one(
        self, url: str, input_ids: list[int], sampling: dict[str, Any], category: str
    ) -> Generation:
        rid = uuid.uuid4().hex  # prefix-free: /abort_request matches by prefix
        body = msgspec.json.encode(
            {"input_ids": input_ids, "sampling_params": sampling, "rid": rid}
        )
        headers = {"Content-Type": "application/json", CATEGORY_HEADER: category}
        t0 = time.monotonic()
        try:
            resp = self.session.post(f"{url}/generate", data=body, headers=headers,
                                     timeout=self.timeout)
        except requests.exceptions.ConnectTimeout as exc:
            raise Unreachable(f"connect timeout to {url}: {exc}") from None
        except requests.exceptions.ReadTimeout:
            raise EngineTimeout(f"no reply from {url} within {self.timeout[1]} s") from None
        except requests.exceptions.RetryError as exc:
            raise Overloaded(f"{url} kept refusing: {exc}") from None
        except requests.exceptions.ConnectionError as exc:
            reason = _reason(exc)
            if isinstance(reason, ReadTimeoutError):
                raise EngineTimeout(f"no reply from {url} within {self.timeout[1]} s") from None
            if isinstance(reason, NewConnectionError | ConnectTimeoutError):
                raise Unreachable(f"cannot connect to {url}: {reason}") from None
            raise ServerError(f"connection to {url} broken: {reason or exc}") from None
        except requests.exceptions.ChunkedEncodingError as exc:
            raise ServerError(f"reply from {url} cut off: {exc}") from None
        latency = time.monotonic() - t0
        code = resp.status_code
        if code == 200:
            return parse_reply(resp.content, len(input_ids), url, latency)
        msg = f"HTTP {code} from {url}: {_error_message(resp)}"
        if code == 400:
            raise BadRequest(msg, code)
        if code in RETRY_STATUSES:
            raise Overloaded(msg, code)
        raise ServerError(msg, code)


def _reason(exc: Exception) -> BaseException | None:
    """The urllib3 error under a requests ConnectionError (MaxRetryError.reason)."""
    inner = exc.args[0] if exc.args else None
    if isinstance(inner, MaxRetryError):
        return inner.reason
    return inner if isinstance(inner, BaseException) else None
