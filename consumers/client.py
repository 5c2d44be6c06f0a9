"""The engine client of a worker: one `requests.Session` per process, timeouts always set,
retries with backoff on 429/502/503/504 and connection errors, each engine asked in its own
API (SGLang's `/generate` or an OpenAI-compatible `/v1/completions`, `foundation.engine.api`),
replies validated, every generation labelled with the model and engine version that made it.

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

from consumers.routing import EnginePool
from consumers.stats import EngineStats
from foundation.engine.api import (
    BACKOFF_FACTOR_S,
    BACKOFF_JITTER_S,
    RETRY_STATUSES,
    BadRequest,
    EngineError,
    EngineTimeout,
    Generation,
    InvalidResponse,
    Overloaded,
    ServerError,
    Unreachable,
    auto_read_timeout,
    engine_specs,
    error_message,
    parse,
    request,
)
from foundation.engine.info import EngineInfo, discover
from foundation.errors import EngineUnusable, TokencapError

__all__ = [
    "BadRequest", "EngineClient", "EngineError", "EngineTimeout", "Generation",
    "InvalidResponse", "Overloaded", "ServerError", "Unreachable",
]  # fmt: skip

log = logging.getLogger(__name__)

CATEGORY_HEADER = "X-Tokencap-Category"


class EngineClient:
    """Sends single generations to one of several engines, chosen by `EnginePool` (less
    loaded of two random picks; unreachable engines taken out, put back when healthy;
    optional adaptive gate on the engine's queue)."""

    def __init__(
        self,
        urls: list[str],
        *,
        connect_timeout_s: float,
        read_timeout_s: float | None,
        retries: int,
        backoff_max_s: float,
        adaptive_max_queue: int | None = None,
    ) -> None:
        if not urls:
            raise TokencapError("no engine: set --sglang-url or SGLANG_URL")
        self.specs = {s.url: s for s in engine_specs(urls)}
        self.urls = list(self.specs)
        self.connect_timeout_s = connect_timeout_s
        self.read_timeout_s = read_timeout_s  # None: derived per request ("auto")
        self.retries = retries
        self.backoff_max_s = backoff_max_s
        self.pool = EnginePool(self.urls, adaptive_max_queue,
                               headers={u: s.headers() for u, s in self.specs.items()})
        self.stats = EngineStats()
        self.infos: dict[str, EngineInfo] = {}
        self._session: requests.Session | None = None
        self._pid = -1

    def info(self, url: str) -> EngineInfo:
        """What the engine at `url` serves (read once per process)."""
        if url not in self.infos:
            self.infos[url] = discover(self.specs[url])
            i = self.infos[url]
            log.info("engine %s: %s API, model %r, version %s%s", url, i.api, i.model,
                     i.version or "?", " (a SIMULATOR)" if i.simulated else "")
        return self.infos[url]

    def preflight(self) -> list[EngineInfo]:
        """Read what every engine serves; raise `EngineUnusable` if one cannot be used."""
        return [self.info(url) for url in self.urls]

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

    def read_timeout(self, max_new_tokens: int, decode_tok_s: float) -> float:
        """The read timeout of one request: the configured one, or derived from what it may
        generate at the decode rate observed per request (`auto_read_timeout`)."""
        if self.read_timeout_s is not None:
            return self.read_timeout_s
        return auto_read_timeout(max_new_tokens, decode_tok_s)

    def generate(self, input_ids: list[int], sampling: dict[str, Any], category: str,
                 decode_tok_s: float = 0.0, prefer: str = "", affinity: str = "",
                 rid_prefix: str = "") -> Generation:
        """One generation, from the engine `EnginePool.order` puts first (`prefer`, then
        `affinity`'s, unless loaded well above another), the next ones if it is unreachable.
        `rid_prefix` starts its request id (the hidden-state stage names its row there)."""
        try:
            return self._generate(input_ids, sampling, category, decode_tok_s, prefer,
                                  affinity, rid_prefix)
        finally:
            self.pool.done()

    def _generate(self, input_ids: list[int], sampling: dict[str, Any], category: str,
                  decode_tok_s: float, prefer: str, affinity: str,
                  rid_prefix: str = "") -> Generation:
        last: EngineError | None = None
        for url in self.pool.order(prefer, affinity):
            waits = self.pool.gate(url)
            if waits:
                self.stats.gate_waits(url, waits)
            t0 = time.monotonic()
            try:
                gen = self._generate_one(url, input_ids, sampling, category, decode_tok_s,
                                         rid_prefix)
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

    def _generate_one(self, url: str, input_ids: list[int], sampling: dict[str, Any],
                      category: str, decode_tok_s: float, rid_prefix: str = "") -> Generation:
        try:
            info = self.info(url)
        except EngineUnusable as exc:
            raise Unreachable(str(exc)) from None
        # prefix-free (/abort_request matches by prefix): a prefix is followed by a uuid
        rid = rid_prefix + uuid.uuid4().hex
        path, body = request(info.api, input_ids, sampling, rid)
        headers = {"Content-Type": "application/json", CATEGORY_HEADER: category,
                   **self.specs[url].headers()}
        max_new = int(sampling.get("max_new_tokens") or 0)
        read_s = self.read_timeout(max_new, decode_tok_s)
        t0 = time.monotonic()
        try:
            resp = self.session.post(f"{url}{path}", data=body, headers=headers,
                                     timeout=(self.connect_timeout_s, read_s))
        except requests.exceptions.ConnectTimeout as exc:
            raise Unreachable(f"connect timeout to {url}: {exc}") from None
        except requests.exceptions.ReadTimeout:
            raise self._timeout(url, read_s, max_new, decode_tok_s) from None
        except requests.exceptions.RetryError as exc:
            raise Overloaded(f"{url} kept refusing: {exc}") from None
        except requests.exceptions.ConnectionError as exc:
            reason = _reason(exc)
            if isinstance(reason, ReadTimeoutError):
                raise self._timeout(url, read_s, max_new, decode_tok_s) from None
            if isinstance(reason, NewConnectionError | ConnectTimeoutError):
                raise Unreachable(f"cannot connect to {url}: {reason}") from None
            raise ServerError(f"connection to {url} broken: {reason or exc}") from None
        except requests.exceptions.ChunkedEncodingError as exc:
            raise ServerError(f"reply from {url} cut off: {exc}") from None
        latency = time.monotonic() - t0
        code = resp.status_code
        if code == 200:
            gen = parse(info.api, resp.content, len(input_ids), url, latency)
            if gen.finish_reason == "length" and gen.completion_tokens < max_new:
                log.warning("%s: engine %s clamped max_new_tokens from %d to %d (the prompt "
                            "of %d tokens left no more room in its context)", category, url,
                            max_new, gen.completion_tokens, len(input_ids))
            return msgspec.structs.replace(gen, model=info.model, engine_version=info.version,
                                           simulated=info.simulated)
        msg = f"HTTP {code} from {url}: {error_message(resp.content)}"
        if code in (400, 404, 422):
            raise BadRequest(msg, code)
        if code == 401:
            raise ServerError(f"{msg} (API key missing or wrong)", code)
        if code in RETRY_STATUSES:
            raise Overloaded(msg, code)
        raise ServerError(msg, code)

    @staticmethod
    def _timeout(url: str, read_s: float, max_new: int, rate: float) -> EngineTimeout:
        progress = f"; at {rate:.1f} tok/s it would have made about {int(read_s * rate)} of " \
                   f"its {max_new} tokens" if rate > 0 else ""
        return EngineTimeout(f"no reply from {url} within {read_s:.0f} s{progress}")


def _reason(exc: Exception) -> BaseException | None:
    """The urllib3 error under a requests ConnectionError (MaxRetryError.reason)."""
    inner = exc.args[0] if exc.args else None
    if isinstance(inner, MaxRetryError):
        return inner.reason
    return inner if isinstance(inner, BaseException) else None

