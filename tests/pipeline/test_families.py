"""Conversations regenerated turn by turn for each model family users train drafters for, end
to end: the family's real tokenizer and chat template (`tests.family_tokenizers`), the
simulator speaking the family's grammar (`--family`), the real producer, workers and writer.

For every family, on agent traces with tools (OpenAI messages with tool calls and results;
ShareGPT function_call / observation): the parsers "auto" picks are the family's; every
turn is parsed (no reply refused); no content keeps a reasoning or tool-call delimiter;
the model's calls were made and their results re-keyed to them in the next prompt; every
row after the first turn says whether its prompt extends the previous turn's ids, and why
not when it does not. Kimi-K2.5 also goes through `tokencap up` with its own code
(`trust_remote_code`).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from producer.readers.index import SourceIndex, read_sample
from producer.render import Renderer
from producer.reply_parser import ReplyParser, reply_parser
from producer.run import load_renderer
from sglang_sim.config import LengthDist
from sglang_sim.testing import SimServer
from testing.harness import RedisServer, started
from tests.conftest import DATASETS, ROOT, write_config
from tests.family_tokenizers import UPSTREAM_SHA256, folder, kimi_with_code, sha256

pytestmark = pytest.mark.slow

CONVERSATIONS = DATASETS / "conversations" / "tokencap_conversations.jsonl"
GLAIVE = DATASETS / "agent" / "glaive_toolcall_en_demo.json"
AGENT_RECORDS = ("chat-3-turns", "agent-weather", "agent-flights-developer")
GLAIVE_WITH_CALLS = 4
SHORT = LengthDist(mean_tokens=30.0, sigma=0.4)
# family -> (tokenizer folder, simulator grammar, parsers auto must pick, extra config lines,
# delimiters no content may keep)
FAMILIES: dict[str, tuple[str, str, tuple[str, str], str, tuple[str, ...]]] = {
    "kimi_k2": ("kimi-k2.5", "kimi_k2", ("kimi_k2", "kimi_k2"), "",
                ("<think>", "</think>", "<|tool_calls_section_begin|>", "<|tool_call_begin|>",
                 "<|im_end|>")),
    "deepseek-r1": ("deepseek-r1", "deepseek-r1", ("deepseek-r1", "deepseekv3"), "",
                    ("<think>", "</think>", "<｜tool▁calls▁begin｜>", "<｜end▁of▁sentence｜>")),
    "deepseekv31": ("deepseek-v3.1", "deepseekv31", ("deepseek-v3", "deepseekv31"),
                    "chat_template_kwargs = { thinking = true }",
                    ("<think>", "</think>", "<｜tool▁call▁begin｜>", "<｜end▁of▁sentence｜>")),
    "deepseekv32": ("deepseek-v3.2", "deepseekv32", ("deepseek-v3", "deepseekv32"),
                    "chat_template_kwargs = { thinking = true }",
                    ("<think>", "</think>", "｜DSML｜", "<｜end▁of▁sentence｜>")),
    "glm45": ("glm-4.5", "glm45", ("glm45", "glm45"), "",
              ("<think>", "</think>", "<tool_call>", "<arg_key>", "<|user|>",
               "<|observation|>")),
    "glm47": ("glm-4.7", "glm47", ("glm45", "glm47"), "",
              ("<think>", "</think>", "<tool_call>", "<arg_key>", "<|user|>",
               "<|observation|>")),
    "gpt-oss": ("gpt-oss-20b", "gpt-oss", ("gpt-oss", "gpt-oss"), "",
                ("<|channel|>", "<|message|>", "<|start|>", "<|end|>", "<|call|>",
                 "<|return|>")),
    "qwen3_coder": ("qwen3-coder", "qwen3_coder", ("none", "qwen3_coder"), "",
                    ("<tool_call>", "<function=", "<parameter=", "<|im_end|>")),
    "llama3": ("llama-3.1-instruct", "llama3", ("none", "llama3"), "",
               ("<|python_tag|>", "<|eot_id|>", "<|eom_id|>", '{"name"')),
}
# templates that never write the tools they are given: the tools are named in the system
# prompt instead, as DeepSeek's own examples do
TOOLS_IN_SYSTEM = {"deepseek-r1", "deepseekv31"}


def _sources(tmp: Path, tools_in_system: bool) -> tuple[Path, Path]:
    records = {r["id"]: r for r in map(json.loads, CONVERSATIONS.read_text().splitlines())}
    agent = [records[k] for k in AGENT_RECORDS]
    glaive = [r for r in json.loads(GLAIVE.read_text())
              if any(t["from"] == "function_call" for t in r["conversations"])]
    glaive = glaive[:GLAIVE_WITH_CALLS]
    if tools_in_system:
        for rec in agent:
            if rec.get("tools"):
                rec["messages"][0]["content"] += "\n\nTools: " + json.dumps(rec["tools"])
        for rec in glaive:
            rec["system"] = "You can call these tools: " + rec["tools"]
    a, g = tmp / "agent.jsonl", tmp / "glaive.json"
    a.write_text("".join(json.dumps(r) + "\n" for r in agent))
    g.write_text(json.dumps(glaive))
    return a, g


def _config(tmp: Path, tokenizer: Path, extra: str, tools_in_system: bool,
            head: str = "") -> Any:
    agent, glaive = _sources(tmp, tools_in_system)
    return write_config(tmp, f"""
