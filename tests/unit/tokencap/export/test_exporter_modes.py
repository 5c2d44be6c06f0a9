"""The export of a run with modes: speculators' rows carry each row's sampling under
`metadata.sampling_params` (and its mode and template kwargs), `--mode` keeps one mode
(whole conversations), the manifest counts rows and tokens per mode against the weights;
rows written before modes export as before."""

from __future__ import annotations

import json

import msgspec
import pyarrow as pa
from click.testing import CliRunner

from foundation.wire import Result
from tests.helpers import row_result, write_run
from tokencap.cli.main import main
from tokencap.export.exporter import export
from tokencap.export.sinks import SPECULATORS_SHARD

THINK = {"max_new_tokens": 128, "temperature": 0.9, "stop": "</s>",
         "stop_token_ids": [7, 8], "logit_bias": {"5": -2.0}}
FAST = {"max_new_tokens": 96, "temperature": 0.6}


def made(mode: str, row: Result) -> Result:
    sampling = THINK if mode == "think" else FAST
    return msgspec.structs.replace(row, mode=mode, sampling=sampling,
                                   chat_template_kwargs={"enable_thinking": mode == "think"})


def run(tmp_path):
    rows = []
    for c in range(6):  # conversations of two turns: 4 think, 2 fast
        mode = "think" if c < 4 else "fast"
        for t in (1, 2):
            rows.append(made(mode, row_result("chat", f"c{c}#t{t}", [1, 2, 3], [4] * (t + c),
                                              conv=f"c{c}", turn=t, total=2)))
    old = [row_result("old", f"o{i}", [1, 2], [3, 4]) for i in range(3)]  # before modes
    return write_run(tmp_path / "out", {"chat": rows, "old": old})


def shard(folder):
    with pa.ipc.open_stream(str(folder / SPECULATORS_SHARD)) as reader:
        return reader.read_all()


def test_speculators_rows_carry_their_sampling_params_and_mode(tmp_path) -> None:
    out = run(tmp_path)
    summary = export(out, tmp_path / "x", ["speculators", "specforge"], merged=True,
                     allow_simulated=True,
                     weights={"chat": {"think": 0.7, "fast": 0.3}})
    table = shard(tmp_path / "x" / "speculators")
    meta = dict(zip(table.column("id").to_pylist(), table.column("metadata").to_pylist(),
                    strict=True))
    think = meta["chat/c0#t1"]
    assert think["mode"] == "think" and think["finish_reason"] == "stop"
    sp = think["sampling_params"]
    assert (sp["temperature"], sp["max_new_tokens"], sp["stop"], sp["stop_token_ids"]) == \
        (0.9, 128, ["</s>"], [7, 8])
    assert json.loads(sp["logit_bias"]) == {"5": -2.0} and sp["top_p"] is None
    assert json.loads(think["chat_template_kwargs"]) == {"enable_thinking": True}
    fast = meta["chat/c5#t2"]["sampling_params"]
    assert (fast["temperature"], fast["max_new_tokens"]) == (0.6, 96)
    # a row written before modes: no mode, no kwargs recorded
    assert meta["old/o0"]["mode"] == "" and meta["old/o0"]["chat_template_kwargs"] is None
    # the manifest: rows and tokens per mode, their shares, against the weights
    modes = summary["modes"]["chat"]
    assert (modes["think"]["rows"], modes["fast"]["rows"]) == (8, 4)
    assert modes["think"]["tokens"] == sum(3 + t + c for c in range(4) for t in (1, 2))
    assert modes["think"]["share_rows"] == round(8 / 12, 4)
    assert (modes["think"]["weight"], modes["fast"]["weight"]) == (0.7, 0.3)
    assert "old" not in summary["modes"]
    written = json.loads((tmp_path / "x" / "export-manifest.json").read_text())
    assert written["modes"] == summary["modes"]


def test_export_mode_keeps_one_mode_whole_conversations(tmp_path) -> None:
    out = run(tmp_path)
    result = CliRunner().invoke(main, ["export", "--out", str(out), "--dest",
                                      str(tmp_path / "x"), "--format", "specforge",
                                      "--format", "speculators", "--mode", "fast",
                                      "--allow-simulated", "--draft-vocab-size", "0",
                                      "--json"])
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout)
    assert summary["mode"] == "fast"
    chat = summary["categories"]["chat"]
    assert (chat["rows"], chat["other_modes"]) == (4, 8)
    assert summary["categories"]["old"]["rows"] == 0  # made in no mode
    ids = [json.loads(line)["id"] for line in
           (tmp_path / "x" / "chat" / "specforge.jsonl").read_text().splitlines()]
    assert sorted(ids) == ["c4#t1", "c4#t2", "c5#t1", "c5#t2"]
    table = shard(tmp_path / "x" / "chat" / "speculators")
    assert {m["mode"] for m in table.column("metadata").to_pylist()} == {"fast"}


def test_a_share_tokens_categorys_budgets_add_up_under_its_name(tmp_path) -> None:
    rows = {f"chat.{mode}": [made(mode, row_result(f"chat.{mode}", f"{mode}-{i}", [1, 2],
                                                   [3] * (i + 1))) for i in range(n)]
            for mode, n in (("think", 3), ("fast", 1))}
    summary = export(write_run(tmp_path / "out", rows), tmp_path / "x", ["specforge"],
                     allow_simulated=True, weights={"chat": {"think": 0.7, "fast": 0.3}},
                     family_of={"chat.think": "chat", "chat.fast": "chat"})
    chat = summary["modes"]["chat"]
    assert set(summary["modes"]) == {"chat"}
    assert (chat["think"]["rows"], chat["fast"]["rows"]) == (3, 1)
    assert chat["think"]["tokens"] == 2 * 3 + 1 + 2 + 3 and chat["think"]["weight"] == 0.7
    assert chat["fast"]["share_rows"] == 0.25
