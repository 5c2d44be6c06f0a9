"""`producer/parsers/glm.py` (`glm45`, `glm47` tool calls) against the replies of SGLang's own
tests of those detectors (`tests/fixtures/parsers/sglang_cases.json`), with what those tests
assert; where tokencap is stricter on purpose, `DEVIATIONS` says how and why."""

from __future__ import annotations

import pytest

from tests.helpers import (
    KEPT_UNKNOWN,
    UNPARSED,
    Deviations,
    case_keys,
    check_parser_case,
    parser_cases,
)

CASES = parser_cases("producer.parsers.glm")
DEVIATIONS: Deviations = {
    ("glm45 (tool)", "TestGlm4MoeDetector.test_invalid_tool_call"):
        (KEPT_UNKNOWN, "a call to a tool not offered is what the model made"),
    ("glm45 (tool)", "TestGlm4MoeDetector.test_missing_name_separator_yields_no_calls"):
        (UNPARSED, "a glm45 call without the newline after its name"),
    ("glm47", "TestGlm47MoeDetector.test_invalid_tool_call"):
        (KEPT_UNKNOWN, "a call to a tool not offered is what the model made"),
}


@pytest.mark.parametrize(("entry", "spec", "case"), CASES)
def test_glm_splits_the_reference_parsers_test_replies(entry: str, spec: dict,
                                                       case: dict) -> None:
    check_parser_case(spec, case, DEVIATIONS.get((entry, case["test"])))


def test_every_deviation_names_a_case_that_exists() -> None:
    assert CASES and set(DEVIATIONS) <= case_keys(CASES)
