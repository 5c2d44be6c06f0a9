"""The simulator's vLLM hidden-state extraction (`sglang_sim.hidden`): the reply names a
safetensors file per request, the file holds `sglang_sim.hidden.states` of the prompt in the
model dtype beside the prompt's ids, the writer's lock, and each file fault."""

from __future__ import annotations

import fcntl
import json
import os
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import requests

from foundation import hsfile
from sglang_sim import hidden
from sglang_sim.__main__ import build_parser, config_from_args
from sglang_sim.config import SimConfig
from sglang_sim.testing import SimServer

FAST = 1000.0
TIMEOUT_S = 30.0
LAYERS = [2, 4, 5, 8]
HIDDEN = 16
PROMPT = [101, 7, 151_000, 42, 42, 9, 3]
BF16_REL = 2.0**-8  # bf16 keeps 8 significant bits: round to nearest is within half of 2^-7


def extracting(tmp_path: Path, dtype: str = "float32", **overrides: Any) -> SimServer:
    fields: dict[str, Any] = {"hs_layer_ids": LAYERS, "hs_hidden_size": HIDDEN, **overrides}
    return SimServer(flavor="vllm", time_scale=FAST, extract_hidden_states=True,
                     hs_storage_path=str(tmp_path), hs_dtype=dtype, **fields)


def complete(sim: SimServer, prompt: list[int] = PROMPT, **body: Any) -> dict[str, Any]:
    reply = requests.post(f"{sim.url}/v1/completions",
                          json={"prompt": prompt, "max_tokens": 1, **body}, timeout=TIMEOUT_S)
    assert reply.status_code == 200, reply.text
    out: dict[str, Any] = reply.json()
    return out


def states_path(reply: dict[str, Any]) -> str:
    path: str = reply["kv_transfer_params"]["hidden_states_path"]
    return path


# the pure parts


def test_states_are_deterministic_finite_and_never_zero() -> None:
    a = hidden.states(PROMPT, LAYERS, HIDDEN)
    assert a.dtype == np.float32 and a.shape == (len(PROMPT), len(LAYERS), HIDDEN)
    assert np.array_equal(a, hidden.states(PROMPT, LAYERS, HIDDEN))
    assert np.isfinite(a).all() and (a != 0).all()
    # each of token, position, layer id and dimension changes the values
    assert not np.array_equal(a[3], a[4])  # same token (42), another position and previous
    assert not np.array_equal(a[:, 0], a[:, 1])
    assert not np.array_equal(a[..., 0], a[..., 1])
    # causal-ish: a token's states depend on the token before it, not on those after
    b = hidden.states([5, *PROMPT[1:]], LAYERS, HIDDEN)
    assert not np.array_equal(a[1], b[1])
    assert np.array_equal(a[2:], b[2:])
    c = hidden.states([*PROMPT[:-1], 77], LAYERS, HIDDEN)
    assert np.array_equal(a[:-1], c[:-1])
    # a prefix's states are the prefix of the states
    assert np.array_equal(hidden.states(PROMPT[:3], LAYERS, HIDDEN), a[:3])


def test_bf16_rounds_to_nearest_even() -> None:
    one = 1.0
    step = 2.0**-7  # bf16's spacing in [1, 2)
    values = np.array([one, one + step / 2, one + 3 * step / 2, one + step / 2 + 2.0**-20,
                       -2.5, float("inf"), float("nan")], dtype=np.float32)
    raw = hidden.to_bf16(values)
    assert raw.dtype == np.uint16
    assert raw[:6].tolist() == [0x3F80, 0x3F80, 0x3F82, 0x3F81, 0xC020, 0x7F80]
    back = hidden.from_bf16(raw)
    assert np.isnan(back[6])
    assert back[:6].tolist() == [1.0, 1.0, 1.0 + 2 * step, 1.0 + step, -2.5, float("inf")]


def test_encode_is_read_by_the_projects_reader(tmp_path: Path) -> None:
    data = hidden.file_bytes(PROMPT, LAYERS, HIDDEN, "float32")
    n = int.from_bytes(data[:8], "little")
    assert n % 8 == 0
    header = json.loads(data[8:8 + n])  # JSON, padded with spaces
    assert header["hidden_states"] == {"dtype": "F32", "shape": [len(PROMPT), len(LAYERS), HIDDEN],
                                       "data_offsets": [0, len(PROMPT) * len(LAYERS) * HIDDEN * 4]}
    assert header["token_ids"]["dtype"] == "I64"
    assert len(data) == 8 + n + header["token_ids"]["data_offsets"][1]
    path = tmp_path / "x.safetensors"
    path.write_bytes(data)
    tensors, meta = hsfile.read(path)
    assert meta == {}
    assert tensors["hidden_states"].dtype == "F32"
    assert tensors["token_ids"].dtype == "I64"
    assert np.array_equal(tensors["hidden_states"].array(), hidden.states(PROMPT, LAYERS, HIDDEN))
    hsfile.check(path, tensors, PROMPT, len(LAYERS), HIDDEN, "F32")


# the server


