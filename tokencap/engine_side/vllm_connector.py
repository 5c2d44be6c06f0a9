"""tokencap's hidden-state connector for vLLM's `extract_hidden_states` (vLLM 0.32).

vLLM loads it by module path, from the engine's venv (the repository root, or a folder
holding only `tokencap`, on its PYTHONPATH):

    --kv-transfer-config '{"kv_connector": "TokencapHiddenStatesConnector",
        "kv_connector_module_path": "tokencap.engine_side.vllm_connector",
        "kv_role": "kv_producer",
        "kv_connector_extra_config": {"shared_storage_path": DIR,
                                      "tokencap_dtype": "fp8_e4m3"}}'

It is vLLM's `ExampleHiddenStatesConnector` (the file name, the `.lock` file it holds
exclusively until the file is whole, the writer threads, the scheduler side) with three
changes:

- Every file says what it holds, in its safetensors metadata: `tokencap.layers`, the layer
  ids of its slots (vLLM stores them rising, each once), and `tokencap.final_norm`, for each
  whether it was taken before or after the model's final norm (vLLM takes every id before
  it: id N, the last layer's output, is the pre-norm state). tokencap's preflight and
  workers refuse a file of other layers than the config's, naming both lists.
- With `"tokencap_dtype": "fp8_e4m3"` it stores speculators' FP8 layout (hs-connectors'
  `fp8_utils`): `hidden_states` float8_e4m3fn [T, L, H] and `hidden_states_scales` float32
  [T, 1, 1], one scale per token = max(amax over its layers and dimensions / 448, 1e-12),
  quantized in the writer thread on the host: half the bytes written and kept.
- On vLLM's CPU build the stock copy out of the states cache (into a pinned host buffer on a
  CUDA copy stream) raises ("pin_memory requires a CUDA or other accelerator backend") and
  the engine dies at the first finished request: there the states are gathered from the
  cache (already in host memory) into a tensor of their own, synchronously, before the
  blocks go back, and the copy counts as done at once. On a GPU the stock copy runs.

Only vLLM's engine venv has vllm and torch, and nothing of the rest of tokencap is
importable there: the metadata names repeat `foundation/hsfile.py`'s (a test compares them).
"""

from __future__ import annotations

import fcntl
import os
from functools import partial
from typing import Any

import torch
from safetensors.torch import save_file
from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (  # type: ignore[import-not-found]
    ExampleHiddenStatesConnector,
    extract_from_kv_cache,
)

__all__ = ["TokencapHiddenStatesConnector"]

META_LAYERS = "tokencap.layers"
META_FINAL_NORM = "tokencap.final_norm"
SCALES = "hidden_states_scales"
FP8_MAX = 448.0  # float8_e4m3fn's largest finite value
FP8_MIN_SCALE = 1e-12
FP8_DTYPE = "fp8_e4m3"


def to_fp8(states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[T, L, H] states as speculators stores them: per token, scale = max(amax / 448,
    1e-12) over its layers and dimensions in float32, and float8_e4m3fn(states / scale)."""
    wide = states.float()
    amax = wide.abs().amax(dim=tuple(range(1, wide.dim())), keepdim=True)
    scale = (amax / FP8_MAX).clamp(min=FP8_MIN_SCALE)
    return (wide / scale).to(torch.float8_e4m3fn), scale


class _Done:
    """Stands for the stock connector's CUDA event on a copy that already happened: the
    writer thread's `synchronize()` and `get_finished`'s `query()` find it complete."""

    def synchronize(self) -> None:
        return None

    def query(self) -> bool:
        return True


class TokencapHiddenStatesConnector(ExampleHiddenStatesConnector):
    """`ExampleHiddenStatesConnector` that says its layers, can store FP8, and runs on the
    CPU build (module docstring)."""

    def __init__(self, vllm_config: Any, *args: Any, **kwargs: Any) -> None:
        super().__init__(vllm_config, *args, **kwargs)
        hf = vllm_config.speculative_config.draft_model_config.hf_config
        ids = sorted(set(getattr(hf, "eagle_aux_hidden_state_layer_ids", None) or ()))
        self._tc_metadata = {META_LAYERS: ",".join(str(i) for i in ids),
                             META_FINAL_NORM: ",".join("pre" for _ in ids)}
        dtype = vllm_config.kv_transfer_config.get_from_extra_config("tokencap_dtype", None)
        if dtype not in (None, FP8_DTYPE):
            raise ValueError(f"tokencap_dtype {dtype!r}: only {FP8_DTYPE!r} (or none: the "
                             "model's dtype)")
        self._tc_fp8 = dtype == FP8_DTYPE

    def _write_tensors(self, tensors: dict[str, torch.Tensor], event: Any, filename: str,
                       lock_fd: int | None) -> None:
        """The writer thread: wait for the copy, quantize if asked, write the file with its
        metadata, then release the lock (closing it)."""
        try:
            event.synchronize()
            if self._tc_fp8:
                q, scale = to_fp8(tensors["hidden_states"])
                tensors = {**tensors, "hidden_states": q, SCALES: scale}
            save_file(tensors, filename, metadata=self._tc_metadata)
        finally:
            if lock_fd is not None:
                os.close(lock_fd)

    def _submit_async_write(self, pending: Any) -> None:
        cache = self._kv_cache
        if cache is not None and cache.is_cuda:
            super()._submit_async_write(pending)  # the stock copy, then our writer thread
            return
        if not self._is_tp_rank_zero:
            return
        assert cache is not None, "register_kv_caches was not called"
        block = self._block_size
        blocks = torch.tensor(pending.block_ids, dtype=torch.long)
        slots = (blocks.reshape(-1, 1) * block
                 + torch.arange(block, dtype=torch.long).reshape(1, -1)).flatten()
        n = int(pending.token_ids.shape[0])
        # [tokens, layers, hidden], copied out of the cache before its blocks go back to the
        # scheduler (fancy indexing copies; clone() drops the padding to whole blocks)
        states = extract_from_kv_cache(cache, slots.to(cache.device), n).to("cpu").clone()
        tensors = {"hidden_states": states.contiguous(),
                   "token_ids": pending.token_ids.clone()}

        assert self._req_futures.get(pending.req_id) is None, \
            f"a second hidden-state write for request {pending.req_id}"
        os.makedirs(os.path.dirname(pending.filename) or ".", exist_ok=True)
        # the lock wait_for_save took when the request was scheduled; the stock fallback
        # when there is none
        lock_fd = self._lock_fds.pop(pending.req_id, None)
        if lock_fd is None and self.use_lock:
            lock_fd = os.open(pending.filename + ".lock", os.O_CREAT | os.O_WRONLY | os.O_TRUNC,
                              0o644)
            fcntl.flock(lock_fd, fcntl.LOCK_EX)
        done = _Done()
        future = self._executor.submit(self._write_tensors, tensors, done, pending.filename,
                                       lock_fd)
        self._req_copy_events[pending.req_id] = done
        self._req_futures[pending.req_id] = future
        future.add_done_callback(partial(self._on_write_done, pending.req_id))
