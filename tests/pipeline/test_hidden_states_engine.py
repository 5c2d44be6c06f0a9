"""vLLM's hidden-state extraction against transformers' own forward of the same model.

`make test-engine` (tests/engine/run.py) starts vLLM's CPU build serving an 8-layer tiny
Qwen2 with the `extract_hidden_states` speculative method and tokencap's CPU connector
(`tokencap.engine_side.vllm_cpu_connector`), and names it here: TOKENCAP_EXTRACT_URL, _MODEL
(the model folder), _STORAGE (where the files go), _LAYERS (vLLM's layer ids), and
TOKENCAP_ENGINE_PYTHON (a Python with torch and transformers, for the oracle,
tests/engine/hs_oracle.py). Without TOKENCAP_EXTRACT_URL these are skipped, except under
`make test-engine`, where that fails them (TOKENCAP_ENGINE_REQUIRED), unless it runs against
the user's own engine and names no extraction server (TOKENCAP_EXTRACT_SKIP says so).

Each request is one prompt of ids with `max_tokens` 1 and `temperature` 0 (a non-greedy
request crashes a speculative-decoding server on the CPU build). The file the reply names is
read under a shared flock on `PATH.lock` (the connector holds it exclusively until the file
is written), its `token_ids` must be the prompt and its `hidden_states` [T, layers, H] must
equal the oracle's: within ATOL_F32 for float32 states (measured: a few 1e-7), within
ATOL_HALF_REL of the oracle's largest value with a cosine of at least MIN_COS_HALF per token
and layer for bf16 or fp16 states (a user's GPU server).
"""

from __future__ import annotations

import fcntl
import json
import os
import random
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import requests

from foundation.hsfile import read

# a request may take 600 s on a loaded CPU
pytestmark = [pytest.mark.real_engine, pytest.mark.timeout(1500)]

ORACLE = Path(__file__).resolve().parents[1] / "engine" / "hs_oracle.py"
ATOL_F32 = 1e-5
ATOL_HALF_REL = 0.05
MIN_COS_HALF = 0.999
SHORT, LONG = 20, 600
PREFIX, SUFFIX, CONCURRENT = 300, 40, 4
ID_RANGE = (1000, 30000)  # ids every vocabulary this may meet has


class Extract:
    def __init__(self, url: str, model: str, layers: list[int], storage: str | None,
                 python: str) -> None:
        self.url = url
        self.model = model
        self.layers = layers
        self.storage = storage
        self.python = python
        self.served = self._served_name()

    def _served_name(self) -> str:
        r = requests.get(f"{self.url}/v1/models", timeout=30)
        r.raise_for_status()
        return str(r.json()["data"][0]["id"])

    def complete(self, ids: list[int]) -> dict[str, Any]:
        r = requests.post(f"{self.url}/v1/completions", timeout=600,
                          json={"model": self.served, "prompt": ids, "max_tokens": 1,
                                "temperature": 0})
        assert r.status_code == 200, f"{r.status_code}: {r.text[:500]}"
        body: dict[str, Any] = r.json()
        return body

    def oracle(self, prompts: list[list[int]], tmp: Path) -> list[np.ndarray]:
        out = tmp / "oracle.npz"
        res = subprocess.run([self.python, str(ORACLE), self.model,
                              ",".join(map(str, self.layers)), str(out)],
                             input=json.dumps(prompts), text=True, capture_output=True,
                             env={**os.environ, "HF_HUB_OFFLINE": "1"}, timeout=600)
        assert res.returncode == 0, f"the oracle failed:\n{res.stderr[-3000:]}"
        with np.load(out) as z:
            return [z[str(i)] for i in range(len(prompts))]


@pytest.fixture(scope="module")
def extract() -> Extract:
    url = os.environ.get("TOKENCAP_EXTRACT_URL")
    if not url:
        if os.environ.get("TOKENCAP_EXTRACT_SKIP"):  # run.py against the user's own engine
            pytest.skip(f"no extraction server: {os.environ['TOKENCAP_EXTRACT_SKIP']}")
        if os.environ.get("TOKENCAP_ENGINE_REQUIRED"):
            pytest.fail("TOKENCAP_EXTRACT_URL is not set: `make test-engine` starts the "
                        "extraction server")
        pytest.skip("no extraction server (TOKENCAP_EXTRACT_URL; `make test-engine` starts "
                    "one)")
    model = os.environ.get("TOKENCAP_EXTRACT_MODEL")
    layers = os.environ.get("TOKENCAP_EXTRACT_LAYERS")
    python = os.environ.get("TOKENCAP_ENGINE_PYTHON")
    missing = [name for name, v in (("TOKENCAP_EXTRACT_MODEL", model),
                                    ("TOKENCAP_EXTRACT_LAYERS", layers),
                                    ("TOKENCAP_ENGINE_PYTHON", python)) if not v]
    if missing:
        pytest.fail(f"TOKENCAP_EXTRACT_URL is set but not {', '.join(missing)}: the oracle "
                    "needs the model folder, the layer ids and a Python with transformers")
    assert model and layers and python
    return Extract(url.rstrip("/"), model, [int(k) for k in layers.split(",")],
                   os.environ.get("TOKENCAP_EXTRACT_STORAGE"), python)


