"""Dataset formats: `records` (a record to a prompt, `Rejected`), `turns`, `conversation`."""
