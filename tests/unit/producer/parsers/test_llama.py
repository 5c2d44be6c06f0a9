"""`producer/parsers/llama.py` (`llama3` tool calls) against the replies of SGLang's own tests
of its llama32 detector (`tests/fixtures/parsers/sglang_cases.json`), with what those tests
assert; where tokencap is stricter on purpose, `DEVIATIONS` says how and why."""

from __future__ import annotations

import pytest

from tests.helpers import KEPT_UNKNOWN, Deviations, case_keys, check_parser_case, parser_cases

CASES = parser_cases("producer.parsers.llama")
DEVIATIONS: Deviations = {
    ("llama3", "TestLlama32Detector.test_invalid_then_valid_json"):
        (KEPT_UNKNOWN, "a reply starting with '{' that is not a call object is content"),
}


@pytest.mark.parametrize(("entry", "spec", "case"), CASES)
def test_llama3_splits_the_reference_parsers_test_replies(entry: str, spec: dict,
                                                          case: dict) -> None:
    check_parser_case(spec, case, DEVIATIONS.get((entry, case["test"])))


def test_every_deviation_names_a_case_that_exists() -> None:
    assert CASES and set(DEVIATIONS) <= case_keys(CASES)
