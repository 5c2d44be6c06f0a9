"""Engine URLs and what the producer asks an engine before feeding (context length)."""

from __future__ import annotations

import logging

import requests

log = logging.getLogger(__name__)

INFO_TIMEOUT_S = (3.05, 10.0)


def parse_urls(value: str | None) -> list[str]:
    """`SGLANG_URL` style: one or several URLs, comma separated."""
    return [u.strip().rstrip("/") for u in (value or "").split(",") if u.strip()]


def context_length(urls: list[str]) -> int | None:
    """The smallest context length the engines report, or None if none says."""
    found: list[int] = []
    for url in urls:
        n = _one(url)
        if n:
            found.append(n)
    return min(found) if found else None


def _one(url: str) -> int | None:
    try:
        r = requests.get(f"{url}/v1/models", timeout=INFO_TIMEOUT_S)
        if r.ok:
            data = r.json().get("data") or []
            if data and data[0].get("max_model_len"):
                return int(data[0]["max_model_len"])
        r = requests.get(f"{url}/server_info", timeout=INFO_TIMEOUT_S)
        if r.status_code == 404:
            r = requests.get(f"{url}/get_server_info", timeout=INFO_TIMEOUT_S)
        if r.ok:
            info = r.json()
            if info.get("context_length"):
                return int(info["context_length"])
    except (requests.RequestException, ValueError) as exc:
        log.warning("could not read the context length from %s: %s", url, exc)
    return None


def healthy(url: str, timeout_s: float = 5.0) -> bool:
    try:
        return requests.get(f"{url}/health", timeout=(timeout_s, timeout_s)).status_code == 200
    except requests.RequestException:
        return False
