"""Conversations regenerated turn by turn (turns = "all") through the real pipeline: the
simulator answers in text (words, reasoning, tool calls in Qwen's syntax), the producer
chains each written turn into the next prompt, the files keep one row per turn.

Checked against the templates themselves: turn j's prompt ids are exactly
``apply_chat_template`` of the source with the model's own turns 1..j-1 as assistant
messages (Qwen2.5: no reasoning; Qwen3: past reasoning dropped, ``enable_thinking``
honoured); every record is accounted for; the exports give one row per turn and one
conversation per conversation."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from foundation.config import RunConfig
from foundation.errors import ConfigError
from foundation.outputs import category_dir
from foundation.wire import split_turn_id, turn_id
from producer.readers.index import SourceIndex, read_sample, sample_id
from producer.render import Renderer
from producer.reply_parser import ReplyParser
from producer.run import load_renderer
from sglang_sim.config import LengthDist
from sglang_sim.testing import SimServer
from testing.harness import RedisServer, final_marks, started
from tests.conftest import DATASETS, QWEN, write_config
from tests.helpers import by_conversation
from tokencap.export.conversations import SourceMessages
from tokencap.export.exporter import export

pytestmark = pytest.mark.slow

CONVERSATIONS = DATASETS / "conversations" / "tokencap_conversations.jsonl"
GLAIVE = DATASETS / "agent" / "glaive_toolcall_en_demo.json"
TAU = DATASETS / "agent" / "tau_bench_gpt4o_airline_traj.jsonl"
TOKENIZERS = {"qwen2.5": QWEN, "qwen3": QWEN.parent / "qwen3"}
GLAIVE_RECORDS = 24
SHORT = LengthDist(mean_tokens=40.0, sigma=0.5)


def run_config(tmp: Path, tokenizer: Path) -> RunConfig:
    glaive = tmp / "glaive.json"
    glaive.write_text(json.dumps(json.loads(GLAIVE.read_text())[:GLAIVE_RECORDS]))
    tau = tmp / "tau.jsonl"
    tau.write_text("".join(TAU.read_text().splitlines(keepends=True)[:2]))
    return write_config(tmp, f"""
