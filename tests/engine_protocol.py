"""What an OpenAI-compatible engine (vLLM) answers to the requests tokencap sends, as facts
a test can compare: the same checks run against the simulator's vLLM mode
(tests/unit/sglang_sim/test_protocol.py, in `make test`) and against vLLM itself
(tests/pipeline/test_real_engine.py, in `make test-engine`), and must give the facts `EXPECTED`
(read from vLLM 0.32.0's CPU build, docs/ENGINES.md).
"""

from __future__ import annotations

from typing import Any

import requests

from foundation.engine.load import parse_metrics

TIMEOUT_S = (3.05, 120.0)
# what vLLM 0.32.0 answered (docs/ENGINES.md); the simulator must answer the same
EXPECTED: dict[str, Any] = {
    "models.owned_by": "vllm",
    "models.max_model_len is int": True,
    "/version has version": True,
    "/v1/loads": 404,
    "/server_info": 404,
    "completion keys": ["finish_reason", "prompt_token_ids", "stop_reason", "text",
                        "token_ids"],
    "usage keys": ["completion_tokens", "prompt_tokens", "prompt_tokens_details",
                   "total_tokens"],
    "stop id last in token_ids": True,
    "stop finish_reason": "stop",
    "prompt over the context": (400, True),
    "prompt + max_tokens over the context": (200, "length", True),
    "id out of the vocabulary": (400, True),
    "unknown request key": 200,
    "repeated prompt cached": True,
    "cached tokens counted in prefix_cache_hits_total": True,
    "metrics": ["vllm:generation_tokens_total", "vllm:kv_cache_usage_perc",
                "vllm:num_requests_running", "vllm:num_requests_waiting",
                "vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total",
                "vllm:prompt_tokens_total"],
    "load readings": True,
}


def _post(url: str, body: dict[str, Any]) -> requests.Response:
    return requests.post(f"{url}/v1/completions", json=body, timeout=TIMEOUT_S)


def _counter(url: str, name: str) -> float:
    total = 0.0
    for line in requests.get(f"{url}/metrics", timeout=TIMEOUT_S).text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            total += float(line.rsplit(" ", 1)[1])
    return total


def facts(url: str, eos_id: int, vocab_size: int) -> dict[str, Any]:
    """The protocol facts of the engine at `url` (keys as in `EXPECTED`). `eos_id` is an end
    of turn of its model; `vocab_size` its vocabulary (an id past it is out of vocabulary)."""
    out: dict[str, Any] = {}
    card = requests.get(f"{url}/v1/models", timeout=TIMEOUT_S).json()["data"][0]
    model, ctx = card["id"], card["max_model_len"]
    out["models.owned_by"] = card.get("owned_by")
    out["models.max_model_len is int"] = isinstance(ctx, int)
    out["/version has version"] = "version" in requests.get(f"{url}/version",
                                                            timeout=TIMEOUT_S).json()
    for path in ("/v1/loads", "/server_info"):
        out[path] = requests.get(f"{url}{path}", timeout=TIMEOUT_S).status_code
    prompt = [1000 + i for i in range(40)]
    base = {"model": model, "return_token_ids": True, "temperature": 0.0}
    # an end of turn made the likeliest next token: the reply ends on it
    stop = _post(url, {**base, "prompt": prompt, "max_tokens": 8, "stop_token_ids": [eos_id],
                       "logit_bias": {str(eos_id): 100}}).json()
    choice = stop["choices"][0]
    out["completion keys"] = sorted(k for k in choice if k in EXPECTED["completion keys"])
    out["usage keys"] = sorted(k for k in stop["usage"] if k in EXPECTED["usage keys"])
    out["stop id last in token_ids"] = bool(choice["token_ids"]) and \
        choice["token_ids"][-1] == eos_id
    out["stop finish_reason"] = choice["finish_reason"]
    over = _post(url, {**base, "prompt": [1000] * (ctx + 10), "max_tokens": 2})
    out["prompt over the context"] = (over.status_code,
                                      "maximum context length" in over.text)
    edge = _post(url, {**base, "prompt": [1000] * (ctx - 6), "max_tokens": 32})
    got = edge.json()["choices"][0] if edge.ok else {}
    out["prompt + max_tokens over the context"] = (
        edge.status_code, got.get("finish_reason"), len(got.get("token_ids") or []) == 6)
    bad = _post(url, {**base, "prompt": [vocab_size + 10**6], "max_tokens": 2})
    out["id out of the vocabulary"] = (bad.status_code, "vocabulary" in bad.text)
    out["unknown request key"] = _post(url, {**base, "prompt": [1, 2], "max_tokens": 2,
                                             "tokencap_unknown_key": 3}).status_code
    hits0 = _counter(url, "vllm:prefix_cache_hits_total")
    long_prompt = [2000 + i for i in range(300)]
    cached = 0
    for _ in range(2):
        reply = _post(url, {**base, "prompt": long_prompt, "max_tokens": 2}).json()
        cached += (reply["usage"].get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    out["repeated prompt cached"] = cached > 0
    out["cached tokens counted in prefix_cache_hits_total"] = \
        _counter(url, "vllm:prefix_cache_hits_total") - hits0 == cached
    page = requests.get(f"{url}/metrics", timeout=TIMEOUT_S).text
    names = {line.split("{", 1)[0].split(" ", 1)[0] for line in page.splitlines()
             if line and not line.startswith("#")}
    out["metrics"] = sorted(n for n in EXPECTED["metrics"] if n in names)
    load = parse_metrics(page)
    out["load readings"] = load["running"] is not None and load["queued"] is not None
    return out


def differences(found: dict[str, Any]) -> dict[str, tuple[Any, Any]]:
    """The facts that are not the expected ones: {fact: (expected, found)}."""
    return {k: (v, found.get(k)) for k, v in EXPECTED.items() if found.get(k) != v}
