"""`Budget`: one run's ledger in all its roles, for code that plays several: the producer (it
feeds, reads the states and the event log, and rebuilds the run after a Redis restart), the
launcher, the CLI and tests.

A worker holds only its role's ledger (`SampleLedger`), the writer only its own
(`WritingLedger`); `budget_service.ledger` lists the roles. The shared
reads (`Ledger`) are on `Budget` itself; the rest is reached by role: `budget.feeding.feed`,
`budget.samples.admit`, `budget.writing.acknowledge`, `budget.operating.set_cap`,
`budget.telemetry.status`.
"""

from __future__ import annotations

from redis import Redis

from budget_service.feeding import FeedingLedger
from budget_service.keys import Keys
from budget_service.ledger import Ledger
from budget_service.operating import OperatorLedger
from budget_service.samples import SampleLedger
from budget_service.scripts import Scripts
from budget_service.telemetry import TelemetryLedger
from budget_service.writing import WritingLedger


class Budget(Ledger):
    """All five roles of one run's ledger over one connection, keys and scripts."""

    def __init__(self, redis: Redis, keys: Keys, scripts: Scripts | None = None) -> None:
        super().__init__(redis, keys, scripts)
        shared = (redis, keys, self.scripts)
        self.feeding = FeedingLedger(*shared)
        self.samples = SampleLedger(*shared)
        self.writing = WritingLedger(*shared)
        self.operating = OperatorLedger(*shared)
        self.telemetry = TelemetryLedger(*shared)
