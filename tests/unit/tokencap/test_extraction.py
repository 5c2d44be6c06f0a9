"""The hidden-state stage (`tokencap/extraction.py`): its disk plan (`tokencap plan` with
`[hidden_states]`, `hidden-states --plan`): bytes per token from the model's config, per
category under its byte budget and in all; `plan --check` refuses (exit 10) states that would
not fit the free space; the config refuses layer ids the model does not have. Its rows,
listed from the training rows and only ever appended to (the rows generated since said by
the plan), its categories arriving as their generation ends, and its run `<run>.hs`. The
stage run is `tests/pipeline/test_hidden_states.py`'s."""

from __future__ import annotations

import json
import shutil

import pytest
from click.testing import CliRunner

from foundation.config import load_config
from foundation.errors import ConfigError
from tests.conftest import DATASETS, FIXTURES
from tests.helpers import row_result, write_run
from tokencap.cli.offline import plan_cmd

GSM8K = DATASETS / "question_answer" / "gsm8k_test_first200.jsonl"


def config(tmp, hidden: int, layers: int = 36, extra: str = "") -> str:
    model = tmp / "config.json"
    model.write_text(json.dumps({"num_hidden_layers": layers, "hidden_size": hidden,
                                 "torch_dtype": "bfloat16"}))
    path = tmp / "run.toml"
    path.write_text(f"""
run = "p"
output_dir = "{tmp / 'out'}"
tokenizer = "{FIXTURES / 'tokenizers' / 'qwen3'}"
[hidden_states]
model_config = "{model}"
output_dir = "{tmp / 'hs'}"
{extra}
[[category]]
name = "a"
source = "{GSM8K}"
cap_tokens = 100000
sampling = {{ max_new_tokens = 512 }}
""")
    return str(path)


def test_the_plan_gives_the_states_bytes_under_the_budget(tmp_path) -> None:
    path = config(tmp_path, 4096, extra="max_bytes = { a = 1_000_000_000 }")
    cfg = load_config(path)
    assert cfg.hidden_states.layers == [2, 18, 33, 36]  # Qwen3-8B's shape: EAGLE-3's ids
    res = CliRunner().invoke(plan_cmd, [path])
    assert res.exit_code == 0, res.output
    assert "32,776 bytes per token" in res.output  # 4 x 4096 x 2 + the id
    assert "30,510 tokens" in res.output and "(budget 1.00 GB)" in res.output  # 1e9 // 32,776


def test_plan_check_refuses_states_that_would_not_fit_the_disk(tmp_path) -> None:
    path = config(tmp_path, 2_000_000_000)  # 16 GB a token: no disk holds a category
    res = CliRunner().invoke(plan_cmd, [path, "--check"])
    assert res.exit_code == 10 and "GB free" in res.output and "Traceback" not in res.output


def test_a_plan_is_said_then_checked_less_the_states_already_kept(tmp_path,
                                                                   monkeypatch) -> None:
    """`say_plan`, the one way `hidden-states --plan`, the stage and `tokencap plan` say and
    check a plan: the lines first, then the bytes still to write (the plan's less what is
    kept) against the free space."""
    from foundation.errors import DiskFull
    from foundation.outputs import states_dir
    from tokencap import extraction

    stage = extraction.StatesStage.of(load_config(config(tmp_path, 64)))
    write_run(tmp_path / "out", {"a": [row_result("a", "s0", [1, 2], [3, 4, 5])]})
    plan = extraction.disk_plan(stage)
    whole = plan["a"].bytes
    assert whole == 5 * stage.bytes_per_token
    said: list[str] = []
    assert extraction.say_plan(stage, plan, said.append) == whole
    assert said == extraction.plan_lines(stage, plan)
    folder = states_dir(stage.spec.output_dir, "a")
    folder.mkdir(parents=True)
    (folder / "s0.safetensors").write_bytes(b"k" * 1000)  # a kept file counts against the need
    assert extraction.say_plan(stage, plan, said.append) == whole - 1000
    real_usage = shutil.disk_usage
    monkeypatch.setattr(shutil, "disk_usage",
                        lambda p: real_usage(p)._replace(free=whole - 1000 - 1))
    said.clear()
    with pytest.raises(DiskFull):
        extraction.say_plan(stage, plan, said.append)
    assert said == extraction.plan_lines(stage, plan)  # said before the refusal