run = "turns"
output_dir = "{tmp / 'out'}"
tokenizer = "{tokenizer}"
cap_tokens = "none"
lease_s = 5.0
[[category]]
name = "conv"
source = "{CONVERSATIONS}"
turns = "all"
role_map = {{ customer = "user", agent = "assistant" }}
sampling = {{ max_new_tokens = 256 }}
[[category]]
name = "glaive"
source = "{glaive}"
turns = "all"
sampling = {{ max_new_tokens = 256 }}
[[category]]
name = "tau"
source = "{tau}"
turns = "all"
field_map = {{ messages = "traj" }}
sampling = {{ max_new_tokens = 256 }}
""" + ("" if "qwen3" not in str(tokenizer) else f"""
[[category]]
name = "nothink"
source = "{CONVERSATIONS}"
turns = "all"
role_map = {{ customer = "user", agent = "assistant" }}
chat_template_kwargs = {{ enable_thinking = false }}
sampling = {{ max_new_tokens = 256 }}
"""))


@pytest.fixture(scope="module", params=sorted(TOKENIZERS))
def done(request, tmp_path_factory):
    """One whole run per tokenizer, the simulator answering with its vocabulary."""
    tmp = tmp_path_factory.mktemp(f"turns-{request.param}")
    tokenizer = TOKENIZERS[request.param]
    cfg = run_config(tmp, tokenizer)
    server = RedisServer(tmp / "redis").start()
    try:
        with SimServer(time_scale=400.0, tokenizer=str(tokenizer), default_length=SHORT) as sim, \
                SimServer(time_scale=400.0, tokenizer=str(tokenizer),
                          default_length=SHORT) as sim2:  # two engines: affinity matters
            with started(cfg, server.url, [sim.url, sim2.url], 4) as pipe:
                status = pipe.run()
                summaries = {c.name: pipe.check_category(status, c.name) for c in cfg.category}
                rows = {c.name: pipe.results(c.name) for c in cfg.category}
                committed = {c.name: pipe.committed(c.name) for c in cfg.category}
                dead = {c.name: pipe.dead(c.name) for c in cfg.category}
    finally:
        server.stop()
    renderer = Renderer(tokenizer)
    yield SimpleNamespace(name=request.param, cfg=cfg, status=status, rows=rows, dead=dead,
                          committed=committed,
                          renderer=renderer, summaries=summaries, tmp=tmp,
                          replies=ReplyParser(renderer.tokenizer, renderer.template))


def source_of(cfg: RunConfig, name: str):
    cat = cfg.by_name(name)
    return cat, SourceIndex.build(cat.paths)


def test_each_turn_goes_to_the_engine_of_the_turn_before_and_finds_it_cached(done) -> None:
    later = 0
    for name, rows in done.rows.items():
        for conv in by_conversation(rows).values():
            for before, turn in zip(conv, conv[1:], strict=False):
                assert turn.engine == before.engine, (name, turn.id)
                if turn.prefix_consistent:
                    later += 1
                    shared = len(before.prompt_ids) + len(before.output_ids)
                    assert turn.reusable_tokens == shared, turn.id
                    # the engine's prefix cache still held the turn before: all of it but
                    # its last token, whose KV an engine never computes
                    assert turn.cached_tokens is not None and turn.cached_tokens >= shared - 1
        st = done.status["categories"][name]
        committed = done.committed[name]
        assert st["reusable_tokens"] == sum(r.reusable_tokens or 0 for r in committed)
        assert st["cached_tokens"] == sum(r.cached_tokens or 0 for r in committed)
    # (conversations whose tool calls diverge from the source's stop: fewer later turns)
    assert later > 5
    assert len({r.engine for rows in done.rows.values() for r in rows}) == 2


def test_every_record_is_accounted_for(done) -> None:
    for cat_cfg in done.cfg.category:
        name = cat_cfg.name
        st = done.status["categories"][name]
        assert st["state"] == "exhausted" and st["cap"] is None, (name, st)
        convs = by_conversation(done.rows[name])
        letters = {d.id: d for d in done.dead[name]}
        cat, index = source_of(done.cfg, name)
        with index:
            ids = [sample_id(index, i) for i in range(len(index))]
        for sid in ids:
            if sid in convs:  # generated: complete, or cut with a reason on file
                turns = convs[sid]
                if turns[-1].turn < turns[-1].turns_total:
                    why = letters[turn_id(sid, turns[-1].turn + 1)]
                    assert why.outcome in ("rejected", "dead", "stopped") and why.reason, why
            else:  # rejected whole, with the reason and where
                why = letters[turn_id(sid, 1)]
                assert why.outcome == "rejected" and why.reason and why.where, why
        assert len(done.committed[name]) == st["samples"]
    reasons = {d.reason for d in done.dead["conv"]}
    assert reasons == {"unknown_role", "invalid_json", "no_user_turn"}
    # every conversation of every category ends complete here: nothing cut
    assert all("complete), no gap" in s for s in done.summaries.values())


def test_turn_prompts_are_the_template_of_the_regenerated_conversation(done) -> None:
    checked = tool_turns = 0
    names = [c.name for c in done.cfg.category]
    for name in names:
        cat, index = source_of(done.cfg, name)
        kwargs = {**done.cfg.chat_template_kwargs, **cat.chat_template_kwargs} or None
        with index:
            for conv_id, turns in by_conversation(done.rows[name]).items():
                sample = read_sample(index, turns[0].ordinal, cat.format, cat.turns,
                                     cat.system_prompt, cat.field_map or None,
                                     cat.role_map or None)
                assert sample.sample_id == conv_id and sample.conversation is not None
                conv = sample.conversation
                for j, row in enumerate(turns):
                    generated = done.replies.messages([r.output_ids for r in turns[:j]],
                                                      conv.tools, conv_id)
                    expected = done.renderer.render(conv.prompt(generated), kwargs,
                                                    conv.tools)[1]
                    assert row.prompt_ids == expected, (name, row.id)
                    tool_turns += any("tool_calls" in m for m in generated[-1:])
                    checked += 1
    assert checked == sum(len(done.rows[n]) for n in names)
    assert tool_turns > 0  # the simulator's tool calls went through the chain


def test_the_next_prompt_holds_the_generated_turn_as_the_template_renders_it(done) -> None:
    decode = done.renderer.decode
    chats = 0
    for conv_id, turns in by_conversation(done.rows["conv"]).items():
        if "<tools>" in decode(turns[0].prompt_ids):
            continue  # agent traces: checked token for token above
        chats += 1
        for row, nxt in zip(turns, turns[1:], strict=False):
            text = done.replies.text(row.output_ids)
            prompt = decode(nxt.prompt_ids)
            msg = done.replies.message(row.output_ids)
            if done.name == "qwen2.5":
                # no reasoning: the whole generated text is the assistant message
                assert f"<|im_start|>assistant\n{text}<|im_end|>" in prompt, conv_id
            else:
                reasoning = msg.get("reasoning_content")
                assert reasoning, row.id  # the simulator thinks with Qwen3's vocabulary
                assert msg["content"].strip() in prompt
                # a user turn came after it: Qwen3's template dropped its reasoning
                assert reasoning.strip() not in prompt, row.id
    assert chats == 3


def test_enable_thinking_false_is_honoured(done) -> None:
    if done.name != "qwen3":
        # Qwen2.5's template never reads enable_thinking: a config that sets it is refused
        bad = write_config(done.tmp, f"""
