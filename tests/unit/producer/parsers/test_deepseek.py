"""`producer/parsers/deepseek.py` (`deepseekv3`, `deepseekv31`, `deepseekv32` tool calls)
against the replies of SGLang's own tests of those detectors
(`tests/fixtures/parsers/sglang_cases.json`), with what those tests assert; where tokencap is
stricter on purpose, `DEVIATIONS` says how and why."""

from __future__ import annotations

import pytest

from tests.helpers import UNPARSED, Deviations, case_keys, check_parser_case, parser_cases

CASES = parser_cases("producer.parsers.deepseek")
DEVIATIONS: Deviations = {
    ("deepseekv3", "TestDeepSeekV3Detector.test_malformed_json"):
        (UNPARSED, "invalid JSON arguments (SGLang hands the raw text back as content)"),
}


@pytest.mark.parametrize(("entry", "spec", "case"), CASES)
def test_deepseek_splits_the_reference_parsers_test_replies(entry: str, spec: dict,
                                                            case: dict) -> None:
    check_parser_case(spec, case, DEVIATIONS.get((entry, case["test"])))


def test_every_deviation_names_a_case_that_exists() -> None:
    assert CASES and set(DEVIATIONS) <= case_keys(CASES)
