"""Every reply parser against the replies of the reference parser's own tests.

The cases (`tests/fixtures/parsers/sglang_cases.json`) are the replies SGLang's unit tests
feed its detectors, with what those tests assert of the result (sgl-project/sglang, the file
and commit given per parser; each case names its test function). tokencap's parser of the
same name must give the same, except where it is stricter on purpose (`DEVIATIONS`, each
with its reason): markup that begins a call and does not parse raises `Unparsed` instead of
being dropped, and a call to a function the request did not offer is kept, as the model
made it.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from foundation.config import REASONING_PARSERS, TOOL_CALL_PARSERS
from producer.parsers.registry import (
    Ambiguous,
    Unparsed,
    choose,
    known_names,
    reasoning_parser,
    tool_call_parser,
)
from tests.conftest import FIXTURES

CASES = json.loads((FIXTURES / "parsers" / "sglang_cases.json").read_text())["parsers"]
UNPARSED = "unparsed"
KEPT_UNKNOWN = "kept"
# (parser entry, test) -> what tokencap does instead, and why
DEVIATIONS: dict[tuple[str, str], tuple[str, str]] = {
    ("kimi_k2 (tool)", "TestKimiK2BareCounterParsing."
     "test_detect_and_parse_bare_counter_skips_unknown"):
        (UNPARSED, "a call whose id names no function and whose arguments fit no tool"),
    ("kimi_k2 (tool)", "TestKimiK2ClientStyleIdFallback.test_detect_and_parse_client_id "
     "(fid=call_3)"): (UNPARSED, "a call id that is not Kimi's (newer than SGLang 0.5.23)"),
    ("deepseekv3", "TestDeepSeekV3Detector.test_malformed_json"):
        (UNPARSED, "invalid JSON arguments (SGLang hands the raw text back as content)"),
    ("glm45 (tool)", "TestGlm4MoeDetector.test_invalid_tool_call"):
        (KEPT_UNKNOWN, "a call to a tool not offered is what the model made"),
    ("glm45 (tool)", "TestGlm4MoeDetector.test_missing_name_separator_yields_no_calls"):
        (UNPARSED, "a glm45 call without the newline after its name"),
    ("glm47", "TestGlm47MoeDetector.test_invalid_tool_call"):
        (KEPT_UNKNOWN, "a call to a tool not offered is what the model made"),
    ("qwen3_coder", "TestQwen3CoderDetector.test_incomplete_tool_call"):
        (UNPARSED, "an unterminated call (SGLang parses what there is)"),
    ("qwen25", "TestQwen25Detector.test_malformed_json"):
        (UNPARSED, "a call that is not JSON (SGLang skips it)"),
    ("qwen25", "TestQwen25Detector.test_has_tool_call_partial_tag (has_tool_call only)"):
        (UNPARSED, "<tool_call> without its newline begins a call that does not parse"),
    ("llama3", "TestLlama32Detector.test_invalid_then_valid_json"):
        (KEPT_UNKNOWN, "a reply starting with '{' that is not a call object is content"),
}


def _params() -> list[Any]:
    out = []
    for entry, spec in CASES.items():
        for case in spec["cases"]:
            out.append(pytest.param(entry, spec, case, id=f"{entry}::{case['test']}"))
    return out


def _check_text(got: dict[str, Any], case: dict[str, Any]) -> None:
    for field, want in case["expected"].items():
        if field in ("reasoning_content", "content") and isinstance(want, str):
            assert (got[field] or "") == want, field
    for field, parts in case.get("expected_contains", {}).items():
        for part in parts:
            assert part in (got[field] or ""), (field, part)
    for field, start in case.get("expected_startswith", {}).items():
        assert (got[field] or "").strip().startswith(start), field


@pytest.mark.parametrize(("entry", "spec", "case"), _params())
def test_each_parser_splits_the_reference_parsers_test_replies(entry: str, spec: dict,
                                                                case: dict) -> None:
    deviation = DEVIATIONS.get((entry, case["test"]))
    if spec["kind"] == "reasoning":
        parser = reasoning_parser(spec["name"])
        assert parser is not None
        forced = bool(case.get("constructor", {}).get("force_reasoning"))
        reasoning, content = parser.split(case["text"], opened=forced)
        _check_text({"reasoning_content": reasoning, "content": content}, case)
        return
    tools = tool_call_parser(spec["name"])
    assert tools is not None
    if deviation is not None and deviation[0] == UNPARSED:
        with pytest.raises(Unparsed):
            tools.split(case["text"], case.get("tools"))
        return
    content, calls = tools.split(case["text"], case.get("tools"))
    expected = case["expected"]
    if deviation is not None:  # KEPT_UNKNOWN: the call stays, or the text is content
        assert calls or content == case["text"]
        return
    _check_text({"content": content, "reasoning_content": None}, case)
    if "n_tool_calls" in expected:
        assert len(calls) == expected["n_tool_calls"]
    if "tool_calls" in expected:
        assert [c.name for c in calls] == [c["name"] for c in expected["tool_calls"]]
        for call, want in zip(calls, expected["tool_calls"], strict=True):
            if "arguments" in want:
                assert call.arguments == want["arguments"]


def test_every_deviation_names_a_case_that_exists() -> None:
    cases = {(entry, case["test"]) for entry, spec in CASES.items() for case in spec["cases"]}
    assert set(DEVIATIONS) <= cases


def test_the_cases_cover_every_parser_name() -> None:
    covered = {spec["name"] for spec in CASES.values()}
    reasoning, tools = known_names()
    assert reasoning - {"auto", "none", "qwen3-thinking", "deepseek-v3"} <= covered
    assert tools - {"auto", "none", "glm", "qwen"} <= covered


def test_the_config_takes_exactly_the_names_the_parsers_answer_to() -> None:
    assert known_names() == (set(REASONING_PARSERS), set(TOOL_CALL_PARSERS))


def test_a_call_with_broken_json_does_not_swallow_the_next_one() -> None:
    # SGLang 0.5.23's kimi_k2 regex runs from the broken call's arguments into the next call
    # (vLLM tests/tool_parsers/test_kimi_k2_tool_parser.py::test_invalid_json_still_extracted
    # feeds this reply); here the reply is refused as a whole
    text = ("<|tool_calls_section_begin|><|tool_call_begin|>functions.bad:0"
            "<|tool_call_argument_begin|>{\"city\": \"Beijing\"<|tool_call_end|>"
            "<|tool_call_begin|>functions.good:1<|tool_call_argument_begin|>{\"city\": "
            "\"Shanghai\"}<|tool_call_end|><|tool_calls_section_end|>")
    with pytest.raises(Unparsed, match="call 1 arguments: invalid JSON"):
        tool_call_parser("kimi_k2").split(text, None)  # type: ignore[union-attr]


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
