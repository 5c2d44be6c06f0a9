"""`tokencap export`: SpecForge rows, conversations and Parquet from real Qwen2.5 renders.

The output folders are built the way a run builds them: fixture prompts read and
rendered with the Qwen2.5 fixture tokenizer give `prompt_ids`; `output_ids` are a known
answer encoded plus `<|im_end|>` (stop) or cut short without it (length); each line is a
`wire.Result` encoded as the writer encodes it.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import msgspec
import pytest
from click.testing import CliRunner

from foundation.wire import Result
from producer.readers.index import SourceIndex, read_sample, shuffled_order
from producer.render import Renderer
from tests.conftest import DATASETS, QWEN
from tokencap.cli.offline import export_cmd
from tokencap.export.exporter import ExportError, export

GSM8K = DATASETS / "question_answer" / "gsm8k_test_first200.jsonl"
MINERVA = DATASETS / "problem_solution" / "qwen25math_minerva_math_test.jsonl"
SOURCES = {"math_qa": (GSM8K, "question_answer"), "proofs": (MINERVA, "problem_solution")}
PER_CATEGORY = 4  # results per category; the last one is truncated
ANSWER = "Let me think step by step.\nThe answer is {n}."
SEED = 7


@pytest.fixture(scope="module")
def renderer() -> Renderer:
    return Renderer(QWEN)


def _answer_ids(renderer: Renderer, n: int, truncated: bool) -> tuple[str, list[int]]:
    tok = renderer.tokenizer
    text = ANSWER.format(n=n)
    ids = tok(text, add_special_tokens=False)["input_ids"]
    if truncated:
        ids = ids[:5]
        return tok.decode(ids), ids
    return text, ids + [tok.convert_tokens_to_ids("<|im_end|>")]


def _build_results(renderer: Renderer, category: str) -> list[dict]:
    """Results of the first records of a category's shuffled order, with their texts."""
    path, fmt = SOURCES[category]
    rows = []
    with SourceIndex.build([path]) as index:
        for k, pos in enumerate(shuffled_order(len(index), SEED)[:PER_CATEGORY]):
            sample = read_sample(index, pos, fmt, "first", None)
            text, prompt_ids = renderer.render(sample.prompt)
            truncated = k == PER_CATEGORY - 1
            answer, output_ids = _answer_ids(renderer, k, truncated)
            result = Result(
                id=sample.sample_id, category=category, prompt_ids=prompt_ids,
                output_ids=output_ids, prompt_tokens=len(prompt_ids),
                completion_tokens=len(output_ids),
                finish_reason="length" if truncated else "stop", text=answer,
                sampling={"max_new_tokens": 64}, counted_tokens=len(output_ids),
                ordinal=sample.ordinal, where=sample.where,
            )
            rows.append({"result": result, "prompt_text": text, "answer": answer,
                         "messages": sample.prompt})
    return rows


@pytest.fixture(scope="module")
def built(renderer: Renderer) -> dict[str, list[dict]]:
    return {cat: _build_results(renderer, cat) for cat in SOURCES}


def _write_out(root: Path, built: dict[str, list[dict]], extra: dict[str, bytes] | None = None
               ) -> Path:
    out = root / "out"
    for cat, rows in built.items():
        (out / cat).mkdir(parents=True)
        body = b"".join(msgspec.json.encode(r["result"]) + b"\n" for r in rows)
        (out / cat / "part-00000.jsonl").write_bytes(body + (extra or {}).get(cat, b""))
    return out


def _jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def _config(tmp_path: Path, out: Path) -> Path:
    cats = "".join(
        f'[[category]]\nname = "{cat}"\nsource = "{path}"\nformat = "{fmt}"\n'
        f"sampling = {{ max_new_tokens = 64 }}\n\n"
        for cat, (path, fmt) in SOURCES.items()
    )
    cfg = tmp_path / "run.toml"
    cfg.write_text(f'run = "t"\noutput_dir = "{out}"\ntokenizer = "{QWEN}"\nseed = {SEED}\n\n'
                   + cats, encoding="utf-8")
    return cfg


