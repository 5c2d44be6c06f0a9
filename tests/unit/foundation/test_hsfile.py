"""foundation/hsfile.py: a file written whole, the temporaries a killed writer left, and
speculators' FP8 layout (one scale per token), its checks and its bytes per token."""

from __future__ import annotations

from pathlib import Path

import pytest

from foundation import hsfile


def test_a_write_leaves_the_file_whole_and_no_temporary(tmp_path: Path) -> None:
    target = tmp_path / "states" / "row.safetensors"
    hsfile.write_whole(target, b"new")
    hsfile.write_whole(target, b"newer")
    assert target.read_bytes() == b"newer"
    assert [p.name for p in target.parent.iterdir()] == ["row.safetensors"]


def test_the_temporaries_of_one_name_are_removed_and_no_other(tmp_path: Path) -> None:
    # Given what killed writers left: two temporaries of row's file, one of another row's
    target = tmp_path / "row.safetensors"
    target.write_bytes(b"whole")
    mine = [tmp_path / ".row.safetensors.41.tmp", tmp_path / ".row.safetensors.42.tmp"]
    other = tmp_path / ".row2.safetensors.41.tmp"
    for p in (*mine, other):
        p.write_bytes(b"torn")
    # When the row's file is in place and its temporaries are removed
    removed = hsfile.remove_temps(target)
    # Then only the row's own are gone, the file and the other row's temporary are kept
    assert removed == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        ".row2.safetensors.41.tmp", "row.safetensors"]
    assert target.read_bytes() == b"whole"
    assert hsfile.remove_temps(target) == 0


def test_a_name_with_glob_characters_matches_only_itself(tmp_path: Path) -> None:
    target = tmp_path / "r[1].safetensors"
    (tmp_path / ".r1.safetensors.7.tmp").write_bytes(b"other")
    (tmp_path / ".r[1].safetensors.7.tmp").write_bytes(b"mine")
    assert hsfile.remove_temps(target) == 1
    assert [p.name for p in tmp_path.iterdir()] == [".r1.safetensors.7.tmp"]


# -- FP8 (speculators' layout) -------------------------------------------------------------

def _bf16(values) -> hsfile.Tensor:
    import numpy as np

    arr = np.asarray(values, dtype=np.float32)
    return hsfile.Tensor("BF16", arr.shape, hsfile.to_bf16_bits(arr).tobytes())


def test_fp8_is_one_scale_per_token_over_its_layers_and_dimensions() -> None:
    import numpy as np

    hs = _bf16([[[448.0, -224.0], [1.0, 0.5]],  # amax 448: scale 1, every value exact
                [[0.0, 0.0], [0.0, 0.0]],  # all zero: the scale's floor, zeros
                [[3.0, 1.5], [-0.75, 0.375]]])  # amax 3: scale 3/448
    q, scales = hsfile.to_fp8(hs)
    assert (q.dtype, q.shape, scales.dtype, scales.shape) == ("F8_E4M3", (3, 2, 2), "F32",
                                                              (3, 1, 1))
    s = scales.array().reshape(-1)
    assert s[0] == np.float32(1.0) and s[1] == np.float32(1e-12)
    assert s[2] == np.float32(3.0) / np.float32(448.0)
    assert q.array()[0].tolist() == [[448.0, -224.0], [1.0, 0.5]]
    assert not q.array()[1].any()
    assert q.array()[2, 0, 0] == 448.0  # the token's largest value lands on the top of e4m3


def test_fp8_round_trip_error_is_within_e4m3s_half_step() -> None:
    import numpy as np

    rng = np.random.default_rng(7)
    x = (rng.standard_normal((64, 4, 96)) * rng.uniform(0.01, 50, (64, 1, 1))).astype(
        np.float32)
    hs = _bf16(x)
    wide = hs.array()
    q, scales = hsfile.to_fp8(hs, chunk_tokens=5)  # chunks give the same bytes as one pass
    assert q.data == hsfile.to_fp8(hs)[0].data
    deq = q.array() * scales.array()
    scale = scales.array()
    # e4m3: 3 mantissa bits (a half step is 2^-4 of the value), subnormals below 2^-6
    bound = np.maximum(np.abs(wide) * 2.0 ** -4, scale * 2.0 ** -10) * (1 + 1e-6)
    assert (np.abs(deq - wide) <= bound).all()
    # what speculators' trainer reads: fp8 and scale each in bf16, their product in bf16
    got = hsfile.from_fp8(q, scales)
    want = hsfile.to_bf16_bits(hsfile.bf16_round(q.array()) * hsfile.bf16_round(scale))
    assert (got == want).all()


