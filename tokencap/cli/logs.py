"""Root logging setup; only the CLI calls it."""

from __future__ import annotations

import logging
import sys

FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


def setup(level: str = "INFO") -> None:
    logging.basicConfig(level=level.upper(), format=FORMAT, stream=sys.stderr, force=True)
    for noisy in ("urllib3", "rq.worker", "rq.queue", "filelock", "httpx"):
        logging.getLogger(noisy).setLevel(max(logging.WARNING, logging.getLogger().level))