def test_the_file_is_named_after_the_client_s_request_id_as_vllm_does(tmp_path: Path) -> None:
    with extracting(tmp_path, "float32") as sim:
        reply = complete(sim, request_id="tcabc-row7-1f")
    assert reply["id"] == "cmpl-tcabc-row7-1f"
    assert re.fullmatch(r"cmpl-tcabc-row7-1f-0-[0-9a-f]{8}\.safetensors",
                        Path(states_path(reply)).name)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_reply_names_a_file_of_the_prompts_states(tmp_path: Path, dtype: str) -> None:
    with extracting(tmp_path, dtype) as sim:
        reply = complete(sim, return_token_ids=True)
    assert len(reply["choices"][0]["token_ids"]) == 1
    path = Path(states_path(reply))
    # vLLM's internal id: cmpl-<the request's id>-<prompt index>-<8 random hex>
    assert path.parent == tmp_path
    assert re.fullmatch(rf"{reply['id']}-0-[0-9a-f]{{8}}\.safetensors", path.name), path.name
    assert Path(f"{path}.lock").exists()
    tensors, _meta = hsfile.read(path)
    name = hsfile.DTYPE_NAMES[dtype]
    hsfile.check(path, tensors, PROMPT, len(LAYERS), HIDDEN, name)
    hs = tensors["hidden_states"]
    assert hs.dtype == name and hs.shape == (len(PROMPT), len(LAYERS), HIDDEN)
    assert tensors["token_ids"].array().tolist() == PROMPT
    want = hidden.states(PROMPT, LAYERS, HIDDEN)
    got = hs.array()
    if dtype == "float32":
        assert np.array_equal(got, want)
    else:
        assert np.array_equal(got, hidden.from_bf16(hidden.to_bf16(want)))
        assert np.allclose(got, want, rtol=BF16_REL, atol=0.0)


def test_every_request_writes_its_own_file_and_frees_the_lock(tmp_path: Path) -> None:
    with extracting(tmp_path) as sim:
        paths = [states_path(complete(sim)) for _ in range(3)]
        other = states_path(complete(sim, prompt=PROMPT[:4]))
    assert len({*paths, other}) == 4
    assert all(Path(p).exists() for p in (*paths, other))
    assert hsfile.read(other)[0]["token_ids"].array().tolist() == PROMPT[:4]
    # the writer let go: an exclusive lock is free at once, and a reader reads under a shared
    fd = os.open(f"{other}.lock", os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)
    assert hidden.read_locked(other) == Path(other).read_bytes()


def test_include_output_tokens_stores_the_output_but_its_last(tmp_path: Path) -> None:
    with extracting(tmp_path) as sim:
        one = complete(sim, kv_transfer_params={"include_output_tokens": True})
        three = complete(sim, max_tokens=3, ignore_eos=True, return_token_ids=True,
                         kv_transfer_params={"include_output_tokens": True})
        plain = complete(sim, max_tokens=3, ignore_eos=True)
    assert hsfile.read(states_path(one))[0]["token_ids"].array().tolist() == PROMPT
    out = three["choices"][0]["token_ids"]
    assert len(out) == 3
    stored = [*PROMPT, *out[:-1]]
    tensors, _ = hsfile.read(states_path(three))
    assert tensors["token_ids"].array().tolist() == stored
    assert np.array_equal(tensors["hidden_states"].array(),
                          hidden.states(stored, LAYERS, HIDDEN))
    assert hsfile.read(states_path(plain))[0]["token_ids"].array().tolist() == PROMPT


@pytest.mark.parametrize(("knob", "reason"), [
    ("hs_zero_layer_rate", "zero_layer"),
    ("hs_nan_rate", "not_finite"),
    ("hs_wrong_ids_rate", "token_ids"),
])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_file_faults(tmp_path: Path, knob: str, reason: str, dtype: str) -> None:
    with extracting(tmp_path, dtype) as sim:
        healthy = states_path(complete(sim))
        sim.set_faults(**{knob: 1.0})
        broken = states_path(complete(sim))
        injected = sim.stats()["faults_injected"]
        sim.set_faults(**{knob: 0.0})
        healed = states_path(complete(sim))
    name = hsfile.DTYPE_NAMES[dtype]
    for path in (healthy, healed):
        hsfile.check(path, hsfile.read(path)[0], PROMPT, len(LAYERS), HIDDEN, name)
    with pytest.raises(hsfile.BadFile) as caught:
        hsfile.check(broken, hsfile.read(broken)[0], PROMPT, len(LAYERS), HIDDEN, name)
    assert caught.value.reason == reason
    assert injected == {knob.removesuffix("_rate"): 1}


def test_truncated_file_is_torn_but_answered(tmp_path: Path) -> None:
    with extracting(tmp_path, hs_truncate_rate=1.0) as sim:
        assert sim.faults()["hs_truncate_rate"] == 1.0
        path = states_path(complete(sim))
    whole = hidden.file_bytes(PROMPT, LAYERS, HIDDEN, "float32")
    assert 8 < Path(path).stat().st_size < len(whole)
    with pytest.raises(hsfile.BadFile) as caught:
        hsfile.read(path)
    assert caught.value.reason == "torn"


