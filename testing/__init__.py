"""The test harness (a private redis-server, a whole pipeline in one process, its invariants),
shared by tests/, bench/ and gpu_check/. Not part of the wheel: it lives in the checkout."""
