"""What an engine serves (`discover`): the served model name and context length from
``/v1/models`` (SGLang and vLLM alike), SGLang's version from ``/server_info`` (0.5.9 and
later; ``/get_server_info`` before), vLLM's from ``/version``; a simulator says so
(``"simulator": true``, model ``tokencap-sglang-sim``). SGLang tells its vocabulary size only
in the message that refuses an out-of-range ``logit_bias`` key (`vocab_size`). Also: why a
connection failed (`why_unreachable`), the smallest context length of several engines and
the ``/health`` probe. Engines' names, requests and replies are `foundation/engine/api.py`."""

from __future__ import annotations

import logging
import re
from typing import Any

import msgspec
import requests

from foundation.engine.api import (
    API_AUTO,
    API_KEY_ENV,
    API_OPENAI,
    API_SGLANG,
    GENERATE_PATH,
    INFO_TIMEOUT_S,
    SIM_MODEL,
    EngineSpec,
    error_message,
    transient_status,
)
from foundation.errors import EngineNotReady, EngineUnusable

log = logging.getLogger(__name__)


class EngineInfo(msgspec.Struct, frozen=True, omit_defaults=True):
    """What an engine says it serves (`discover`)."""

    url: str
    api: str
    model: str = ""
    version: str = ""
    context_length: int | None = None
    simulated: bool = False
    metrics: bool = True
    # an extraction server's: the folder its hidden-state connector writes files in (the
    # preflight's probe file's), where the stage's end looks for files a killed worker left
    states_folder: str = ""


def _get(spec: EngineSpec, path: str, timeout: tuple[float, float] = INFO_TIMEOUT_S
         ) -> requests.Response:
    """GET `path`; an answer that may change by itself (no connection, a timeout, 429 or
    5xx) raises `EngineNotReady`, a refused key `EngineUnusable`."""
    try:
        r = requests.get(f"{spec.url}{path}", headers=spec.headers(), timeout=timeout)
    except requests.RequestException as exc:
        why = why_unreachable(exc, timeout)
        raise EngineNotReady(f"engine {spec.url}: cannot reach it ({why})", why) from None
    if r.status_code == 401:
        raise EngineUnusable(f"engine {spec.url}: refuses the request without a valid API key "
                             f"(HTTP 401); set {API_KEY_ENV} or http://:KEY@host in SGLANG_URL")
    if transient_status(r.status_code):
        raise EngineNotReady(f"engine {spec.url}: answers HTTP {r.status_code} to GET {path}: "
                             f"{error_message(r.content)}", f"HTTP {r.status_code}")
    return r


def why_unreachable(exc: requests.RequestException, timeout: tuple[float, float]) -> str:
    """A connection failure in a few words (urllib3's own text runs to hundreds)."""
    text = str(exc)
    if isinstance(exc, requests.ConnectTimeout):
        return f"no connection within {timeout[0]:g} s"
    if isinstance(exc, requests.ReadTimeout):
        return f"no answer within {timeout[1]:g} s"
    for needle, words in (("Connection refused", "connection refused"),
                          ("Name or service not known", "unknown host"),
                          ("nodename nor servname", "unknown host"),
                          ("No route to host", "no route to host"),
                          ("Connection reset", "connection reset"),
                          ("Remote end closed connection", "connection closed unanswered"),
                          ("Connection aborted", "connection aborted")):
        if needle in text:
            return words
    return type(exc).__name__


def _json(r: requests.Response) -> dict[str, Any]:
    try:
        doc = r.json()
    except ValueError:
        return {}
    return doc if isinstance(doc, dict) else {}


def discover(spec: EngineSpec) -> EngineInfo:
    """What `spec` serves: API, model, version, context length, whether it is a simulator.
    Raises `EngineNotReady` when it cannot be reached or is busy (429, 5xx), `EngineUnusable`
    when it refuses the key."""
    models = _json(_get(spec, "/v1/models"))
    data = models.get("data") or [{}]
    card = data[0] if isinstance(data[0], dict) else {}
    api = spec.api
    if api == API_AUTO:
        owner = str(card.get("owned_by") or "")
        api = API_OPENAI if owner == "vllm" else API_SGLANG if owner == "sglang" else ""
    model = str(card.get("id") or "")
    ctx = card.get("max_model_len")
    version, simulated = "", False
    if api != API_OPENAI:
        r = _get(spec, "/server_info")
        if r.status_code == 404:
            r = _get(spec, "/get_server_info")
        info = _json(r) if r.ok else {}
        if not api:
            api = API_SGLANG if r.ok else API_OPENAI
        version = str(info.get("version") or "")
        simulated = info.get("simulator") is True
        model = model or str(info.get("served_model_name") or info.get("model_path") or "")
        ctx = ctx or info.get("context_length")
    if api == API_OPENAI:
        r = _get(spec, "/version")
        version = str(_json(r).get("version") or "") if r.ok else ""
    simulated = simulated or model == SIM_MODEL
    metrics = _get(spec, "/metrics").status_code != 404
    return EngineInfo(url=spec.url, api=api, model=model, version=version,
                      context_length=int(ctx) if ctx else None, simulated=simulated,
                      metrics=metrics)


_VOCAB_RE = re.compile(r"\[0,\s*(\d+)\s*([\])])")


def vocab_size(spec: EngineSpec) -> int | None:
    """SGLang's vocabulary size, from the message refusing an out-of-range `logit_bias` key
    ("keys in [0, V-1]"); None when the engine does not say (vLLM, or another message)."""
    body = msgspec.json.encode({"input_ids": [0], "sampling_params": {
        "max_new_tokens": 1, "logit_bias": {str(2**31 - 1): 0.0}}})
    try:
        r = requests.post(f"{spec.url}{GENERATE_PATH}", data=body, timeout=INFO_TIMEOUT_S,
                          headers={"Content-Type": "application/json", **spec.headers()})
    except requests.RequestException:
        return None
    m = _VOCAB_RE.search(error_message(r.content)) if r.status_code == 400 else None
    if m is None:
        return None
    return int(m[1]) + (1 if m[2] == "]" else 0)


def context_length(specs: list[EngineSpec]) -> int | None:
    """The smallest context length the engines report, or None if none says."""
    found = []
    for spec in specs:
        try:
            n = discover(spec).context_length
        except EngineUnusable as exc:
            log.warning("could not read the context length: %s", exc)
            continue
        if n:
            found.append(n)
    return min(found) if found else None


def trouble(spec: EngineSpec, timeout: tuple[float, float] = (3.0, 5.0)) -> str:
    """Why `spec` does not answer GET /health ("" when it does), in a few words: what a
    progress line says while an engine is away."""
    try:
        _get(spec, "/health", timeout)
    except EngineNotReady as exc:
        return exc.reason
    except EngineUnusable as exc:
        return str(exc)
    return ""


def healthy(url: str, timeout_s: float = 5.0, key: str | None = None) -> bool:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    try:
        return requests.get(f"{url}/health", timeout=(timeout_s, timeout_s),
                            headers=headers).status_code == 200
    except requests.RequestException:
        return False