def test_without_extraction_no_kv_transfer_params(tmp_path: Path) -> None:
    with SimServer(flavor="vllm", time_scale=FAST, hs_storage_path=str(tmp_path)) as sim:
        reply = complete(sim)
    assert reply.get("kv_transfer_params") is None
    assert list(tmp_path.iterdir()) == []


def test_config_refusals(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="flavor='vllm'.*last layer"):
        SimServer(extract_hidden_states=True, hs_storage_path=str(tmp_path))
    with pytest.raises(ValueError, match="hs_storage_path"):
        SimServer(flavor="vllm", extract_hidden_states=True)
    bad: list[dict[str, Any]] = [{"hs_layer_ids": []}, {"hs_layer_ids": [1, 1]},
                                 {"hs_layer_ids": [-1]}, {"hs_hidden_size": 0},
                                 {"hs_nan_rate": 1.5},
                                 {"hs_truncate_rate": -0.1}]
    for change in bad:
        with pytest.raises(ValueError):
            extracting(tmp_path, **change)
    with pytest.raises(ValueError, match="hs_dtype"):
        extracting(tmp_path, "float16")
    with SimServer(flavor="vllm", time_scale=FAST) as sim, pytest.raises(ValueError):
        sim.set_faults(hs_wrong_ids_rate=2.0)
    defaults = SimConfig()
    assert not defaults.extract_hidden_states and defaults.hs_dtype == "bfloat16"
    assert defaults.faults.hs_nan_rate == 0.0


def test_cli_flags(tmp_path: Path) -> None:
    ns = build_parser().parse_args([
        "--flavor", "vllm", "--extract-hidden-states", "--hs-layer-ids", "1,3,7",
        "--hs-hidden-size", "32", "--hs-dtype", "float32", "--hs-storage-path", str(tmp_path),
        "--faults", '{"reset_rate": 0.5}', "--hs-nan-rate", "0.25", "--hs-truncate-rate", "0.1",
    ])
    config = config_from_args(ns)
    assert config.extract_hidden_states and config.hs_layer_ids == [1, 3, 7]
    assert (config.hs_hidden_size, config.hs_dtype) == (32, "float32")
    assert config.hs_storage_path == str(tmp_path)
    assert config.faults.reset_rate == 0.5 and config.faults.hs_nan_rate == 0.25
    assert config.faults.hs_truncate_rate == 0.1 and config.faults.hs_zero_layer_rate == 0.0
    with pytest.raises(ValueError, match="flavor"):
        config_from_args(build_parser().parse_args(
            ["--extract-hidden-states", "--hs-storage-path", str(tmp_path)]))


def test_fp8_files_are_speculators_layout_with_tokencap_s_metadata(tmp_path: Path) -> None:
    """hs_dtype fp8_e4m3 with hs_metadata: the file tokencap's connector writes (FP8 states,
    one float32 scale per token, the layer ids and their final-norm side), and the project's
    reader finds it as the file check wants it; the FP8 bytes are its own quantization of
    the same states."""
    with extracting(tmp_path, "fp8_e4m3", hs_metadata=True, hs_layer_ids=[8, 2, 5, 4]) as sim:
        path = states_path(complete(sim))
    tensors, meta = hsfile.read(path)
    assert meta == {hidden.META_LAYERS: "2,4,5,8", hidden.META_FINAL_NORM: "pre,pre,pre,pre"}
    assert tensors["hidden_states"].dtype == hsfile.FP8
    assert tensors[hsfile.SCALES].shape == (len(PROMPT), 1, 1)
    want = hidden.states(PROMPT, LAYERS, HIDDEN)  # the slots rising, as the metadata says
    _, scales = hsfile.to_fp8(hsfile.Tensor("F32", want.shape, want.astype("<f4").tobytes()))
    assert tensors[hsfile.SCALES].data == scales.data  # the same float32 scales
    q, _ = hsfile.to_fp8(hsfile.Tensor("F32", want.shape, want.astype("<f4").tobytes()))
    assert tensors["hidden_states"].data == q.data
    layers = hsfile.check_row_file(Path(path), tensors, meta, PROMPT, LAYERS, HIDDEN,
                                   hsfile.FP8, True)
    assert list(layers.ids) == LAYERS and layers.read_from == "file"  # hsfile read its names


def test_table_states_are_a_copy_of_one_row_per_token_and_pass_the_checks() -> None:
    """hs_states "table": the states of a token are its id's row (id modulo TABLE_SMALL), the
    same in every file and in every dtype's encoding; finite, no layer all zeros."""
    ids = [3, 3 + hidden.TABLE_SMALL, 7, 150_000]
    for dtype, name in (("bfloat16", "BF16"), ("float32", "F32"), ("fp8_e4m3", hsfile.FP8)):
        tensors, _ = hsfile.decode(hidden.file_bytes(ids, LAYERS, HIDDEN, dtype, table=True),
                                   "x")
        hs = tensors["hidden_states"].array()
        assert np.array_equal(hs[0], hs[1]) and not np.array_equal(hs[0], hs[2])
        hsfile.check_row_file(Path("x"), tensors, {}, ids, LAYERS, HIDDEN, name, True)
