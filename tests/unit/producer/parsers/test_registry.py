"""`producer/parsers/registry.py`: the reply parsers by SGLang's names and aliases, the names
the config takes, and "auto" (the parsers a chat template and vocabulary call for; `Ambiguous`
where two fit). Each family's parsers against the reference parser's test replies: the
`test_<family>.py` beside this file."""

from __future__ import annotations

import pytest

from foundation.config import REASONING_PARSERS, TOOL_CALL_PARSERS
from producer.parsers.registry import (
    ALIASES,
    Ambiguous,
    choose,
    known_names,
    reasoning_parser,
    tool_call_parser,
)
from tests.helpers import PARSER_CASES, parser_module

# the modules whose parsers the reference cases exercise, each tested by its own file here
FAMILY_MODULES = {f"producer.parsers.{m}" for m in (
    "deepseek", "glm", "harmony", "kimi", "llama", "qwen", "reasoning")}


def test_the_cases_cover_every_parser_name() -> None:
    covered = {spec["name"] for spec in PARSER_CASES.values()}
    reasoning, tools = known_names()
    assert reasoning - {"auto", "none", "qwen3-thinking", "deepseek-v3"} <= covered
    assert tools - {"auto", "none", "glm", "qwen"} <= covered


def test_every_case_belongs_to_a_family_file() -> None:
    """No reference case is left out by the family files, each running its module's."""
    assert {parser_module(spec) for spec in PARSER_CASES.values()} == FAMILY_MODULES


def test_the_config_takes_exactly_the_names_the_parsers_answer_to() -> None:
    assert known_names() == (set(REASONING_PARSERS), set(TOOL_CALL_PARSERS))


def test_each_name_gives_its_parser_and_an_alias_the_parser_it_stands_for() -> None:
    reasoning, tools = known_names()
    for name in reasoning - {"auto", "none"}:
        assert reasoning_parser(name).name == name  # type: ignore[union-attr]
    for name in tools - {"auto", "none", *ALIASES}:
        assert tool_call_parser(name).name == name  # type: ignore[union-attr]
    assert {alias: tool_call_parser(alias).name  # type: ignore[union-attr]
            for alias in ALIASES} == {"qwen": "qwen25", "glm": "glm45"}
    assert reasoning_parser("none") is None and tool_call_parser("none") is None
    with pytest.raises(KeyError):
        tool_call_parser("qwen9")


def test_auto_picks_the_parsers_of_a_template_and_asks_when_two_fit() -> None:
    kimi_vocab = {"<|tool_calls_section_begin|>", "<think>", "</think>"}
    assert choose("reasoning", "auto", "<|im_assistant|>", kimi_vocab).name == "kimi_k2"
    assert choose("tool", "auto", "x <|tool_calls_section_begin|> y", kimi_vocab).name == \
        "kimi_k2"
    assert choose("tool", "auto", "<tool_call>\n{{ tool_call | tojson }}", set()).name == \
        "qwen25"
    assert choose("tool", "auto", "<tool_call>\n<function={{ name }}>", set()).name == \
        "qwen3_coder"
    assert choose("tool", "auto", "plain {{ content }}", set()).name == "none"
    assert choose("tool", "qwen", "anything", set()).name == "qwen25"  # an alias, as named
    glm_without_its_format = "<|assistant|><tool_call>{{ tc.name }}<arg_key>{{ k }}"
    with pytest.raises(Ambiguous, match="glm45 and the glm47 tool parsers fit"):
        choose("tool", "auto", glm_without_its_format, set())


def test_auto_says_why_and_a_named_parser_is_taken_as_named() -> None:
    qwen3 = "<|im_start|>{{ m.reasoning_content }}"
    got = choose("reasoning", "auto", qwen3, {"</think>"})
    assert got.name == "qwen3" and got.why.startswith("auto: ") and "</think>" in got.why
    none = choose("reasoning", "auto", qwen3, set())  # </think> is no token: not Qwen3's
    assert none.name == "none" and "no reasoning syntax" in none.why
    assert choose("reasoning", "deepseek-r1", qwen3, {"</think>"}) == (
        "deepseek-r1", "named in the config")
    # GLM's own description of its call format tells 4.5 (a newline) from 4.7
    glm = "<|assistant|><arg_key> <tool_call>{function-name}"
    assert choose("tool", "auto", glm + "\n<arg_key>", set()).name == "glm45"
    assert choose("tool", "auto", glm + "<arg_key>", set()).name == "glm47"
    with pytest.raises(Ambiguous, match="name one with reasoning_parser"):
        choose("reasoning", "auto", "<|channel|> <|assistant|>", {"<think>"})
