"""`producer/replay.py`: a conversation's history with the model's own earlier turns. Each
generated turn's output ids are read back into an assistant message by the run's parsers
(reasoning and tool calls split, the calls given the ids a chat server gives them), put in
place of the source's turn, and the source's tool results re-keyed to the model's calls; a
whole regenerated conversation (the export's transcript) keeps a last turn that does not parse
as its text. Without the run's config, the tokenizer's template picks the parsers; whether a
turn starts inside a reasoning block follows the category's chat-template kwargs."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import msgspec
import pytest

from foundation.config import RunConfig
from producer.formats.conversation import Conversation
from producer.formats.turns import to_conversation
from producer.render import Renderer
from producer.replay import Replay
from tests.conftest import QWEN, write_config
from tests.helpers import CONVERSATIONS, conversation_records

QWEN3 = QWEN.parent / "qwen3"
# Qwen3's generation prompt, opening the reasoning block unless thinking is off (as
# Qwen3-Thinking-2507's and DeepSeek-V3.1's templates open it)
QWEN3_CLOSED = ("    {%- if enable_thinking is defined and enable_thinking is false %}\n"
                "        {{- '<think>\\n\\n</think>\\n\\n' }}\n    {%- endif %}")
OPENS_THINKING = ("    {%- if enable_thinking is defined and enable_thinking is false %}\n"
                  "        {{- '<think>\\n\\n</think>\\n\\n' }}\n    {%- else %}\n"
                  "        {{- '<think>\\n' }}\n    {%- endif %}")


@pytest.fixture(scope="module")
def qwen3() -> Renderer:
    return Renderer(QWEN3)


def config(tmp: Path, tokenizer: Path = QWEN3, head: str = "",
           categories: tuple[tuple[str, str], ...] = (("chat", ""),)) -> RunConfig:
    """A run of `categories` (name, extra lines), each every turn of the conversations
    fixture."""
    cats = "".join(f"""
[[category]]
name = "{name}"
{extra}
source = "{CONVERSATIONS}"
turns = "all"
sampling = {{ max_new_tokens = 64 }}
""" for name, extra in categories)
    return write_config(tmp, f"""
run = "replay"
output_dir = "{tmp / 'out'}"
tokenizer = "{tokenizer}"
{head}
{cats}""")


def conversation(record_id: str) -> Conversation:
    conv = to_conversation(conversation_records()[record_id], "auto", "all")
    assert not isinstance(conv, list)
    return conv


def reply(renderer: Renderer, text: str) -> list[int]:
    """A generated turn's output ids: its text, then the end of turn."""
    return renderer.encode(text) + [renderer.eos_token_id]  # type: ignore[list-item]


def test_the_models_turns_take_the_place_of_the_sources_in_the_history(
        tmp_path: Path, qwen3: Renderer) -> None:
    replay = Replay(config(tmp_path), qwen3)
    conv = conversation("chat-3-turns")
    source = conv.messages
    outputs = [reply(qwen3, "<think>\nPrimes first.\n</think>\n\nA prime has two divisors."),
               reply(qwen3, "No, 7 x 13.")]
    # Given the model's first two turns read back with the run's parsers (Qwen3's)
    generated = replay.turns(outputs, conv.tools, "c1", [], opened=False)
    assert replay.parser.reasoning_choice.name == "qwen3"
    assert generated == [
        {"role": "assistant", "reasoning_content": "\nPrimes first.\n",
         "content": "\n\nA prime has two divisors."},
        {"role": "assistant", "content": "No, 7 x 13."}]
    # Then turn 3's history holds them in place of the source's answers
    assert replay.history(conv, generated, "c1") == [
        source[0], source[1], generated[0], source[3], generated[1], source[5]]
    assert replay.history(conv, generated[:1], "c1") == [
        source[0], source[1], generated[0], source[3]]


def test_the_sources_tool_result_answers_the_models_call_by_its_id(
        tmp_path: Path, qwen3: Renderer) -> None:
    replay = Replay(config(tmp_path), qwen3)
    conv = conversation("agent-weather")
    out = reply(qwen3, '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Lisbon"}}'
                       '\n</tool_call>')
    (turn,) = replay.turns([out], conv.tools, "w", [], opened=False)
    call_id = "call_" + hashlib.sha256(b"w#t1#0").hexdigest()[:24]  # the same every time
    assert turn == {"role": "assistant", "content": "", "tool_calls": [
        {"id": call_id, "type": "function",
         "function": {"name": "get_weather", "arguments": {"city": "Lisbon"}}}]}
    history = replay.history(conv, [turn], "w")
    assert history[2] == turn
    assert history[3] == {**conv.messages[3], "tool_call_id": call_id}