def test_specforge_rows_supervise_exactly_the_generated_tokens(tmp_path, built, renderer):
    out = _write_out(tmp_path, built)
    summary = export(out, tmp_path / "dest", ["specforge"])
    for cat, rows in built.items():
        got = _jsonl(tmp_path / "dest" / cat / "specforge.jsonl")
        kept = [r for r in rows if r["result"].finish_reason == "stop"]
        assert [g["id"] for g in got] == [r["result"].id for r in kept]
        for g, r in zip(got, kept, strict=True):
            assert set(g) == {"id", "input_ids", "loss_mask"}
            n_prompt, n_out = len(r["result"].prompt_ids), len(r["result"].output_ids)
            assert len(g["input_ids"]) == len(g["loss_mask"]) == n_prompt + n_out
            assert g["loss_mask"] == [0] * n_prompt + [1] * n_out
            supervised = [t for t, m in zip(g["input_ids"], g["loss_mask"], strict=True) if m]
            assert supervised == r["result"].output_ids
            assert supervised[-1] == renderer.tokenizer.convert_tokens_to_ids("<|im_end|>")
            assert renderer.decode(g["input_ids"]) == (
                r["prompt_text"] + r["answer"] + "<|im_end|>")
        st = summary["categories"][cat]
        assert st["rows"] == PER_CATEGORY - 1
        assert st["dropped_truncated"] == 1
        assert st["output_tokens"] == sum(len(r["result"].output_ids) for r in kept)
        assert st["tokens"] == sum(len(g["input_ids"]) for g in got)
    assert summary["total"]["rows"] == 2 * (PER_CATEGORY - 1)


def test_the_manifest_counts_prompts_refused_at_intake_by_benchmark(tmp_path, built):
    from foundation.wire import DeadLetter, Outcome, encode
    from producer.intake import contamination_message

    out = _write_out(tmp_path, built)
    cat = next(iter(built))
    (out / cat / "failed.jsonl").write_bytes(b"".join(encode(DeadLetter(
        id=str(k), category=cat, outcome=Outcome.REJECTED, reason=reason, message=msg)) + b"\n"
        for k, (reason, msg) in enumerate([
            ("near_duplicate", "near-duplicate of x/y:1 (Jaccard 0.95 ...)"),
            ("contaminated", contamination_message("humaneval", "HumanEval/3", 13)),
            ("contaminated", contamination_message("humaneval", "HumanEval/8", 13)),
            ("empty_prompt", "prompt has no tokens")])))
    summary = export(out, tmp_path / "dest", ["specforge"])
    assert summary["refused_at_intake"][cat] == {"near_duplicate": 1,
                                                 "contaminated": {"humaneval": 2}}
    on_disk = json.loads((tmp_path / "dest" / "export-manifest.json").read_text())
    assert on_disk["refused_at_intake"] == summary["refused_at_intake"]


def test_truncated_are_dropped_and_counted_unless_kept(tmp_path, built):
    out = _write_out(tmp_path, built)
    runner = CliRunner()
    res = runner.invoke(export_cmd, ["--out", str(out), "--dest", str(tmp_path / "a"),
                                     "--json"])
    assert res.exit_code == 0, res.output
    assert "math_qa: dropped 1 truncated samples (finish_reason length)" in res.stderr
    assert json.loads(res.stdout)["categories"]["math_qa"]["dropped_truncated"] == 1
    cut = built["math_qa"][-1]["result"]
    assert cut.id not in {r["id"] for r in _jsonl(tmp_path / "a" / "math_qa" / "specforge.jsonl")}

    res = runner.invoke(export_cmd, ["--out", str(out), "--dest", str(tmp_path / "b"),
                                     "--keep-truncated", "--json"])
    assert res.exit_code == 0, res.output
    assert "dropped" not in res.stderr
    doc = json.loads(res.stdout)
    assert doc["categories"]["math_qa"] | {"bad": []} == {
        "rows": PER_CATEGORY, "tokens": doc["categories"]["math_qa"]["tokens"],
        "output_tokens": sum(len(r["result"].output_ids) for r in built["math_qa"]),
        "dropped_truncated": 0, "dropped_after_truncated": 0, "dropped_inconsistent": 0,
        "dropped_tool_args": 0, "dropped_no_states": 0, "dropped_bad_states": 0,
        "made_by": [], "duplicates": 0,
        "bad_lines": 0, "bad": [],
        "conversations": 0, "conversations_complete": 0, "conversations_in_progress": 0,
        "truncated_to_limit": 0, "dropped_over_length": 0, "dropped_too_few_loss_tokens": 0,
        "loss_tokens": sum(len(r["result"].output_ids) for r in built["math_qa"]),
        "eval_rows": 0, "eval_tokens": 0, "other_modes": 0, "modes": {}}
    kept = {r["id"]: r for r in _jsonl(tmp_path / "b" / "math_qa" / "specforge.jsonl")}
    assert kept[cut.id]["loss_mask"][-len(cut.output_ids):] == [1] * len(cut.output_ids)