@pytest.mark.parametrize("layers,extra", [(36, "layers = [2, 18, 33, 40]"),
                                          (36, "layers = [2, 18, 18, 36]"),
                                          (5, "")])
def test_layer_ids_the_model_does_not_have_are_refused(tmp_path, layers, extra) -> None:
    with pytest.raises(ConfigError, match=r"hidden_states\.layers"):
        load_config(config(tmp_path, 64, layers, extra))


def test_the_stage_is_a_run_of_its_own_over_the_training_rows_appended_only(
        tmp_path, monkeypatch) -> None:
    import msgspec

    from foundation.outputs import rows_file
    from foundation.wire import Result, encode
    from tokencap import extraction

    cfg = load_config(config(tmp_path, 64, extra="max_bytes = { a = 10_000 }"))
    out = tmp_path / "out" / "a"
    out.mkdir(parents=True)
    rows = [Result(id=f"s{i}", category="a", prompt_ids=[1, 2, 3], output_ids=[4] * (i + 1),
                   prompt_tokens=3, completion_tokens=i + 1, finish_reason=finish, text="",
                   sampling={}, counted_tokens=i + 1)
            for i, finish in enumerate(["stop", "length", "stop"])]  # a cut row: not trained on
    (out / "part-00001.jsonl").write_bytes(b"".join(encode(r) + b"\n" for r in rows))
    stage = extraction.StatesStage.of(cfg)
    assert stage.bytes_per_token == 4 * 64 * 2 + 8 and stage.budgets == {"a": 10_000}
    # the plan before the rows file exists reads the training rows, and writes nothing
    # (3 samples final: the cut one is a committed reply too; its 2 output tokens not a row's)
    assert extraction.rows_on_disk(stage) == {"a": extraction.RowTokens(2, 10, 4, 3)}
    assert not rows_file(stage.spec.output_dir, "a").exists()
    assert extraction.append_rows(stage, "a") == 2
    path = rows_file(stage.spec.output_dir, "a")
    first = path.read_bytes()
    assert first.splitlines() == [
        b'{"id":"s0","input_ids":[1,2,3,4]}', b'{"id":"s2","input_ids":[1,2,3,4,4,4]}']
    assert extraction.append_rows(stage, "a") == 0 and path.read_bytes() == first
    # rows generated later (a raised cap, a resume): the plan counts them, not yet listed
    (out / "part-00002.jsonl").write_bytes(encode(msgspec.structs.replace(rows[0], id="s9"))
                                           + b"\n")
    assert extraction.rows_on_disk(stage) == {"a": extraction.RowTokens(3, 14, 5, 4, 1)}
    plan = extraction.disk_plan(stage)
    assert plan["a"] == extraction.CategoryPlan(3, 14, 14 * stage.bytes_per_token, 10_000, 1)
    assert any("1 of them generated since the stage last ran, not in its rows file yet"
               in line for line in extraction.plan_lines(stage, plan))
    # appended after the lines there, which stay as they were (the stage's sample ids); a
    # partial line a crash left mid-append is cut first
    with path.open("ab") as f:
        f.write(b'{"id":"s9","inp')
    assert extraction.append_rows(stage, "a") == 1
    assert path.read_bytes() == first + b'{"id":"s9","input_ids":[1,2,3,4]}\n'
    assert extraction.rows_on_disk(stage)["a"].missing == 0
    # its run: `<run>.hs`, a token cap per category at the byte budget, one token a row
    scfg = extraction.stage_config(stage)
    assert scfg.run == "p.hs" and scfg.stage == "hidden_states" and not scfg.reply_gate
    [cat] = scfg.category
    assert (cat.name, cat.source, cat.format) == ("a", str(path), "input_ids")
    assert cat.cap_tokens == 10_000 // stage.bytes_per_token
    assert cat.sampling.max_new_tokens == 1
    # the extraction servers: the flag, else the environment, else the config's
    monkeypatch.delenv(extraction.EXTRACT_URL_ENV, raising=False)
    assert extraction.extract_url(stage) == ""
    monkeypatch.setenv(extraction.EXTRACT_URL_ENV, "http://a:8000,http://b:8000")
    assert extraction.extract_urls(stage) == ["http://a:8000", "http://b:8000"]
    assert extraction.extract_url(stage, "http://flag:8000") == "http://flag:8000"


