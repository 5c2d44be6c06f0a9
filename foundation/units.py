"""Quantities as people write and read them: bytes ("5.28 TB"), token counts ("10M")."""

from __future__ import annotations

import re
from decimal import Decimal

# a count as people write it: 10000000, 10_000_000, 10,000,000, 10M, 500k, 1.5B
_COUNT = re.compile(r"^\s*(\d+(?:[_,]\d+)*(?:\.\d+)?)\s*([kKmMbBgGtT]?)\s*$")
_SCALE = {"": 1, "k": 10**3, "m": 10**6, "b": 10**9, "g": 10**9, "t": 10**12}


def parse_count(text: str | int) -> int:
    """A count of tokens (or rows) as people write it: digits with `_` or `,` between them,
    or a number with K, M, B (or G) or T after it (`10M`, `500K`, `1.5B`); a whole number
    >= 0. Raises ValueError saying what it takes."""
    if isinstance(text, int) and not isinstance(text, bool):
        if text < 0:
            raise ValueError(f"{text} is below 0")
        return text
    m = _COUNT.match(str(text))
    if m is None:
        raise ValueError(f"{text!r} is not a count: write 10000000, 10_000_000, 10M, 500K "
                         "or 1.5B")
    number, unit = m.group(1).replace("_", "").replace(",", ""), m.group(2).lower()
    value = Decimal(number) * _SCALE[unit]
    if value != value.to_integral_value():
        raise ValueError(f"{text!r} is not a whole number of tokens")
    return int(value)


def size_text(n: float) -> str:
    """Bytes for people: "512 B", "3.4 MB", "1.25 GB", "5.28 TB"."""
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:,.2f} {unit}"
    return f"{n:,.0f} B"
