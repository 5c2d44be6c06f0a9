"""The ledger the tests of this folder drive: run "t" with one category, "code", capped at
1,000 tokens (`tests.helpers.make_cfg`), in the session's private Redis."""

from __future__ import annotations

import pytest
from redis import Redis

from budget_service.budget import Budget
from budget_service.keys import Keys
from tests.helpers import make_cfg


@pytest.fixture
def budget(redis: Redis) -> Budget:
    b = Budget(redis, Keys("tokencap", "t"))
    b.feeding.init_run(make_cfg())
    return b
