"""vLLM's `extract_hidden_states` KV connector for its CPU build.

vLLM loads it by module path, from the engine's venv (the repository root on its
PYTHONPATH):

    --kv-transfer-config '{"kv_connector": "CpuHiddenStatesConnector",
        "kv_connector_module_path": "tokencap.engine_side.vllm_cpu_connector",
        "kv_role": "kv_producer",
        "kv_connector_extra_config": {"shared_storage_path": DIR}}'

The stock `ExampleHiddenStatesConnector` (vLLM 0.32.0) copies each finished request's states
out of the hidden-state cache into a pinned host buffer on a CUDA copy stream; on the CPU
build `pin_memory=True` raises ("requires a CUDA or other accelerator backend") inside the
engine's step and the engine dies at the first finished request. Here the only override is
that copy: the states are gathered from the cache (already in host memory) into a fresh
tensor of their own, synchronously, before the blocks are handed back, and the copy counts
as done at once. The rest is the stock connector's: the file name, the `.lock` file it holds
(LOCK_EX, taken before the client gets the path, released when the file is written), the
writer thread pool and `save_file`, the scheduler side.

Only vLLM's engine venv has vllm and torch: the imports are untyped here on purpose.
"""

from __future__ import annotations

import fcntl
import os
from functools import partial
from typing import Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (  # type: ignore[import-not-found]
    ExampleHiddenStatesConnector,
    extract_from_kv_cache,
)

__all__ = ["CpuHiddenStatesConnector"]


class _Done:
    """Stands for the stock connector's CUDA event on a copy that already happened: the
    writer thread's `synchronize()` and `get_finished`'s `query()` find it complete."""

    def synchronize(self) -> None:
        return None

    def query(self) -> bool:
        return True


class CpuHiddenStatesConnector(ExampleHiddenStatesConnector):
    """`ExampleHiddenStatesConnector` without the pinned buffer and the CUDA stream."""

    def _submit_async_write(self, pending: Any) -> None:
        if not self._is_tp_rank_zero:
            return
        cache = self._kv_cache
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
