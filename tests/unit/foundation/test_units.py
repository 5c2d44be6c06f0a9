"""Quantities as people write them (`foundation/units.py`): token counts and bytes."""

from __future__ import annotations

import pytest

from foundation.units import parse_count, size_text


@pytest.mark.parametrize(("text", "count"), [
    ("10M", 10_000_000), ("500K", 500_000), ("500k", 500_000), ("1.5B", 1_500_000_000),
    ("10_000_000", 10_000_000), ("10,000,000", 10_000_000), (" 2.5m ", 2_500_000),
    ("1.1k", 1_100), ("0", 0), (42, 42), ("3T", 3 * 10**12)])
def test_a_count_written_as_people_write_it(text, count) -> None:
    assert parse_count(text) == count


@pytest.mark.parametrize("text", ["lots", "-1", "1.2345k", "10MB", "1e6", "", -3])
def test_what_is_no_count_is_refused_saying_what_is(text) -> None:
    with pytest.raises(ValueError, match="count|below 0|whole"):
        parse_count(text)


def test_bytes_for_people() -> None:
    assert size_text(512) == "512 B"
    assert size_text(5_280_000_000_000) == "5.28 TB"
    assert size_text(57_352) == "57.35 KB"
