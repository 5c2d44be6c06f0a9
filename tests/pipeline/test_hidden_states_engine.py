"""vLLM's hidden-state extraction against transformers' own forward of the same model.

`make test-engine` (tests/engine/run.py) starts vLLM's CPU build serving an 8-layer tiny
Qwen2 with the `extract_hidden_states` speculative method and tokencap's CPU connector
(`tokencap.engine_side.vllm_connector`), and names it here: TOKENCAP_EXTRACT_URL, _MODEL
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
from tests.helpers import fp8_server

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


def test_a_file_says_its_layers_and_a_config_of_other_layers_is_refused_at_the_preflight(
        extract: Extract, tmp_path: Path) -> None:
    """tokencap's connector writes the layer ids into every file; the preflight of a stage
    whose config asks for other ids (the server extracts [2, 4, 5, 8]) refuses the server,
    naming both lists (vLLM's stock connector would have passed every check)."""
    import msgspec

    from foundation import hsfile
    from foundation.config import load_config
    from foundation.errors import EngineUnusable
    from producer.preflight import preflight

    ids = random.Random(5).sample(range(*ID_RANGE), SHORT)
    reply = extract.complete(ids)
    path = reply["kv_transfer_params"]["hidden_states_path"]
    with open(path + ".lock") as lock:
        fcntl.flock(lock, fcntl.LOCK_SH)
        _tensors, meta = read(path)
    said = hsfile.file_layers(meta)
    assert said == (tuple(extract.layers), ("pre",) * len(extract.layers)), meta
    other = [1, 3, 5, 8]
    assert other != extract.layers
    (tmp_path / "ids.jsonl").write_text('{"input_ids": [1, 2, 3]}\n')
    (tmp_path / "run.toml").write_text(f"""
run = "layers"
output_dir = "{tmp_path / 'out'}"
sampling_defaults = "engine"
[hidden_states]
model_config = "{Path(extract.model) / 'config.json'}"
layers = {other}
[[category]]
name = "a"
source = "{tmp_path / 'ids.jsonl'}"
format = "input_ids"
sampling = {{ max_new_tokens = 1 }}
""")
    cfg = msgspec.structs.replace(load_config(tmp_path / "run.toml"), stage="hidden_states")
    with pytest.raises(EngineUnusable) as refused:
        preflight(cfg, [extract.url], None)
    words = str(refused.value)
    assert f"holds layers {extract.layers}" in words and f"asks for {other}" in words, words


def test_fp8_equals_speculators_own_quantization(extract: Extract, tmp_path: Path) -> None:
    """The real states of one long prompt (the float32 server's file) quantized three ways:
    by tokencap's worker (`hsfile.to_fp8`, ml_dtypes), by speculators' own code
    (hs-connectors' `quantize_tensor_to_fp8`, in the trainers' venv) and by tokencap's
    connector (`to_fp8`, torch); and the FP8 server's own file for the same prompt: the same
    bytes, payload and scales. Read back as speculators' trainer does, equal bits, and within
    e4m3's half step of the float32 states per token."""
    from foundation import hsfile

    fp8_url, fp8_storage = fp8_server()
    trainers = os.environ.get("TOKENCAP_TRAINERS_PYTHON")
    if not trainers:
        pytest.skip("no TOKENCAP_TRAINERS_PYTHON (speculators' code): `make test-engine`")
    ids = random.Random(11).sample(range(*ID_RANGE), LONG)
    path = extract.complete(ids)["kv_transfer_params"]["hidden_states_path"]
    with open(path + ".lock") as lock:
        fcntl.flock(lock, fcntl.LOCK_SH)
        tensors, _ = read(path)
    states = tensors["hidden_states"]
    assert states.dtype == "F32"
    ours_q, ours_scales = hsfile.to_fp8(states)
    out = tmp_path / "fp8.npz"
    root = Path(__file__).resolve().parents[2]
    res = subprocess.run([trainers, str(root / "tests" / "engine" / "fp8_oracle.py"), path,
                          str(out)], capture_output=True, text=True, timeout=600,
                         env={**os.environ, "PYTHONPATH": str(root)})
    assert res.returncode == 0, res.stderr[-3000:]
    with np.load(out) as z:
        theirs = {k: z[k] for k in z.files}
    assert ours_q.data == theirs["hs_q"].tobytes(), "payload differs from speculators'"
    assert ours_scales.data == theirs["hs_scales"].tobytes(), "scales differ from speculators'"
    assert theirs["tc_q"].tobytes() == ours_q.data and theirs["tc_scales"].tobytes() == \
        ours_scales.data, "tokencap's connector differs from speculators'"
    # what speculators' trainer reads (its dequantization) and its error per token
    deq = hsfile.from_fp8(ours_q, ours_scales)
    assert np.array_equal(deq, theirs["hs_deq"])
    wide = states.array()
    back = (deq.astype(np.uint32) << 16).view(np.float32)
    scale = ours_scales.array()
    # e4m3 half step (2^-4 of the value; 2^-10 of the scale for subnormals), then bf16's
    # rounding of the scale and of the product (2^-8 each)
    bound = (np.maximum(np.abs(wide) * 2.0 ** -4, scale * 2.0 ** -10) * (1 + 2.0 ** -7)
             + np.abs(wide) * 2.0 ** -7)
    assert (np.abs(back - wide) <= bound).all()
    # the FP8 server (tokencap's connector, tokencap_dtype fp8_e4m3): the same bytes, in
    # speculators' layout, with its layers said
    fp8_reply = requests.post(f"{fp8_url}/v1/completions", timeout=600,
                              json={"model": extract.served, "prompt": ids, "max_tokens": 1,
                                    "temperature": 0})
    assert fp8_reply.status_code == 200, fp8_reply.text[:500]
    fpath = fp8_reply.json()["kv_transfer_params"]["hidden_states_path"]
    if fp8_storage:
        assert Path(fpath).parent == Path(fp8_storage)
    with open(fpath + ".lock") as lock:
        fcntl.flock(lock, fcntl.LOCK_SH)
        served, meta = read(fpath)
    assert served["hidden_states"].dtype == "F8_E4M3" and served[hsfile.SCALES].dtype == "F32"
    hsfile.check(fpath, served, ids, len(extract.layers), states.shape[2], hsfile.FP8)
    assert bytes(served["hidden_states"].data) == ours_q.data
    assert bytes(served[hsfile.SCALES].data) == ours_scales.data
    assert hsfile.file_layers(meta) == (tuple(extract.layers), ("pre",) * len(extract.layers))
    print(f"fp8: {len(ids)} tokens, {states.shape}, speculators' bytes equal; max abs "
          f"error {float(np.abs(back - wide).max()):.3g}", file=sys.stderr)
