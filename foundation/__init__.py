"""The foundation: what every layer above shares, importing nothing of the project.

Layers, from the ground up (tests/docs/test_layers.py holds them):

- **foundation** (this package): the run config, wire structs, errors with exit codes, the
  Redis connection, the output-file layout and its reader, the Redis backoff, what tokencap
  reads from an engine besides /generate;
- **ledger** (`budget_service`): key table, Lua scripts, `Budget`, RQ's contract (`jobs`),
  status, its HTTP face;
  imports only the foundation;
- **stages** (`producer`, `consumers`, `writer`): import the foundation and the ledger, never
  each other;
- **roof** (`tokencap`): CLI, launcher, plan, export, watch; imported by nothing of the
  wheel. Outside the wheel, the test harness (`testing`) sits on it, and `bench` and
  `gpu_check` on the harness.

`sglang_sim` stands apart: it imports nothing of these and none of them imports it, but the
roof (the `tokencap sim` command) and what sits on it.
"""
