"""`producer/parsers/reasoning.py` (the `<think>` families' reasoning parsers: qwen3,
deepseek-r1, glm45, kimi_k2, kimi) against the replies of SGLang's own tests of its
reasoning detectors (`tests/fixtures/parsers/sglang_cases.json`), with what those tests
assert."""

from __future__ import annotations

import pytest

from tests.helpers import check_parser_case, parser_cases

CASES = parser_cases("producer.parsers.reasoning")


@pytest.mark.parametrize(("entry", "spec", "case"), CASES)
def test_each_reasoning_parser_splits_the_reference_parsers_test_replies(
        entry: str, spec: dict, case: dict) -> None:
    check_parser_case(spec, case, None)