run = "fam"
output_dir = "{tmp / 'out'}"
tokenizer = "{tokenizer}"
cap_tokens = "none"
lease_s = 5.0
{head}
{extra}
[[category]]
name = "agent"
source = "{agent}"
turns = "all"
sampling = {{ max_new_tokens = 400, temperature = 0.6 }}
[[category]]
name = "glaive"
source = "{glaive}"
turns = "all"
sampling = {{ max_new_tokens = 400, temperature = 0.6 }}
""")


@pytest.fixture(scope="session")
def built(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("family-tokenizers")


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def run(request, built, tmp_path_factory):
    """One whole run per family on the simulator speaking its grammar."""
    name = request.param
    tok_name, grammar, parsers, extra, delimiters = FAMILIES[name]
    tokenizer = folder(tok_name, built)
    tmp = tmp_path_factory.mktemp(f"family-{name}")
    cfg = _config(tmp, tokenizer, extra, name in TOOLS_IN_SYSTEM)
    server = RedisServer(tmp / "redis").start()
    try:
        with SimServer(time_scale=1000.0, tokenizer=str(tokenizer), family=grammar,
                       default_length=SHORT) as sim:
            with started(cfg, server.url, [sim.url], 3) as pipe:
                status = pipe.run()
                for c in cfg.category:
                    pipe.check_category(status, c.name)
                rows = {c.name: pipe.results(c.name) for c in cfg.category}
                dead = {c.name: pipe.dead(c.name) for c in cfg.category}
    finally:
        server.stop()
    renderer = load_renderer(cfg)
    yield SimpleNamespace(name=name, cfg=cfg, rows=rows, dead=dead, renderer=renderer,
                          replies=reply_parser(cfg, renderer), parsers=parsers,
                          delimiters=delimiters)


def _conversations(run: Any, category: str) -> list[tuple[Any, list[Any], list[dict]]]:
    """(source conversation, its rows in order, the model's assistant messages)."""
    cat = run.cfg.by_name(category)
    kwargs = {**run.cfg.chat_template_kwargs, **cat.chat_template_kwargs} or None
    opened = run.replies.reasoning is not None and run.renderer.opens_reasoning(
        run.replies.reasoning.start, kwargs)
    out = []
    by_conv: dict[str, list[Any]] = {}
    for r in run.rows[category]:
        by_conv.setdefault(r.conversation_id, []).append(r)
    with SourceIndex.build(cat.paths) as index:
        for conv_id, rows in sorted(by_conv.items()):
            rows.sort(key=lambda r: r.turn)
            sample = read_sample(index, rows[0].ordinal, cat.format, cat.turns,
                                 cat.system_prompt, cat.field_map or None, cat.role_map or None)
            generated = run.replies.messages([r.output_ids for r in rows],
                                             sample.conversation.tools, conv_id,
                                             opened=opened)
            out.append((sample.conversation, rows, generated))
    return out


def test_auto_picks_the_familys_parsers(run) -> None:
    assert (run.replies.reasoning_choice.name, run.replies.tool_choice.name) == run.parsers


def test_every_turn_parses_and_no_content_keeps_a_delimiter(run) -> None:
    calls = 0
    for category in run.rows:
        reasons = {d.reason for d in run.dead[category]}
        assert "unparsed_reply" not in reasons, run.dead[category]
        for _conv, _rows, generated in _conversations(run, category):
            for msg in generated:
                calls += len(msg.get("tool_calls") or [])
                for field in ("content", "reasoning_content"):
                    text = msg.get(field) or ""
                    left = [d for d in run.delimiters if d in text]
                    assert not left, (run.name, field, left, text[:200])
    assert calls > 0, run.name  # the model's calls went through the chain


def test_prompts_are_the_template_of_the_regenerated_conversation(run) -> None:
    kwargs = run.cfg.chat_template_kwargs or None
    rekeyed = 0
    for category in run.rows:
        for conv, rows, generated in _conversations(run, category):
            ids = run.replies.result_ids(rows[0].conversation_id)
            for j, row in enumerate(rows):
                messages = conv.prompt(generated[:j], ids)
                expected = run.renderer.render(messages, kwargs, conv.tools)[1]
                assert row.prompt_ids == expected, (run.name, row.id)
                for m in messages:
                    if m["role"] == "tool" and m.get("tool_call_id", "").startswith(
                            ("functions.", "call_")):
                        rekeyed += 1
    assert rekeyed > 0, run.name


def test_every_later_turn_says_whether_it_extends_the_one_before(run) -> None:
    consistent = inconsistent = 0
    for category in run.rows:
        for row in run.rows[category]:
            if row.turn == 1:
                assert row.prefix_consistent is None
                continue
            assert row.prefix_consistent is not None, row.id
            if row.prefix_consistent:
                consistent += 1
            else:
                inconsistent += 1
                assert any("not a prefix of this prompt" in n for n in row.history_notes)
    assert consistent + inconsistent > 0


def test_the_deepseek_v32_template_renders_as_its_encoder(built) -> None:
    # DeepSeek-V3.2 ships a Python encoder instead of a template: tokencap's (written here)
    # gives the prompt its published test case gives, byte for byte
    data = ROOT / "tests" / "fixtures" / "deepseek-v3.2-encoding"
    case = json.loads((data / "test_input.json").read_text())
    r = Renderer(folder("deepseek-v3.2", built))
    text = r.tokenizer.apply_chat_template(case["messages"], tools=case["tools"],
                                           tokenize=False, thinking=True)
    assert text == (data / "test_output.txt").read_text().strip()


def test_every_family_tokenizer_is_the_models_own(built) -> None:
    # rebuilt from the vocabularies' rank files: byte for byte the published tokenizer.json
    for name, digest in UPSTREAM_SHA256.items():
        assert sha256(folder(name, built) / "tokenizer.json") == digest, name


# -- Kimi-K2.5 as a user has it: its own code, through `tokencap up` ------------------------

def _kimi_run(tmp: Path, built: Path, head: str) -> tuple[Path, Any]:
    code = kimi_with_code(tmp / "kimi-k2.5")
    cfg_path = tmp / "run.toml"
    agent, glaive = _sources(tmp, False)
    cfg_path.write_text(f"""
run = "kimi"
output_dir = "{tmp / 'out'}"
tokenizer = "{code}"
cap_tokens = "none"
lease_s = 5.0
{head}
[[category]]
name = "agent"
source = "{agent}"
turns = "all"
sampling = {{ max_new_tokens = 400, temperature = 1.0 }}
[[category]]
name = "glaive"
source = "{glaive}"
turns = "all"
sampling = {{ max_new_tokens = 400, temperature = 1.0 }}
""")
    return cfg_path, code


def _cli(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("REDIS_URL", "SGLANG_URL")}
    return subprocess.run([sys.executable, "-m", "tokencap.cli", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=240)


def test_kimi_with_its_own_code_needs_trust_remote_code_and_then_runs(tmp_path, built) -> None:
    cfg_path, code = _kimi_run(tmp_path, built, "")
    refused = _cli("preview", str(cfg_path), cwd=tmp_path)
    assert refused.returncode == 2 and "trust_remote_code = true" in refused.stderr
    assert "tokenization_kimi.TikTokenTokenizer" in refused.stderr
    assert "Traceback" not in refused.stderr
    cfg_path, code = _kimi_run(tmp_path, built, "trust_remote_code = true")
    shown = _cli("preview", str(cfg_path), cwd=tmp_path)
    assert shown.returncode == 0, shown.stderr[-2000:]
    assert "replies: reasoning parser kimi_k2" in shown.stdout
    up = _cli("up", str(cfg_path), "--sim", "--workers", "3", "--sim-time-scale", "1000",
              cwd=tmp_path)
    try:
        assert up.returncode == 0, up.stdout[-3000:] + up.stderr[-3000:]
    finally:
        _cli("down", cwd=tmp_path)
    renderer = Renderer(code, trust_remote_code=True)
    rows = [json.loads(line) for part in sorted((tmp_path / "out").glob("*/part-*.jsonl"))
            for line in part.read_text().splitlines()]
    assert rows and all(r["model"] == "tokencap-sglang-sim" for r in rows)
    returns = 0
    for r in rows:
        prompt = renderer.decode(r["prompt_ids"])
        # one <|im_end|> per message: the model's own end of turn is not doubled
        assert "<|im_end|><|im_end|>" not in prompt, r["id"]
        assert prompt.count("<|im_end|>") == prompt.count("<|im_middle|>") - 1, r["id"]
        # a replayed tool result names the regenerated call it answers, functions.NAME:IDX
        # (one that answers no call of the model: the id of the source's call, and a note)
        for line in prompt.split("## Return of ")[1:]:
            call_id = line.split("\n", 1)[0]
            assert call_id.startswith("functions.") and ":" in call_id, (r["id"], call_id)
            if f"<|tool_call_begin|>{call_id}<|tool_call_argument_begin|>" in prompt:
                returns += 1
            else:
                assert any("answer no call" in n for n in r["history_notes"]), r["id"]
        if r["finish_reason"] == "stop":  # <|im_end|>, from generation_config.json
            assert r["output_ids"][-1] == 163586 and r["finish"]["matched"] == 163586
    assert returns > 0
    # within an agent step the template keeps the model's text: those turns extend the last
    steps = [r for r in rows if r["turn"] > 1 and "<|tool_calls_section_begin|>" in
             renderer.decode(_previous(rows, r)["output_ids"])]
    assert steps and all(r["prefix_consistent"] for r in steps), [
        (r["id"], r["history_notes"]) for r in steps if not r["prefix_consistent"]]


def _previous(rows: list[dict], row: dict) -> dict:
    return next(r for r in rows if r["conversation_id"] == row["conversation_id"]
                and r["turn"] == row["turn"] - 1)


def test_kimi_refuses_qwens_thinking_switch_naming_its_own(tmp_path, built) -> None:
    cfg_path, _code = _kimi_run(tmp_path, built, "trust_remote_code = true\n"
                                "chat_template_kwargs = { enable_thinking = false }")
    done = _cli("preview", str(cfg_path), cwd=tmp_path)
    assert done.returncode == 2
    assert "$.chat_template_kwargs.enable_thinking" in done.stderr
    assert "never reads `enable_thinking`" in done.stderr and "thinking" in done.stderr


def test_kimis_template_opens_reasoning_and_a_cut_reply_is_all_reasoning(built) -> None:
    r = Renderer(folder("kimi-k2.5", built))
    replies = ReplyParser(r.tokenizer, r.template)
    assert r.opens_reasoning("<think>") and not r.opens_reasoning("<think>", {"thinking": False})
    cut = r.encode("still working it out")  # max_new_tokens reached before </think>
    msg = replies.message(cut, opened=True)
    assert msg == {"role": "assistant", "reasoning_content": "still working it out",
                   "content": ""}
    done = r.encode("plan</think>answer") + [163586]
    # the tokenizer's eos is [EOS]: only generation_config.json says <|im_end|> ends a turn
    assert replies.text(done) == "plan</think>answer<|im_end|>"
    kimi = ReplyParser(r.tokenizer, r.template, end_of_turn=[163586])
    assert kimi.text(done) == "plan</think>answer"
    assert kimi.message(
        done, opened=True) == {"role": "assistant", "reasoning_content": "plan",
                               "content": "answer"}


def test_the_kimi_tokenizer_is_the_models_own(built, tmp_path) -> None:
    ref = json.loads((ROOT / "tests/fixtures/tokenizers/kimi-k2.5/reference_encodings.json")
                     .read_text())
    for tok_dir, remote in ((folder("kimi-k2.5", built), False),
                            (kimi_with_code(tmp_path / "code"), True)):
        r = Renderer(tok_dir, trust_remote_code=remote)
        for e in ref["encodings"]:
            assert r.encode(e["text"]) == e["ids"]
        for c in ref["chat"]:
            if c.get("tools") and not remote:
                continue  # the model's code writes tools as TypeScript; Jinja alone as JSON
            text, ids = r.render(c["messages"], c.get("kwargs") or None, c.get("tools"))
            assert (text, ids) == (c["rendered"], c["ids"])
