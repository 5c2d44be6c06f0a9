"""The local stack: its processes, their supervisor, the one stage runner."""