def states_of(extract: Extract, reply: dict[str, Any], ids: list[int]) -> tuple[np.ndarray, str]:
    """The states the reply's file holds, read under the writer's lock; checks the file's
    token_ids, shape and place."""
    params = reply.get("kv_transfer_params") or {}
    path = params.get("hidden_states_path")
    assert path, f"no kv_transfer_params.hidden_states_path in the reply: {reply}"
    if extract.storage:
        assert Path(path).parent == Path(extract.storage), \
            f"{path} is not in TOKENCAP_EXTRACT_STORAGE ({extract.storage})"
    with open(path + ".lock") as lock:  # the connector makes it before the reply is sent
        fcntl.flock(lock, fcntl.LOCK_SH)  # sleeps until the writer lets go
        tensors, _meta = read(path)
    assert set(tensors) >= {"hidden_states", "token_ids"}, sorted(tensors)
    assert tensors["token_ids"].array().reshape(-1).tolist() == ids
    hs = tensors["hidden_states"]
    assert hs.shape[:2] == (len(ids), len(extract.layers)), hs.shape
    return np.asarray(hs.array(), dtype=np.float32), hs.dtype


def compare(got: np.ndarray, dtype: str, want: np.ndarray, what: str) -> float:
    """The largest absolute difference, after asserting it is within the tolerance."""
    assert got.shape == want.shape, (what, got.shape, want.shape)
    assert np.isfinite(got).all(), f"{what}: a state is not finite"
    for k in range(got.shape[1]):
        assert np.any(got[:, k, :]), f"{what}: layer slot {k} all zeros (vLLM PR #46301)"
    diff = float(np.abs(got - want).max())
    if dtype == "F32":
        assert diff <= ATOL_F32, f"{what}: max abs diff {diff:.3g} > {ATOL_F32}"
    else:
        scale = float(np.abs(want).max())
        assert diff <= ATOL_HALF_REL * scale, \
            f"{what}: max abs diff {diff:.3g} > {ATOL_HALF_REL} x {scale:.3g}"
        num = (got * want).sum(-1)
        den = np.linalg.norm(got, axis=-1) * np.linalg.norm(want, axis=-1) + 1e-30
        cos = float((num / den).min())
        assert cos >= MIN_COS_HALF, f"{what}: cosine {cos:.6f} < {MIN_COS_HALF}"
    print(f"{what}: {got.shape[0]} tokens, {dtype}, max abs diff {diff:.3g}", file=sys.stderr)
    return diff


def test_states_equal_the_transformers_forward(extract: Extract, tmp_path: Path) -> None:
    rng = random.Random(20261203)
    prompts = [[rng.randrange(*ID_RANGE) for _ in range(n)] for n in (SHORT, LONG)]
    got = [states_of(extract, extract.complete(ids), ids) for ids in prompts]
    want = extract.oracle(prompts, tmp_path)
    for ids, (states, dtype), ref in zip(prompts, got, want, strict=True):
        compare(states, dtype, ref, f"{len(ids)}-token prompt")


def test_concurrent_requests_sharing_a_prefix(extract: Extract, tmp_path: Path) -> None:
    """Prefix caching on: the shared prefix's states come from cached blocks."""
    rng = random.Random(31)
    prefix = [rng.randrange(*ID_RANGE) for _ in range(PREFIX)]
    prompts = [prefix + [rng.randrange(*ID_RANGE) for _ in range(SUFFIX)]
               for _ in range(CONCURRENT)]
    warm = extract.complete(prefix + [rng.randrange(*ID_RANGE)])  # the prefix into the cache
    assert warm["kv_transfer_params"]["hidden_states_path"]
    with ThreadPoolExecutor(CONCURRENT) as pool:
        replies = list(pool.map(extract.complete, prompts))
    paths = {r["kv_transfer_params"]["hidden_states_path"] for r in replies}
    assert len(paths) == CONCURRENT, f"two requests named the same file: {paths}"
    cached = [((r.get("usage") or {}).get("prompt_tokens_details") or {}).get("cached_tokens")
              for r in replies]
    if all(c is not None for c in cached):  # --enable-prompt-tokens-details
        assert any(c for c in cached), f"no prefix-cache hit ({cached}): the case is not tested"
    want = extract.oracle(prompts, tmp_path)
    for i, (ids, reply, ref) in enumerate(zip(prompts, replies, want, strict=True)):
        states, dtype = states_of(extract, reply, ids)
        compare(states, dtype, ref, f"concurrent request {i} (cached {cached[i]})")
