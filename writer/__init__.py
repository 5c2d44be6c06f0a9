"""The writer stage: one process per run (a lease) that reads the results and dead letters the
workers committed (Redis streams), appends them to the category's files, fsyncs, and
acknowledges them (`budget_service/lua/acknowledge.lua`). It consumes no RQ job; like the
producer and the consumers it imports only the foundation and the ledger."""
