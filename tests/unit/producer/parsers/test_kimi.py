"""`producer/parsers/kimi.py` (`kimi_k2` tool calls) against the replies of SGLang's own tests
of its kimi_k2 detector (`tests/fixtures/parsers/sglang_cases.json`), with what those tests
assert; where tokencap is stricter on purpose, `DEVIATIONS` says how and why."""

from __future__ import annotations

import pytest

from producer.parsers.registry import Unparsed, tool_call_parser
from tests.helpers import UNPARSED, Deviations, case_keys, check_parser_case, parser_cases

CASES = parser_cases("producer.parsers.kimi")
DEVIATIONS: Deviations = {
    ("kimi_k2 (tool)", "TestKimiK2BareCounterParsing."
     "test_detect_and_parse_bare_counter_skips_unknown"):
        (UNPARSED, "a call whose id names no function and whose arguments fit no tool"),
    ("kimi_k2 (tool)", "TestKimiK2ClientStyleIdFallback.test_detect_and_parse_client_id "
     "(fid=call_3)"): (UNPARSED, "a call id that is not Kimi's (newer than SGLang 0.5.23)"),
}


@pytest.mark.parametrize(("entry", "spec", "case"), CASES)
def test_kimi_k2_splits_the_reference_parsers_test_replies(entry: str, spec: dict,
                                                           case: dict) -> None:
    check_parser_case(spec, case, DEVIATIONS.get((entry, case["test"])))


def test_every_deviation_names_a_case_that_exists() -> None:
    assert CASES and set(DEVIATIONS) <= case_keys(CASES)


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
