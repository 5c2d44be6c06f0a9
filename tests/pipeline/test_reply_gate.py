"""The reply gate end to end: the simulator (Qwen3's grammar) answers some prompts with a
loop, an empty answer or reasoning that never closes; the workers keep each of those out of
training (`rejected-replies.jsonl`, whole, with its reason), and status shows kept and
rejected tokens side by side; a training export holds none of them."""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from pathlib import Path

import pytest

from foundation.gate import check
from producer.render import Renderer
from producer.reply_parser import reply_parser
from sglang_sim.config import FaultConfig, LengthDist
from sglang_sim.testing import SimServer
from testing.harness import started
from tests.conftest import DATASETS, FIXTURES, write_config
from tokencap.export.exporter import export
from tokencap.prepare.audit import audit

pytestmark = pytest.mark.slow

QWEN3 = FIXTURES / "tokenizers" / "qwen3"
GSM8K = DATASETS / "question_answer" / "gsm8k_test_first200.jsonl"
SHORT = LengthDist(mean_tokens=40.0, sigma=0.4)
FAULTS = FaultConfig(reply_rates={"loop": 0.15, "empty": 0.15, "unclosed": 0.15})


def _config(tmp: Path, count_rejected: bool):
    src = tmp / "q.jsonl"
    src.write_text("".join(GSM8K.read_text().splitlines(keepends=True)[:80]))
    return write_config(tmp, f"""
run = "gate"
output_dir = "{tmp / 'out'}"
tokenizer = "{QWEN3}"
cap_tokens = "none"
count_rejected = {str(count_rejected).lower()}
[[category]]
name = "math"
source = "{src}"
sampling = {{ max_new_tokens = 400, temperature = 0.6 }}
""")


@pytest.mark.parametrize("count_rejected", [True, False])
def test_loops_empty_and_unclosed_replies_are_kept_out_of_training(tmp_path, redis_url,
                                                                   count_rejected) -> None:
    cfg = _config(tmp_path, count_rejected)
    with SimServer(time_scale=500.0, tokenizer=str(QWEN3), default_length=SHORT,
                   faults=FAULTS) as sim, started(cfg, redis_url, [sim.url], 3) as pipe:
        status = pipe.run()
        pipe.check_invariants(status)
        injected = sim.stats()["faults_injected"]
    rows, rejected = pipe.results("math"), pipe.rejected("math")
    by_reason = Counter(r.gate for r in rejected)
    # each shape the simulator wrote is caught, with its own reason
    assert by_reason == {"loop": injected["reply_loop"], "empty": injected["reply_empty"],
                         "unclosed_reasoning": injected["reply_unclosed"]}
    assert min(by_reason.values()) > 0
    st = status["categories"]["math"]
    stored = pipe.budget.telemetry.load_config()
    assert stored is not None
    markers = stored.reply_markers
    assert markers is not None and markers.reasoning_end  # the producer set them
    for r in rows:  # every training row passes the gate the workers ran
        assert not r.gate and check(r.output_ids, r.finish_reason, markers, r.prompt_ids) is None
    for r in rejected:  # written whole: its ids, its text, its reason
        assert check(r.output_ids, r.finish_reason, markers, r.prompt_ids) == r.gate
        assert r.completion_tokens == len(r.output_ids) > 0
    # kept and rejected tokens side by side; rejected ones count only when told to
    assert st["kept_tokens"] == sum(r.completion_tokens for r in rows)
    assert st["rejected_tokens"] == {
        reason: sum(r.completion_tokens for r in rejected if r.gate == reason)
        for reason in by_reason}
    assert st["rejected_replies"] == dict(by_reason)
    counted = sum(r.counted_tokens for r in rejected)
    assert counted == (st["waste_tokens"] if count_rejected else 0)
    assert st["used"] == st["kept_tokens"] + counted
    # `tokencap audit` on the files finds the same, with the same code
    report = audit([Path(cfg.output_dir)], reply_parser(stored, Renderer(str(QWEN3))))
    assert report["rows"] == len(rows) + len(rejected)
    assert report["reasons"] == dict(by_reason)
    # a training export holds the rows only
    dest = tmp_path / "export"
    export(Path(cfg.output_dir), dest, ["specforge"], allow_simulated=True)
    exported = [json.loads(x)["id"] for x in
                (dest / "math" / "specforge.jsonl").read_text().splitlines()]
    assert sorted(exported) == sorted(r.id for r in rows)


