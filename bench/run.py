"""Script entry: `python bench/run.py [SCENARIO ...]`, the same as `python -m bench`.

Python puts this file's folder first on sys.path, where bench/tokenize.py would shadow the
standard library's `tokenize`; the repository root goes there instead.
"""

from __future__ import annotations

import sys
from pathlib import Path

_HERE = Path(__file__).resolve().parent
sys.path[:] = [str(_HERE.parent)] + [p for p in sys.path if Path(p or ".").resolve() != _HERE]

from bench.__main__ import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
