"""Bodies of ``/server_info``, ``/model_info`` and ``/v1/models`` for a simulator config.

Field names follow SGLang's replies (server args, scheduler info, ``internal_states``,
``version``); the simulator adds ``"simulator": true`` and its whole config as
``sim_config``. Throughput figures are wall-clock tokens per second.
"""

from __future__ import annotations

import time
from typing import Any

import msgspec

from sglang_sim import __version__
from sglang_sim.config import SimConfig

MODEL_TYPE = "sglang_sim"
ARCHITECTURE = "SimulatedForCausalLM"


def server_info(config: SimConfig, port: int | None, gen_throughput_tok_s: float) -> dict[str, Any]:
    """The flat ``/server_info`` object."""
    return {
        "model_path": config.model_path,
        "tokenizer_path": config.model_path,
        "served_model_name": config.model_path,
        "port": port,
        # the --context-length flag: null unless it was passed
        "context_length": config.context_length if config.context_length_flag else None,
        "max_running_requests": config.max_running_requests,
        "max_queued_requests": config.max_queued_requests,
        "max_total_tokens": config.max_total_tokens,
        "chunked_prefill_size": None,
        "schedule_policy": "fcfs",
        "stream_interval": 1,
        "sampling_defaults": "openai",
        "tp_size": 1,
        "dp_size": 1,
        "allow_auto_truncate": False,
        "enable_metrics": True,
        "skip_tokenizer_init": False,
        "random_seed": config.seed,
        "status": "ready",
        "max_total_num_tokens": config.max_total_tokens,
        "max_req_input_len": config.max_req_input_len,
        "internal_states": [
            {
                "last_gen_throughput": gen_throughput_tok_s,
                "memory_usage": {
                    "weight": 0.0,
                    "kvcache": 0.0,
                    "token_capacity": config.max_total_tokens,
                    "graph": 0.0,
                },
                "effective_max_running_requests_per_dp": config.max_running_requests,
            }
        ],
        "version": config.sglang_version,
        "simulator": True,
        "simulator_version": __version__,
        "sim_config": msgspec.to_builtins(config),
    }


def model_info(config: SimConfig) -> dict[str, Any]:
    """The ``/model_info`` object."""
    return {
        "model_path": config.model_path,
        "tokenizer_path": config.model_path,
        "is_generation": True,
        "preferred_sampling_params": None,
        "weight_version": config.weight_version,
        "has_image_understanding": False,
        "has_audio_understanding": False,
        "model_type": MODEL_TYPE,
        "architectures": [ARCHITECTURE],
    }


def models_list(config: SimConfig) -> dict[str, Any]:
    """The ``/v1/models`` object, with ``max_model_len`` = the context length."""
    card = {
        "id": config.model_path,
        "object": "model",
        "created": int(time.time()),
        "owned_by": "vllm" if config.flavor == "vllm" else "sglang",
        "root": config.model_path,
        "max_model_len": config.context_length,
    }
    return {"object": "list", "data": [card]}
