"""`producer/source.py`: one category's records as prompts (`CategorySource`), on a small
JSONL source and the Qwen2.5 fixture tokenizer. A record read by position is the sample
`first_id` names; `where` says file:line relative to the output folder; `locate` finds a
record by its sample id; a prompt the context cannot hold comes back from `prepare` as a
rejected dead letter with its reason; `turns = "all"` reads a record as a conversation."""

from __future__ import annotations

import json
from pathlib import Path

import msgspec
import pytest

from foundation.config import RunConfig
from foundation.modes import template_kwargs
from foundation.wire import Outcome, turn_id
from producer.formats.records import Rejected
from producer.readers.index import sample_id
from producer.render import Renderer
from producer.source import CategorySource, DoesNotFit
from tests.conftest import QWEN, write_config

MAX_NEW = 16
CONTEXT = 256  # tokens: Qwen's default system prompt and a short question fit, 400 words not
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Bye"},
        {"role": "assistant", "content": "Goodbye."}]
# one record a line; line 4 is not JSON, line 6 a conversation of two assistant turns
RECORDS = [
    {"id": "q-1", "messages": [{"role": "user", "content": "What is 2 + 2?"}]},
    {"id": "q-2", "messages": [{"role": "user", "content": "Name a prime."}]},
    {"id": "long", "messages": [{"role": "user", "content": "word " * 400}]},
    "{not json",
    {"id": 7, "messages": [{"role": "user", "content": "Spell cat."}]},
    {"id": "chat", "messages": CHAT},
]
BAD_LINE = 4


@pytest.fixture(scope="module")
def qwen() -> Renderer:
    return Renderer(QWEN)


def source_file(tmp: Path) -> Path:
    path = tmp / "src.jsonl"
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n"
                            for r in RECORDS))
    return path


def config(tmp: Path, turns: str = "first") -> RunConfig:
    source_file(tmp)
    return write_config(tmp, f"""
run = "src"
output_dir = "out"
tokenizer = "{QWEN}"
cap_tokens = 1000
chat_template_kwargs = {{ a = 1, b = 2 }}
[[category]]
name = "chat"
source = "src.jsonl"
turns = "{turns}"
chat_template_kwargs = {{ b = 3 }}
sampling = {{ max_new_tokens = {MAX_NEW} }}
""")


def opened(tmp: Path, qwen: Renderer, turns: str = "first") -> CategorySource:
    cfg = config(tmp, turns)
    return CategorySource.open(cfg, cfg.category[0], qwen, CONTEXT)


def test_a_record_read_by_position_is_the_sample_first_id_names(tmp_path, qwen) -> None:
    with opened(tmp_path, qwen) as src:
        assert len(src) == len(RECORDS)
        assert sorted(src.order) == list(range(len(RECORDS)))  # every record, once
        for pos in (0, 1, 4):
            s = src.read(pos)
            assert (s.ordinal, s.sample_id) == (pos, f"src:{pos + 1}")
            assert src.first_id(s) == s.sample_id == sample_id(src.index, pos)
            assert s.prompt == RECORDS[pos]["messages"]
        assert src.read(0).source_id == "q-1" and src.read(4).source_id == "7"
        with pytest.raises(Rejected) as info:
            src.read(BAD_LINE - 1)
        assert info.value.reason == "invalid_json"


def test_where_names_the_file_and_line_relative_to_the_output_folder(tmp_path, qwen) -> None:
    with opened(tmp_path, qwen) as src:
        assert src.where(2) == "../src.jsonl:3"
        assert src.where(len(RECORDS)) == ""  # past the end: the source shrank
        assert src.row_where(f"{tmp_path}/other/x.jsonl:9") == "../other/x.jsonl:9"
        samples, dead = src.read_many([0, BAD_LINE - 1, 1])
        assert [s.sample_id for s in samples] == ["src:1", "src:2"]
        [letter] = dead
        assert (letter.id, letter.outcome, letter.reason, letter.where) == (
            f"src:{BAD_LINE}", Outcome.REJECTED, "invalid_json", f"../src.jsonl:{BAD_LINE}")


def test_locate_finds_a_sample_by_its_id(tmp_path, qwen) -> None:
    with opened(tmp_path, qwen) as src:
        for pos in range(len(RECORDS)):
            assert src.locate(sample_id(src.index, pos)) == pos
        assert src.locate(f"src:{len(RECORDS) + 1}") is None  # no such line
        assert src.locate("other:1") is None  # no such file
        assert src.locate("q-1") is None  # the record's own id is not its sample id


def test_prepare_feeds_what_fits_and_rejects_a_prompt_too_long(tmp_path, qwen) -> None:
    with opened(tmp_path, qwen) as src:
        short, long = src.read(0), src.read(2)
        fed, rejected = src.prepare([short, long])
        [p] = fed
        _text, ids = qwen.render(RECORDS[0]["messages"], {"a": 1, "b": 3})
        assert (p.sample_id, p.ordinal, p.prompt_ids, p.where, p.source_id) == (
            "src:1", 0, ids, "../src.jsonl:1", "q-1")
        assert p.sampling == msgspec.to_builtins(src.cat.sampling)
        assert p.sampling["max_new_tokens"] == MAX_NEW
        [letter] = rejected
        assert (letter.id, letter.outcome, letter.reason, letter.where) == (
            "src:3", Outcome.REJECTED, "prompt_too_long", "../src.jsonl:3")
        assert f"engine context of {CONTEXT} tokens" in letter.message
        # `prompt` checks one sample the same way
        assert src.prompt(short).ids == ids
        with pytest.raises(DoesNotFit) as info:
            src.prompt(long)
        assert info.value.reason == "prompt_too_long"


def test_fit_and_the_text_guard_before_tokenizing(tmp_path, qwen) -> None:
    with opened(tmp_path, qwen) as src:
        assert src.fit([1] * (CONTEXT - MAX_NEW)) is None
        over = src.fit([1] * (CONTEXT - MAX_NEW + 1))
        assert over is not None and over.reason == "prompt_too_long"
        empty = src.fit([])
        assert empty is not None and empty.reason == "empty_prompt"
        # text that no tokenizer could fit in the context is refused before tokenizing
        huge = [{"role": "user", "content": "x" * (src.limit_chars + 1)}]
        [out] = src.render([huge], [None])
        assert isinstance(out, DoesNotFit) and out.reason == "prompt_too_long"
        assert f"over {CONTEXT * 32} characters" in str(out)


def test_template_kwargs_are_the_categorys_over_the_runs(tmp_path, qwen) -> None:
    with opened(tmp_path, qwen) as src:
        assert template_kwargs(src.cfg, src.cat, None) == {"a": 1, "b": 3} == src.kwargs


def test_turns_all_reads_a_conversation_and_feeds_its_first_turn(tmp_path, qwen) -> None:
    with opened(tmp_path, qwen, turns="all") as src:
        s = src.read(5)
        conv = s.conversation
        assert conv is not None and conv.turns == 2
        assert s.prompt == CHAT[:2]  # turn 1: the source up to the first assistant turn
        assert src.first_id(s) == turn_id("src:6", 1) != s.sample_id
        fed, rejected = src.prepare([s])
        assert rejected == []
        [p] = fed
        assert (p.sample_id, p.conversation_id, p.turn, p.turns_total) == (
            turn_id("src:6", 1), "src:6", 1, 2)
        # a record that cannot be read is rejected as its conversation's turn 1
        _, [letter] = src.read_many([BAD_LINE - 1])
        assert (letter.id, letter.conversation_id, letter.turn) == (
            turn_id(f"src:{BAD_LINE}", 1), f"src:{BAD_LINE}", 1)