run = "x"
output_dir = "{done.tmp / 'x'}"
tokenizer = "{QWEN}"
chat_template_kwargs = {{ enable_thinking = false }}
[[category]]
name = "c"
source = "{CONVERSATIONS}"
sampling = {{ max_new_tokens = 8, temperature = 0.5 }}
""", "bad.toml")
        with pytest.raises(ConfigError, match=r"\$\.chat_template_kwargs\.enable_thinking"):
            load_renderer(bad)
        return
    for row in done.rows["nothink"]:
        assert done.renderer.decode(row.prompt_ids).endswith(
            "<|im_start|>assistant\n<think>\n\n</think>\n\n")
        assert "<think>" not in done.renderer.decode(row.output_ids)
    think = [r for r in done.rows["conv"] if "<think>" in done.renderer.decode(r.output_ids)]
    assert len(think) == len(done.rows["conv"])


def test_exports_give_a_row_per_turn_and_one_per_conversation(done) -> None:
    dest = done.tmp / "export"
    messages = SourceMessages(done.cfg)
    try:
        summary = export(Path(done.cfg.output_dir), dest, ["specforge", "conversations"],
                         keep_truncated=True, tokenizer=done.renderer.tokenizer,
                         messages_for=messages, allow_simulated=True)
    finally:
        messages.close()
    for name in ("conv", "glaive"):
        rows = {r.id: r for r in done.rows[name]}
        sf = [json.loads(x) for x in (dest / name / "specforge.jsonl").read_text().splitlines()]
        assert sorted(x["id"] for x in sf) == sorted(rows)
        for x in sf:
            r = rows[x["id"]]
            assert x["input_ids"] == r.prompt_ids + r.output_ids
            assert x["loss_mask"] == [0] * len(r.prompt_ids) + [1] * len(r.output_ids)
        convs = [json.loads(x) for x in
                 (dest / name / "conversations.jsonl").read_text().splitlines()]
        turns = by_conversation(done.rows[name])
        assert sorted(c["id"] for c in convs) == sorted(turns)
        assert summary["categories"][name]["conversations"] == len(turns)
        stopped = {d.conversation_id: d for d in done.dead[name] if d.outcome == "stopped"}
        for c in convs:
            mine = turns[c["id"]]
            assert c["turns"] == len(mine)
            if c["complete"]:
                assert c["stopped"] is None and c["turns"] == c["turns_total"]
            else:  # its tool calls diverged from the source's: said, with the turn not fed
                why = stopped[c["id"]]
                assert c["stopped"] == f"stopped:{why.reason}" and why.turn == len(mine) + 1
            tools = c["tools"]
            assistant = [m for m in c["conversations"] if m["role"] == "assistant"]
            assert assistant == done.replies.messages([r.output_ids for r in mine], tools,
                                                      c["id"])
            if done.name == "qwen3" and name == "conv":
                assert all(m.get("reasoning_content") for m in assistant)


@pytest.fixture
def sim_qwen():
    with SimServer(time_scale=400.0, tokenizer=str(QWEN), default_length=SHORT) as sim:
        yield sim


def capped_config(tmp: Path, chat_cap: int | str, qa_cap: int | str) -> RunConfig:
    glaive = tmp / "glaive.json"
    glaive.write_text(json.dumps(json.loads(GLAIVE.read_text())[:70]))
    return write_config(tmp, f"""