def test_a_category_arrives_when_its_generation_ended_and_again_when_it_grew(
        tmp_path) -> None:
    import msgspec

    from foundation.outputs import rows_file
    from foundation.wire import Result, encode
    from tests.helpers import category_state
    from tokencap import extraction

    cfg = load_config(config(tmp_path, 64))
    out = tmp_path / "out" / "a"
    out.mkdir(parents=True)
    row = Result(id="s0", category="a", prompt_ids=[1, 2], output_ids=[3], prompt_tokens=2,
                 completion_tokens=1, finish_reason="stop", text="", sampling={},
                 counted_tokens=1)
    (out / "part-00001.jsonl").write_bytes(encode(row) + b"\n")
    gen = {"a": category_state(state="open", samples=1)}
    over = {"flag": False}
    said: list[str] = []
    arrivals = extraction.Arrivals(extraction.StatesStage.of(cfg), lambda: gen,
                                   lambda: over["flag"], said.append, every_s=0.0)
    path = rows_file(cfg.states().output_dir, "a")
    # generation still runs the category: nothing listed, nothing fed
    assert arrivals.arrived() == [] and not path.exists() and not arrivals.settled()
    # it ended, but a result is not written yet: not yet
    gen["a"] = category_state(state="exhausted", samples=1, unwritten=1)
    assert arrivals.arrived() == []
    gen["a"] = category_state(state="exhausted", samples=1)
    assert arrivals.arrived() == ["a"] and path.read_bytes().count(b"\n") == 1
    assert said == [f"hidden states of a (its generation exhausted): 1 training row(s) added "
                    f"to {path}"]
    assert arrivals.arrived() == []  # nothing new
    # a raised cap: generation opened it again, made a row, ended it again
    gen["a"] = category_state(state="open", samples=1)
    (out / "part-00002.jsonl").write_bytes(encode(msgspec.structs.replace(row, id="s1"))
                                           + b"\n")
    assert arrivals.arrived() == []
    gen["a"] = category_state(state="closed", samples=2)
    assert arrivals.arrived() == ["a"] and path.read_bytes().count(b"\n") == 2
    # generation over: the last listing, then settled
    over["flag"] = True
    assert arrivals.arrived() == [] and arrivals.settled()