def test_rows_name_the_manifest_of_what_made_them(tmp_path, redis_url) -> None:
    cfg = _config(tmp_path, True)
    with SimServer(time_scale=500.0, tokenizer=str(QWEN3), default_length=SHORT) as sim, \
            started(cfg, redis_url, [sim.url], 2) as pipe:
        pipe.check_invariants(pipe.run())
    out = Path(cfg.output_dir)
    rows = pipe.committed("math")
    [made_by] = {r.made_by for r in rows}
    run, _, digest = made_by.partition("@")
    manifest = json.loads((out / f"manifest-{digest}.json").read_text())
    assert run == "gate" and manifest["made_by"] == made_by
    files = manifest["tokenizer"]["files"]
    assert files["tokenizer_config.json"] == hashlib.sha256(
        (QWEN3 / "tokenizer_config.json").read_bytes()).hexdigest()
    assert len(manifest["tokenizer"]["chat_template_sha256"]) == 64
    assert manifest["config"]["run"] == "gate" and manifest["tokencap_version"]
    # where a row came from, relative to the output folder (no host path)
    assert all(r.where.startswith("../q.jsonl:") for r in rows)
    summary = export(out, tmp_path / "export", ["specforge"], allow_simulated=True)
    assert summary["manifests"] == [str(tmp_path / "export" / f"manifest-{digest}.json")]


def test_audit_reads_regenerated_conversations_as_specforge_writes_them(tmp_path) -> None:
    from click.testing import CliRunner

    from tokencap.cli.offline import audit_cmd

    def call(name: str) -> dict:
        return {"id": "c", "type": "function",
                "function": {"name": name, "arguments": {"city": "Paris"}}}

    user = {"role": "user", "content": "Weather?"}
    rows = {
        "healthy": [user, {"role": "assistant", "content": "Sunny.",
                           "reasoning_content": "They ask about the weather."}],
        "loop": [user, {"role": "assistant", "content": "It is sunny. " * 100}],
        "empty": [user, {"role": "assistant", "content": " ",
                         "reasoning_content": "Nothing to say."}],
        "tool_mismatch": [user, {"role": "assistant", "content": "",
                                 "tool_calls": [call("get_weather")]},
                          {"role": "tool", "name": "send_email", "content": "sent"},
                          {"role": "assistant", "content": "Done."}],
        "divergence": [user, {"role": "assistant", "content": "",
                              "tool_calls": [call("get_weather"), call("get_weather")]},
                       {"role": "tool", "name": "get_weather", "content": "12C"},
                       {"role": "assistant", "content": "12C."}],
        "orphan": [user, {"role": "tool", "content": "12C"},
                   {"role": "assistant", "content": "12C."}],
        # calls written in the text, as a regeneration keeps the model's raw reply
        "in_text": [user, {"role": "assistant", "content": '<tool_call>\n{"name": '
                           '"get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'},
                    {"role": "tool", "name": "get_weather", "content": "12C"},
                    {"role": "assistant", "content": "12C in Paris."}],
    }
    path = tmp_path / "regenerated.jsonl"
    path.write_text("".join(json.dumps({"id": k, "conversations": v}) + "\n"
                            for k, v in rows.items()))
    res = CliRunner().invoke(audit_cmd, [str(path), "--tokenizer", str(QWEN3), "--json"])
    assert res.exit_code == 1, res.output  # something is flagged
    report = json.loads(res.stdout)
    assert report["rows"] == len(rows)
    assert report["reasons"] == {"loop": 1, "empty": 1, "tool_mismatch": 1,
                                 "tool_divergence": 1, "orphan_tool_result": 1}
    for reason, [example] in report["examples"].items():
        line = list(rows).index(reason if reason in rows else {
            "tool_divergence": "divergence", "orphan_tool_result": "orphan"}[reason]) + 1
        assert example.startswith(f"{path}:{line} ")