def test_a_transcript_keeps_a_last_turn_that_does_not_parse_as_its_text(
        tmp_path: Path, qwen3: Renderer) -> None:
    replay = Replay(config(tmp_path), qwen3)
    conv = conversation("agent-weather")
    good = reply(qwen3, '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Lisbon"}}'
                        '\n</tool_call>')
    cut = qwen3.encode('Let me look.<tool_call>\n{"name": "get_weather", "argu')
    whole = replay.transcript(conv, [good, cut], "w", [], opened=False)
    (first,) = replay.turns([good], conv.tools, "w", [], opened=False)
    # the history of its last turn (the model's call, the source's result re-keyed to it)...
    assert whole[:-1] == replay.history(conv, [first], "w")
    # ... and that turn as generated, marked
    last = whole[-1]
    assert last["role"] == "assistant" and last["unparsed"].startswith("turn 2: ")
    assert last["content"] == 'Let me look.<tool_call>\n{"name": "get_weather", "argu'
    # without the source conversation (nor its tools: a call is text) the model's turns
    # alone, and past the conversation's end too
    alone = replay.transcript(None, [good], "w", [], opened=False)
    assert alone == [{"role": "assistant", "content": qwen3.decode(good[:-1])}]
    longer = [reply(qwen3, "a")] * (conv.turns + 1)
    assert replay.transcript(conv, longer, "w", [], opened=False) == replay.turns(
        longer, conv.tools, "w", [], opened=False)


def test_without_a_renderer_the_tokenizers_template_or_the_config_names_the_parsers(
        tmp_path: Path, qwen3: Renderer) -> None:
    cfg = config(tmp_path)
    out = [reply(qwen3, "<think>\nhm\n</think>\n\nYes.")]
    with_run = Replay(cfg, qwen3).turns(out, None, "c", [], opened=False)
    # an export without the run's config: the template's parsers, chosen "auto"
    export = Replay(None, tokenizer=qwen3.tokenizer)
    assert export.turns(out, None, "c", [], opened=False) == with_run
    assert export.opened(None) is False  # nothing to render the prompt with
    # a config without a renderer: its parsers, as named
    plain = Replay(msgspec.structs.replace(cfg, reasoning_parser="none"),
                   tokenizer=qwen3.tokenizer)
    assert plain.turns(out, None, "c", [], opened=False) == [
        {"role": "assistant", "content": "<think>\nhm\n</think>\n\nYes."}]


@pytest.fixture(scope="module")
def opens_thinking(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Qwen3's tokenizer with a template whose generation prompt opens `<think>` unless
    `enable_thinking` is false."""
    folder = tmp_path_factory.mktemp("opens-thinking")
    for p in QWEN3.iterdir():
        if p.is_file():
            shutil.copy(p, folder / p.name)
    cfg = json.loads((folder / "tokenizer_config.json").read_text())
    assert QWEN3_CLOSED in cfg["chat_template"]
    cfg["chat_template"] = cfg["chat_template"].replace(QWEN3_CLOSED, OPENS_THINKING)
    (folder / "tokenizer_config.json").write_text(json.dumps(cfg))
    return folder


def test_a_turn_starts_inside_reasoning_where_the_categorys_prompt_opens_it(
        tmp_path: Path, opens_thinking: Path) -> None:
    cfg = config(tmp_path, opens_thinking, head="chat_template_kwargs = { enable_thinking = "
                 "false }", categories=(
                     ("think", "chat_template_kwargs = { enable_thinking = true }"),
                     ("plain", "")))
    renderer = Renderer(opens_thinking, cfg.chat_template_kwargs)
    replay = Replay(cfg, renderer)
    think, plain = cfg.category
    # the category's kwargs over the run's
    assert (replay.opened(think), replay.opened(plain), replay.opened(None)) == (
        True, False, False)
    # a turn cut before its end of reasoning is all reasoning where the prompt opened it
    cut = renderer.encode("Still weighing 91 = 7 x 13")
    assert replay.turns([cut], None, "c", [], opened=True) == [
        {"role": "assistant", "reasoning_content": "Still weighing 91 = 7 x 13",
         "content": ""}]
    assert replay.turns([cut], None, "c", [], opened=False) == [
        {"role": "assistant", "content": "Still weighing 91 = 7 x 13"}]


def test_whether_a_reply_starts_in_reasoning_is_its_modes(tmp_path) -> None:
    """Kimi-K2.5's generation prompt opens `<think>` unless `thinking = false`: a mode's
    switch decides how its replies are read (the producer's next turns, the export)."""
    from foundation.modes import by_name
    from producer.run import load_renderer
    from tests.family_tokenizers import kimi

    (tmp_path / "kimi").mkdir()
    folder = kimi(tmp_path / "kimi")
    src = tmp_path / "s.jsonl"
    src.write_text('{"messages": [{"role": "user", "content": "hi"}]}\n')
    cfg = write_config(tmp_path, f"""
run = "r"
output_dir = "{tmp_path / 'out'}"
tokenizer = "{folder}"
[[category]]
name = "c"
source = "{src}"
sampling = {{ max_new_tokens = 8, temperature = 1.0 }}
modes = [{{ name = "think", weight = 1, chat_template_kwargs = {{ thinking = true }} }}, \
{{ name = "fast", weight = 1, chat_template_kwargs = {{ thinking = false }} }}]
""")
    replay = Replay(cfg, load_renderer(cfg))
    cat = cfg.by_name("c")
    assert replay.opened(cat, by_name(cat, "think")) is True
    assert replay.opened(cat, by_name(cat, "fast")) is False
