"""Quantities as people write and read them: bytes ("5.28 TB"), token counts ("10M")."""

from __future__ import annotations


def size_text(n: float) -> str:
    """Bytes for people: "512 B", "3.4 MB", "1.25 GB", "5.28 TB"."""
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:,.2f} {unit}"
    return f"{n:,.0f} B"
