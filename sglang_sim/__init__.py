"""tokencap's SGLang simulator: an HTTP server that speaks SGLang's native protocol and
simulates continuous batching without a GPU.

It stands in for a real SGLang server in tests, benchmarks and the demo, and says so: its
model path is ``tokencap-sglang-sim``, ``/server_info`` has ``"simulator": true`` and it logs a
WARNING at start. Outputs are synthetic token ids (see ``sglang_sim.outputs``).

- ``sglang_sim.config``: ``SimConfig`` (all knobs), ``LengthDist``, ``FaultConfig``, profiles;
- ``sglang_sim.scheduler``: the batching model (no HTTP);
- ``sglang_sim.server``: the aiohttp app (``create_app``, ``start_server``);
- ``sglang_sim.testing``: ``SimServer`` (in-process, background thread) and
  ``start_sim_subprocess`` for tests and benchmarks;
- ``python -m sglang_sim --help``: the command line.
"""

__version__ = "0.1.0+sglang-sim"
