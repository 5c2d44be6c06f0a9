"""Code that runs inside an engine's own process, not tokencap's: loaded by the engine from
its own venv (vLLM's CPU build under `make test-engine`). Nothing here imports the rest of
tokencap, and nothing in tokencap imports this package.
"""
