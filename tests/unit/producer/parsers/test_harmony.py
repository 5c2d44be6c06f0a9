"""`producer/parsers/harmony.py` (gpt-oss: its reasoning and its tool calls, in harmony
channels) against the replies of SGLang's own tests of its gpt-oss detectors
(`tests/fixtures/parsers/sglang_cases.json`), with what those tests assert."""

from __future__ import annotations

import pytest

from tests.helpers import check_parser_case, parser_cases

CASES = parser_cases("producer.parsers.harmony")


@pytest.mark.parametrize(("entry", "spec", "case"), CASES)
def test_gpt_oss_splits_the_reference_parsers_test_replies(entry: str, spec: dict,
                                                           case: dict) -> None:
    check_parser_case(spec, case, None)
