"""Modes through the real pipeline (Qwen3's template, the simulator answering in text): a
category of two modes at 0.7/0.3 by conversation, stopped midway (workers SIGKILLed, writer
stopped) and restarted; and the same category with `share = "tokens"`, each mode a budget.

Checked: every turn of a conversation in one mode, the one its id draws, before the kill and
after the resume alike; the share of conversations within 4 sigma of 0.7; each row's prompt
ids exactly `apply_chat_template` with its mode's kwargs, its sampling the mode's; with
`share = "tokens"` each mode closes at its share of the cap, within the category's overshoot
bound, with exactly-once accounting."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from foundation import modes
from foundation.config import RunConfig
from sglang_sim.config import LengthDist
from sglang_sim.testing import SimServer
from testing.harness import Pipeline, started
from tests.conftest import QWEN, write_config
from tests.helpers import by_conversation

pytestmark = pytest.mark.slow

QWEN3 = QWEN.parent / "qwen3"
CONVERSATIONS = 300
SHORT = LengthDist(mean_tokens=40.0, sigma=0.5)
MODES = ('modes = [{ name = "think", weight = 0.7, chat_template_kwargs = { enable_thinking = '
         'true } }, { name = "fast", weight = 0.3, chat_template_kwargs = { enable_thinking = '
         'false }, sampling = { temperature = 0.6, max_new_tokens = 96 } }]')


def source(tmp: Path) -> Path:
    path = tmp / "chats.jsonl"
    path.write_text("".join(json.dumps({"messages": [
        {"role": "user", "content": f"Question {i}: how many legs have {i} spiders?"},
        {"role": "assistant", "content": "Some."},
        {"role": "user", "content": f"And {i + 1} spiders?"}]}) + "\n"
        for i in range(CONVERSATIONS)))
    return path


def config(tmp: Path, share: str = "", cap: str = '"none"') -> RunConfig:
    return write_config(tmp, f"""
run = "modes"
output_dir = "{tmp / 'out'}"
tokenizer = "{QWEN3}"
cap_tokens = {cap}
lease_s = 2.0
seed = 11
[[category]]
name = "chat"
source = "{source(tmp)}"
turns = "all"
sampling = {{ max_new_tokens = 128, temperature = 0.9 }}
{MODES}
{share}
""")


def test_two_modes_by_conversation_survive_a_kill_and_resume(tmp_path, redis_url) -> None:
    cfg = config(tmp_path)
    cat = cfg.by_name("chat")
    with SimServer(time_scale=400.0, tokenizer=str(QWEN3), default_length=SHORT) as sim:
        # Given a run stopped once a third of its conversations have a turn written, at a
        # moment a conversation waits for its next turn: its first turn is on disk and only
        # the producer feeds the second, so that one is sent after the resume. (Stopped on the
        # count alone, the workers could drain the queue before the kill and leave every
        # conversation begun whole.)
        first = Pipeline(cfg, redis_url, [sim.url])
        first.build()
        first.start_writer()
        first.start_workers(6)

        def midway() -> bool:
            st = first.status()["chat"]
            return st["samples"] >= CONVERSATIONS // 3 and st["followups"] > 0

        first.run(should_stop=midway)
        first.kill_workers()  # SIGKILL: requests in flight are lost mid-way
        first.stop_writer()
        before = {r.id: r.mode for r in first.committed("chat")}
        # When everything is started again
        with started(cfg, redis_url, [sim.url], 6) as second:
            status = second.run()
    second.check_invariants(status)
    rows = second.committed("chat")
    convs = by_conversation(rows)
    # Then every turn of a conversation is in one mode, the one its id draws
    spanning = 0
    for conv_id, turns in convs.items():
        drawn = modes.draw(cfg, cat, conv_id)
        assert drawn is not None
        assert {t.mode for t in turns} == {drawn.name}, conv_id
        # the rows written before the kill kept their mode, and the turns after it agree
        assert all(before.get(t.id, drawn.name) == drawn.name for t in turns)
        spanning += any(t.id in before for t in turns) and any(t.id not in before
                                                               for t in turns)
    assert len([r for r in rows if r.id in before]) == len(before) > 0
    assert spanning > 0  # conversations begun before the kill and finished after it
    # and the share of conversations is within 4 sigma of 0.7
    n = len(convs)
    think = sum(1 for turns in convs.values() if turns[0].mode == "think")
    sigma = math.sqrt(0.7 * 0.3 / n)
    assert n >= CONVERSATIONS - 5 and abs(think / n - 0.7) < 4 * sigma, (think, n)
    print(f"share think {think}/{n} = {think / n:.4f}, sigma {sigma:.4f}, "
          f"{abs(think / n - 0.7) / sigma:.2f} sigma from 0.7")
    # and each row says what it was made with: its mode's kwargs and sampling, the prompt
    # ids exactly the template's with those kwargs
    tok = second.producer.renderer.tokenizer  # type: ignore[union-attr]
    for r in rows:
        thinking = r.mode == "think"
        assert r.chat_template_kwargs == {"enable_thinking": thinking}
        assert r.sampling["temperature"] == (0.9 if thinking else 0.6)
        assert r.sampling["max_new_tokens"] == (128 if thinking else 96)
        if r.turn == 1:
            i = int(r.where.rsplit(":", 1)[1]) - 1
            ids = tok.apply_chat_template(
                [{"role": "user", "content": f"Question {i}: how many legs have {i} spiders?"}],
                add_generation_prompt=True, tokenize=True, return_dict=False,
                enable_thinking=thinking)
            assert r.prompt_ids == list(ids), r.id


def test_share_tokens_closes_each_mode_at_its_share_of_the_cap(tmp_path, redis_url) -> None:
    cfg = config(tmp_path, share='share = "tokens"', cap="6000")
    assert [c.name for c in cfg.category] == ["chat.think", "chat.fast"]
    with SimServer(time_scale=400.0, tokenizer=str(QWEN3), default_length=SHORT) as sim:
        with started(cfg, redis_url, [sim.url], 6) as pipe:
            status = pipe.run()
    pipe.check_invariants(status)
    plain = config(tmp_path)
    for cat, share in zip(cfg.category, (0.7, 0.3), strict=True):
        st = status["categories"][cat.name]
        cap = cfg.cap_for(cat)
        assert cap == round(6000 * share)
        # Then each mode closes exactly once at its share of the cap, its overshoot within
        # the category's bound (one sample's most)
        assert st["state"] == "closed" and st["used"] >= cap, st
        assert 0 <= st["overshoot"] < modes.sampling(cat, modes.by_name(cat, cat.only_mode or
                                                                        "")).max_new_tokens
        print(f"{cat.name}: cap {cap}, used {st['used']}, overshoot {st['overshoot']}")
        rows = pipe.committed(cat.name)
        assert rows and {r.mode for r in rows} == {cat.only_mode}
        # and it was fed only the conversations drawn to its mode
        for r in rows:
            assert r.conversation_id is not None
            drawn = modes.draw(plain, plain.by_name("chat"), r.conversation_id)
            assert drawn is not None and drawn.name == cat.only_mode