def test_an_fp8_file_is_checked_on_its_bits_and_its_scales() -> None:
    import numpy as np

    ids = [5, 6]
    q, scales = hsfile.to_fp8(_bf16(np.ones((2, 3, 4), dtype=np.float32)))
    tok = hsfile.Tensor("I64", (2,), np.asarray(ids, dtype=np.int64).tobytes())

    def check(**over: hsfile.Tensor | None) -> str:
        tensors = {"hidden_states": q, hsfile.SCALES: scales, "token_ids": tok, **over}
        try:
            hsfile.check("f", {k: v for k, v in tensors.items() if v is not None}, ids, 3, 4,
                         hsfile.FP8)
        except hsfile.BadFile as exc:
            return exc.reason
        return "ok"

    assert check() == "ok"
    raw = bytearray(q.data)
    raw[5] = 0x7F  # e4m3fn's NaN
    assert check(hidden_states=hsfile.Tensor(hsfile.FP8, q.shape, bytes(raw))) == "not_finite"
    zero = np.frombuffer(q.data, np.uint8).reshape(q.shape).copy()
    zero[:, 1, :] = 0x80  # -0 in every token: the slot is all zeros
    assert check(hidden_states=hsfile.Tensor(hsfile.FP8, q.shape, zero.tobytes())) == (
        "zero_layer")
    bad = np.asarray([1.0, np.inf], dtype=np.float32).reshape(2, 1, 1)
    assert check(**{hsfile.SCALES: hsfile.Tensor("F32", (2, 1, 1), bad.tobytes())}) == (
        "not_finite")
    assert check(**{hsfile.SCALES: None}) == "shape"
    # an engine's bf16 file is not what an FP8 config keeps, nor FP8 a bf16 one's
    with pytest.raises(hsfile.BadFile, match="dtype"):
        hsfile.check("f", {"hidden_states": q, hsfile.SCALES: scales, "token_ids": tok}, ids,
                     3, 4, "BF16")


def test_bytes_per_token_of_kimi_k2_5_in_bf16_and_fp8() -> None:
    assert hsfile.bytes_per_token(4, 7168, "bfloat16") == 57_352
    assert hsfile.bytes_per_token(4, 7168, "fp8_e4m3") == 28_684  # the states, id, scale


def test_a_file_says_its_layers_only_where_tokencap_s_connector_wrote_them() -> None:
    assert hsfile.file_layers({}) is None
    assert hsfile.file_layers({hsfile.META_LAYERS: "2,4,5,8"}) == ((2, 4, 5, 8), ("pre",) * 4)
    assert hsfile.file_layers({hsfile.META_LAYERS: "1,8", hsfile.META_FINAL_NORM: "pre,post"}
                              ) == ((1, 8), ("pre", "post"))


@pytest.mark.parametrize("dtype", ["BF16", "F16", "F32"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_a_value_not_finite_is_found_where_it_is_past_the_first_chunk(dtype: str,
                                                                     bad: float) -> None:
    import numpy as np

    tokens, layers, hidden = 200, 2, 4096  # 64 tokens a chunk
    np_dtype = {"BF16": np.float32, "F16": np.float16, "F32": np.float32}[dtype]
    values = np.full((tokens, layers, hidden), 0.5, dtype=np_dtype)
    values[130, 1, 7] = bad
    values[:, 0, :] = -0.0  # a layer all (negative) zeros is caught only when all is finite
    ids = list(range(tokens))
    tok = hsfile.Tensor("I64", (tokens,), np.asarray(ids, dtype=np.int64).tobytes())
    hs = _bf16(values) if dtype == "BF16" else hsfile.Tensor(dtype, values.shape,
                                                             values.tobytes())
    with pytest.raises(hsfile.BadFile, match=r"\[token, layer, i\] = \[130, 1, 7\]"):
        hsfile.check("f", {"hidden_states": hs, "token_ids": tok}, ids, layers, hidden, dtype)
    values[130, 1, 7] = 0.25
    hs = _bf16(values) if dtype == "BF16" else hsfile.Tensor(dtype, values.shape,
                                                             values.tobytes())
    with pytest.raises(hsfile.BadFile, match=r"layer slot\(s\) \[0\] all zeros"):
        hsfile.check("f", {"hidden_states": hs, "token_ids": tok}, ids, layers, hidden, dtype)
    values[:, 0, 5] = 1.0
    hs = _bf16(values) if dtype == "BF16" else hsfile.Tensor(dtype, values.shape,
                                                             values.tobytes())
    hsfile.check("f", {"hidden_states": hs, "token_ids": tok}, ids, layers, hidden, dtype)


def test_the_engine_files_of_a_marker_are_found_by_name(tmp_path: Path) -> None:
    # vLLM names a file cmpl-<request id>-<i>-<random>.safetensors, its lock beside it
    marker = hsfile.row_marker("run.hs", tmp_path / "states" / "r[1]*.safetensors")
    mine = [f"cmpl-{marker}0-ab12.safetensors", f"cmpl-{marker}0-ab12.safetensors.lock",
            f"cmpl-{marker}1-cd34.safetensors"]
    others = [f"cmpl-{hsfile.row_marker('run.hs', 'r2.safetensors')}0-ef.safetensors",
              f"cmpl-{marker}0-ab12.safetensors.tmp", "notes.txt"]
    for name in mine + others:
        (tmp_path / name).write_bytes(b"x")
    found = hsfile.engine_files(tmp_path, marker)
    assert sorted(p.name for p in found) == sorted(mine)
    assert all(p.parent == tmp_path for p in found)
    assert hsfile.engine_files(tmp_path / "absent", marker) == []
    assert hsfile.engine_files(tmp_path / "notes.txt", marker) == []
