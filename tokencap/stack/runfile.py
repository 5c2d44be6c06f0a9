"""The run file of a stack `tokencap up` started: where it is and what it says.

`<state dir>/env` (mode 0600): REDIS_URL, SGLANG_URL, TOKENCAP_RUN, TOKENCAP_PREFIX,
BUDGET_URL and TOKENCAP_TOKEN, one `KEY=value` a line. The state dir is `--state-dir`, else
TOKENCAP_STATE_DIR, else `.run` of the current directory. Every command takes what it is not
given from here, so a second shell in the directory of `make up` finds the stack. Standard
library only: a worker reads it too, and stays small.
"""

from __future__ import annotations

import os
from pathlib import Path

DEFAULT_STATE_DIR = ".run"
STATE_DIR_ENV = "TOKENCAP_STATE_DIR"
RUN_FILE = "env"


def state_dir(given: str | None = None) -> Path:
    """The stack's folder: `given`, else TOKENCAP_STATE_DIR, else `.run` here."""
    return Path(given or os.environ.get(STATE_DIR_ENV) or DEFAULT_STATE_DIR)


def run_file(state: Path) -> dict[str, str]:
    """What `tokencap up` wrote about its stack in `state` ({} when there is none)."""
    try:
        lines = (state / RUN_FILE).read_text().splitlines()
    except OSError:
        return {}
    pairs = (line.split("=", 1) for line in lines if "=" in line)
    return {k: v for k, v in pairs}


def stop_hint(state: Path) -> str:
    """The command that stops the stack kept in `state`."""
    if state.resolve() == (Path.cwd() / DEFAULT_STATE_DIR).resolve():
        return "`make down` (or `tokencap down`)"
    return f"`tokencap down --state-dir {state}`"
