"""`producer/parsers/qwen.py` (`qwen25`, `qwen3_coder` tool calls) against the replies of
SGLang's own tests of those detectors (`tests/fixtures/parsers/sglang_cases.json`), with what
those tests assert; where tokencap is stricter on purpose, `DEVIATIONS` says how and why."""

from __future__ import annotations

import pytest

from tests.helpers import UNPARSED, Deviations, case_keys, check_parser_case, parser_cases

CASES = parser_cases("producer.parsers.qwen")
DEVIATIONS: Deviations = {
    ("qwen3_coder", "TestQwen3CoderDetector.test_incomplete_tool_call"):
        (UNPARSED, "an unterminated call (SGLang parses what there is)"),
    ("qwen25", "TestQwen25Detector.test_malformed_json"):
        (UNPARSED, "a call that is not JSON (SGLang skips it)"),
    ("qwen25", "TestQwen25Detector.test_has_tool_call_partial_tag (has_tool_call only)"):
        (UNPARSED, "<tool_call> without its newline begins a call that does not parse"),
}


@pytest.mark.parametrize(("entry", "spec", "case"), CASES)
def test_qwen_splits_the_reference_parsers_test_replies(entry: str, spec: dict,
                                                        case: dict) -> None:
    check_parser_case(spec, case, DEVIATIONS.get((entry, case["test"])))


def test_every_deviation_names_a_case_that_exists() -> None:
    assert CASES and set(DEVIATIONS) <= case_keys(CASES)