def test_keep_truncated_on_a_gated_run_exports_the_replies_the_gate_kept_out_as_length(
        tmp_path, built) -> None:
    """With the reply gate on (the default) a cut reply is no part-file row: the gate wrote it
    to rejected-replies.jsonl with reason `length`. --keep-truncated exports it; without it
    it is counted as dropped; the gate's other reasons are never exported."""
    out = tmp_path / "out"
    for cat, rows in built.items():
        (out / cat).mkdir(parents=True)
        kept = [r["result"] for r in rows if r["result"].finish_reason == "stop"]
        cut = [msgspec.structs.replace(r["result"], gate="length") for r in rows
               if r["result"].finish_reason == "length"]
        looped = msgspec.structs.replace(kept[0], id=kept[0].id + "-loop", gate="loop")
        (out / cat / "part-00000.jsonl").write_bytes(
            b"".join(msgspec.json.encode(r) + b"\n" for r in kept))
        (out / cat / "rejected-replies.jsonl").write_bytes(
            b"".join(msgspec.json.encode(r) + b"\n" for r in [*cut, looped]))
    runner = CliRunner()
    res = runner.invoke(export_cmd, ["--out", str(out), "--dest", str(tmp_path / "a"),
                                     "--json"])
    assert res.exit_code == 0, res.output
    st = json.loads(res.stdout)["categories"]["math_qa"]
    assert st["rows"] == PER_CATEGORY - 1 and st["dropped_truncated"] == 1
    assert "--keep-truncated keeps them" in res.stderr
    res = runner.invoke(export_cmd, ["--out", str(out), "--dest", str(tmp_path / "b"),
                                     "--keep-truncated", "--json"])
    assert res.exit_code == 0, res.output
    st = json.loads(res.stdout)["categories"]["math_qa"]
    assert st["rows"] == PER_CATEGORY and st["dropped_truncated"] == 0
    got = {r["id"] for r in _jsonl(tmp_path / "b" / "math_qa" / "specforge.jsonl")}
    assert built["math_qa"][-1]["result"].id in got  # the cut reply, from the gate's file
    assert not any(i.endswith("-loop") for i in got)  # another reason: never a row


def test_parquet_round_trips_with_pyarrow(tmp_path, built):
    import pyarrow as pa
    import pyarrow.parquet as pq

    out = _write_out(tmp_path, built)
    export(out, tmp_path / "dest", ["specforge", "parquet"], merged=True)
    table = pq.read_table(tmp_path / "dest" / "specforge.parquet")
    assert table.schema.field("input_ids").type == pa.list_(pa.int32())
    assert table.schema.field("loss_mask").type == pa.list_(pa.int32())
    assert table.schema.field("counted_tokens").type == pa.int64()
    rows = table.to_pylist()
    jsonl = _jsonl(tmp_path / "dest" / "specforge.jsonl")
    assert [{k: r[k] for k in ("id", "input_ids", "loss_mask")} for r in rows] == jsonl
    results = {f"{cat}/{r['result'].id}": r["result"] for cat, rs in built.items() for r in rs}
    for r in rows:
        res = results[r["id"]]
        assert (r["category"], r["finish_reason"], r["counted_tokens"]) == (
            res.category, "stop", res.counted_tokens)
        assert r["input_ids"] == res.prompt_ids + res.output_ids


def test_merged_holds_every_category_by_category_one_each(tmp_path, built):
    out = _write_out(tmp_path, built)
    by_cat = export(out, tmp_path / "split", ["specforge"])
    merged = export(out, tmp_path / "merged", ["specforge"], merged=True)
    assert sorted(p.name for p in (tmp_path / "split").iterdir()) == sorted(
        [*SOURCES, "export-manifest.json"])
    assert sorted(p.name for p in (tmp_path / "merged").iterdir()) == [
        "export-manifest.json", "specforge.jsonl"]
    split_rows = {cat: _jsonl(tmp_path / "split" / cat / "specforge.jsonl") for cat in SOURCES}
    merged_rows = _jsonl(tmp_path / "merged" / "specforge.jsonl")
    expected = [{**r, "id": f"{cat}/{r['id']}"} for cat in SOURCES for r in split_rows[cat]]
    assert merged_rows == expected
    assert len({r["id"] for r in merged_rows}) == len(merged_rows)
    assert merged["total"] == by_cat["total"]


