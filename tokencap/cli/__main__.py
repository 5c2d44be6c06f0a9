"""`python -m tokencap.cli`: the `tokencap` command (how the launcher starts its processes)."""

from tokencap.cli.main import main

main()
