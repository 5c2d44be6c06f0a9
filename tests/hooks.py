"""A callback a forged job may name (tests/unit/budget_service/test_jobs.py): when anything
calls it, it leaves the file named by TOKENCAP_TEST_MARKER, so a test sees that it ran."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any


def mark(*_args: Any, **_kwargs: Any) -> None:
    Path(os.environ["TOKENCAP_TEST_MARKER"]).write_text("called")