def test_bad_lines_are_reported_with_file_and_line_and_skipped(tmp_path, built):
    garbage = b'{"id": "x:1", "category": "math_qa", "prompt_ids": [1, -2]}\n\nnot json\n'
    out = _write_out(tmp_path, built, {"math_qa": garbage})
    part = out / "math_qa" / "part-00000.jsonl"
    first_bad = PER_CATEGORY + 1
    res = CliRunner().invoke(export_cmd, ["--out", str(out), "--dest", str(tmp_path / "d"),
                                          "--keep-truncated"])
    assert res.exit_code == 0, res.output
    assert f"{part}:{first_bad}: bad line skipped" in res.stderr
    assert f"{part}:{first_bad + 2}: bad line skipped" in res.stderr
    assert "Traceback" not in res.output
    assert len(_jsonl(tmp_path / "d" / "math_qa" / "specforge.jsonl")) == PER_CATEGORY
    assert "bad lines" in res.stdout and "total" in res.stdout


def test_duplicate_ids_are_exported_once(tmp_path, built):
    again = msgspec.json.encode(built["math_qa"][0]["result"]) + b"\n"
    out = _write_out(tmp_path, built, {"math_qa": again})
    summary = export(out, tmp_path / "d", ["specforge"], categories=["math_qa"])
    ids = [r["id"] for r in _jsonl(tmp_path / "d" / "math_qa" / "specforge.jsonl")]
    assert len(ids) == len(set(ids)) == PER_CATEGORY - 1
    assert summary["categories"]["math_qa"]["duplicates"] == 1
    assert not (tmp_path / "d" / "proofs").exists()


def test_conversations_with_a_config_carry_the_source_prompt(tmp_path, built):
    out = _write_out(tmp_path, built)
    cfg = _config(tmp_path, out)
    res = CliRunner().invoke(export_cmd, ["--config", str(cfg), "--dest", str(tmp_path / "d"),
                                          "--format", "conversations", "--json"])
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["rows_without_prompt_messages"] == 0
    for cat, rows in built.items():
        got = _jsonl(tmp_path / "d" / cat / "conversations.jsonl")
        kept = [r for r in rows if r["result"].finish_reason == "stop"]
        assert len(got) == len(kept)
        for g, r in zip(got, kept, strict=True):
            assert (g["id"], g["category"], g["finish_reason"]) == (r["result"].id, cat, "stop")
            assert g["conversations"] == [*r["messages"],
                                          {"role": "assistant", "content": r["answer"]}]
            assert g["prompt_text"] == r["prompt_text"]
            assert g["completion_text"] == r["answer"] + "<|im_end|>"


def test_conversations_without_a_config_hold_the_answer_only(tmp_path, built):
    out = _write_out(tmp_path, built)
    res = CliRunner().invoke(export_cmd, [
        "--out", str(out), "--tokenizer", str(QWEN), "--dest", str(tmp_path / "d"),
        "--format", "conversations", "--category", "proofs"])
    assert res.exit_code == 0, res.output
    got = _jsonl(tmp_path / "d" / "proofs" / "conversations.jsonl")
    assert [g["conversations"] for g in got] == [
        [{"role": "assistant", "content": r["answer"]}]
        for r in built["proofs"] if r["result"].finish_reason == "stop"]


def test_a_failed_export_replaces_nothing_and_leaves_no_temp_files(tmp_path, built):
    out = _write_out(tmp_path, built)
    dest = tmp_path / "d"
    export(out, dest, ["specforge"])
    before = (dest / "math_qa" / "specforge.jsonl").read_bytes()

    class Broken:
        def decode(self, ids, skip_special_tokens=False):
            raise RuntimeError("tokenizer broke")

    with pytest.raises(RuntimeError, match="tokenizer broke"):
        export(out, dest, ["specforge", "conversations"], tokenizer=Broken())
    assert (dest / "math_qa" / "specforge.jsonl").read_bytes() == before
    assert not (dest / "math_qa" / "conversations.jsonl").exists()
    leftovers = [p for p in dest.rglob("*") if p.is_file() and ".tmp-" in p.name]
    assert leftovers == []
    assert sorted(os.listdir(dest / "math_qa")) == ["specforge.jsonl"]


def test_nothing_to_export_is_a_clear_error(tmp_path):
    with pytest.raises(ExportError, match="nothing to export"):
        export(tmp_path, tmp_path / "d", ["specforge"])
    res = CliRunner().invoke(export_cmd, ["--out", str(tmp_path / "missing"),
                                          "--dest", str(tmp_path / "d")])
    assert res.exit_code == 1
    assert "no such directory" in res.stderr
    assert "Traceback" not in res.output
    res = CliRunner().invoke(export_cmd, ["--dest", str(tmp_path / "d")])
    assert res.exit_code == 1
    assert "(or --config CONFIG) or --out DIR" in res.stderr
