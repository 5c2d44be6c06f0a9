"""The `tokencap` command: wiring only (`main`: the group, its error handler and logging)."""