run = "caps"
output_dir = "{tmp / 'out'}"
tokenizer = "{QWEN}"
lease_s = 5.0
[[category]]
name = "chat"
source = "{glaive}"
turns = "all"
cap_tokens = {json.dumps(chat_cap)}
sampling = {{ max_new_tokens = 128 }}
[[category]]
name = "qa"
source = "{DATASETS / 'question_answer' / 'gsm8k_test_first200.jsonl'}"
cap_tokens = {json.dumps(qa_cap)}
sampling = {{ max_new_tokens = 128 }}
""", name=f"caps-{chat_cap}.toml")


def test_a_raised_cap_sends_what_the_closed_category_held(tmp_path, redis_url, sim_qwen) -> None:
    # Given two categories closed at small caps, holding samples and conversation turns back
    cfg = capped_config(tmp_path, 1500, 1000)
    with started(cfg, redis_url, [sim_qwen.url], 6) as pipe:
        status = pipe.run()
        pipe.check_invariants(status)
        held = {name: {sid for sid, _ in pipe.budget.feeding.held(name)} | {
            d.id for d in pipe.dead(name) if d.outcome == "cut"} for name in ("chat", "qa")}
        for name in ("chat", "qa"):
            st = status["categories"][name]
            assert st["state"] == "closed" and st["skipped"] > 0, (name, st)
        assert final_marks(pipe.budget, "qa").keys().isdisjoint(held["qa"])
        cut = [d for d in pipe.dead("chat") if d.outcome == "cut"]
        assert cut and all(d.reason == "cap" and d.turn >= 2 for d in cut)  # why they stopped
        assert all(d.where and d.turns_total >= d.turn for d in cut)
        # When both caps are raised (by more than all that is held can use: each sample adds
        # at most max_new_tokens) and the producer runs again
        for name, cap in (("chat", 4500), ("qa", 4000)):
            old = cfg.cap_for(cfg.by_name(name))
            assert pipe.budget.operating.set_cap(name, cap) == (False, old)
        status = pipe.run()
        # Then what they held was sent, and each closed again at its new cap
        pipe.check_invariants(status)
        for name, cap in (("chat", 4500), ("qa", 4000)):
            st = status["categories"][name]
            assert st["state"] == "closed" and st["used"] >= cap, (name, st)
        qa_rows = {r.id for r in pipe.results("qa")}
        assert held["qa"] and held["qa"] <= qa_rows, "held samples were not sent"
        chat_rows = {r.id for r in pipe.results("chat")}
        resumed = [d.id for d in cut if d.id in chat_rows]
        assert resumed, "no held conversation went on after the cap was raised"
        assert all(split_turn_id(sid) is not None for sid in resumed)


def test_an_uncapped_category_takes_its_whole_source(tmp_path, redis_url, sim_qwen) -> None:
    cfg = capped_config(tmp_path, "none", "none")
    with started(cfg, redis_url, [sim_qwen.url], 6) as pipe:
        status = pipe.run()
        pipe.check_invariants(status)
    qa = status["categories"]["qa"]
    assert (qa["state"], qa["cap"], qa["samples"], qa["rejected"]) == ("exhausted", None, 200, 0)
    chat = status["categories"]["chat"]
    assert chat["state"] == "exhausted" and chat["cap"] is None
    with SourceIndex.build([tmp_path / "glaive.json"]) as index:
        records = len(index)
    convs = {r.conversation_id for r in pipe.results("chat")}
    rejected = {d.conversation_id for d in pipe.dead("chat")}
    assert len(convs) + len(rejected - convs) == records
    assert chat["samples"] == len(pipe.results("chat"))
    files = list(category_dir(Path(cfg.output_dir), "chat").glob("part-*.jsonl"))
    assert files


def test_a_conversation_that_outgrows_the_context_stops_with_the_reason(
        tmp_path, redis_url, sim_qwen) -> None:
    # the multi-turn chats of the FastChat fixture, in a context too small for their ends
    dummy = json.loads((DATASETS / "sharegpt" / "fastchat_dummy_conversation.json").read_text())
    multi = {r["conversations"][0]["value"]: r for r in dummy if len(r["conversations"]) >= 6}
    src = tmp_path / "long.json"
    src.write_text(json.dumps(list(multi.values())[:20]))
    cfg = write_config(tmp_path, f"""
run = "ctx"
output_dir = "{tmp_path / 'out'}"
tokenizer = "{QWEN}"
context_length = 170
[[category]]
name = "chat"
source = "{src}"
turns = "all"
cap_tokens = "none"
sampling = {{ max_new_tokens = 64 }}
""")
    with started(cfg, redis_url, [sim_qwen.url], 4) as pipe:
        status = pipe.run()
        pipe.check_invariants(status)
        rows, letters = pipe.results("chat"), pipe.dead("chat")
    too_long = [d for d in letters if d.reason == "prompt_too_long"]
    assert too_long and all(d.turn > 1 and d.conversation_id for d in too_long)
    for d in too_long:  # the turns before it are kept
        kept = sorted(r.turn for r in rows if r.conversation_id == d.conversation_id)
        assert kept == list(range(1, d.turn))
        assert all(len(r.prompt_ids) + 64 <= 170 for r in rows)
    dest = tmp_path / "export"
    export(Path(cfg.output_dir), dest, ["conversations"], keep_truncated=True,
           tokenizer=Renderer(QWEN).tokenizer, allow_simulated=True)
    convs = {c["id"]: c for c in map(json.loads, (dest / "chat" / "conversations.jsonl")
                                     .read_text().splitlines())}
    for d in too_long:
        c = convs[d.conversation_id]
        assert (c["complete"], c["stopped"], c["turns"]) == (
            False, "rejected:prompt_too_long", d.turn - 1)