def test_prepare_is_the_stage_s_one_way_in_and_writes_nothing(
        tmp_path, monkeypatch) -> None:
    from foundation.errors import DiskFull, TokencapError
    from foundation.outputs import rows_file, states_dir
    from tokencap import extraction

    cfg = load_config(config(tmp_path, 64))
    write_run(tmp_path / "out", {"a": [row_result("a", "s0", [1, 2], [3, 4, 5])]})
    monkeypatch.delenv(extraction.EXTRACT_URL_ENV, raising=False)
    said: list[str] = []
    with pytest.raises(TokencapError, match="no extraction server"):
        extraction.prepare(cfg, None, said.append)
    assert not rows_file(cfg.states().output_dir, "a").exists() and not said
    huge = load_config(config(tmp_path, 2_000_000_000))  # 16 GB a token, 80 GB the row
    real_usage = shutil.disk_usage
    monkeypatch.setattr(shutil, "disk_usage",  # a disk of 50 GB free, whatever this one has
                        lambda p: real_usage(p)._replace(free=50_000_000_000))
    with pytest.raises(DiskFull, match="50.00 GB free"):
        extraction.prepare(huge, "http://x:8000", said.append)
    assert said and "bytes per token" in said[0]  # the plan said, then refused
    assert not rows_file(huge.states().output_dir, "a").exists()
    monkeypatch.undo()
    monkeypatch.delenv(extraction.EXTRACT_URL_ENV, raising=False)
    said.clear()
    ready = extraction.prepare(cfg, "http://x:8000", said.append)
    assert ready.engines == "http://x:8000" and ready.run.run == "p.hs"
    assert any("a: 1 rows, 5 tokens" in line for line in said)
    # the rows are listed as the categories arrive, not here
    assert not rows_file(cfg.states().output_dir, "a").exists()
    # its way out: the temporaries of a worker killed mid-write, and nothing else
    folder = states_dir(cfg.states().output_dir, "a")
    folder.mkdir(parents=True)
    (folder / ".s0.safetensors.tmp").write_bytes(b"torn")
    (folder / "s1.safetensors").write_bytes(b"kept")
    assert extraction.finish(ready.stage) == 1
    assert [p.name for p in folder.iterdir()] == ["s1.safetensors"]


def test_finish_writes_the_manifest_of_each_ended_category_from_its_result_rows(
        tmp_path) -> None:
    """The stage's end: each ended category's manifest from its committed result rows, the
    CRC32s a row of an earlier version does not give read from its file once (or taken from
    the manifest an earlier end wrote); a category not ended gets none."""
    import os

    from foundation import hsfile
    from foundation import states_manifest as sm
    from foundation.outputs import states_file
    from foundation.wire import Result, encode
    from sglang_sim.hidden import file_bytes
    from tokencap import extraction

    cfg = load_config(config(tmp_path, 64, extra='max_bytes = { a = 1_000_000_000 }'))
    stage = extraction.StatesStage.of(cfg)
    root = cfg.states().output_dir
    lines = []
    for i in range(3):
        ids = list(range(10 * i, 10 * i + 4))
        data = file_bytes(ids, list(stage.spec.layers), 64, "bfloat16")
        path = states_file(root, "a", f"row{i}")
        hsfile.write_whole(path, data)
        # what a worker of this version says of a kept file: no row, no CRC32
        desc = {"file": os.path.relpath(path, root), "tokens": 4, "bytes": len(data),
                "layers": list(stage.spec.layers), "hidden_size": 64, "dtype": "BF16"}
        lines.append(encode(Result(
            id=str(i), category="a", prompt_ids=[], output_ids=[], prompt_tokens=4,
            completion_tokens=0, finish_reason="stop", text="", sampling={},
            counted_tokens=4, source_id=f"row{i}", hidden_states=desc)) + b"\n")
    (tmp_path / "hs" / "a" / "part-00000.jsonl").write_bytes(b"".join(lines) + b"{torn\n")
    assert extraction.finish(stage) == 0 and not sm.manifest_path(root, "a").exists()
    extraction.finish(stage, ["a"])
    doc = sm.read(sm.manifest_path(root, "a"), "a")
    assert doc.run == "p.hs" and sorted(f.row for f in doc.files) == ["row0", "row1", "row2"]
    assert all(f.crc32 and f.header_crc32 is not None for f in doc.files)
    assert all(f.final_norm == ["pre"] * 4 and f.layers == [2, 18, 33, 36] for f in doc.files)
    assert sm.verify(root, "a").problems == []
    # a later end reuses the CRC32s it wrote: a file changed since is not certified anew
    changed = tmp_path / "hs" / doc.files[0].file
    raw = bytearray(changed.read_bytes())
    raw[-1] ^= 0x01
    changed.write_bytes(bytes(raw))
    extraction.finish(stage, ["a"])
    [p] = sm.verify(root, "a").problems
    assert (p.kind, p.file) == ("changed", doc.files[0].file)
