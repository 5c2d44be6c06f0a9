"""Command line: ``python -m sglang_sim --host 127.0.0.1 --port 30000 [options]``.

Wiring only: the flags override fields of the chosen profile's ``SimConfig`` (the profile is
the single source of every default) and the server runs until SIGINT/SIGTERM.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys
from collections.abc import Sequence
from typing import Any

import msgspec

from sglang_sim.config import PROFILES, FaultConfig, load_length_profile
from sglang_sim.families import FAMILIES
from sglang_sim.server import start_server

logger = logging.getLogger("sglang_sim")

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 30000
EXIT_BAD_CONFIG = 2

DESCRIPTION = """\
SGLang-protocol SIMULATOR (not SGLang): serves POST /generate, /health, /server_info,
/model_info, /v1/models, /v1/loads, /get_load (each as --sglang-version has it),
/flush_cache, /abort_request and /metrics (or, with --flavor vllm, vLLM's POST
/v1/completions, /v1/models, /version, /health and /metrics; with
--extract-hidden-states, vLLM's hidden-state files), and simulates continuous
batching without a GPU. Outputs are synthetic, deterministic token ids whose
lengths follow a lognormal per category (header X-Tokencap-Category). Debug routes:
GET /_sim/stats, GET|POST /_sim/faults, POST /_sim/reset_stats. Defaults come from --profile
("default": ~1,000 output tok/s at 72 running requests, 72 ms per decode step)."""

# (flag, SimConfig field, type, help)
_OVERRIDES: tuple[tuple[str, str, type, str], ...] = (
    ("--time-scale", "time_scale", float, "simulated seconds per wall second (e.g. 100)"),
    ("--max-running-requests", "max_running_requests", int, "size limit of the running batch"),
    ("--max-queued-requests", "max_queued_requests", int,
     "waiting-queue limit; beyond it /generate answers 503 (default: unbounded)"),
    ("--max-total-tokens", "max_total_tokens", int, "KV-cache capacity in tokens"),
    ("--context-length", "context_length", int, "model context length in tokens"),
    ("--eos-token-id", "eos_token_id", int, "EOS token id ending a non-truncated output"),
    ("--vocab-size", "vocab_size", int, "output ids are drawn below this"),
    ("--seed", "seed", int, "simulator seed (outputs and faults)"),
    ("--decode-base-s", "decode_base_s", float, "decode step time at batch 0, seconds"),
    ("--decode-per-req-s", "decode_per_req_s", float,
     "added decode step time per running request, seconds"),
    ("--prefill-s-per-token", "prefill_s_per_token", float, "prefill time per prompt token, s"),
    ("--prefix-cache-tokens", "prefix_cache_tokens", int,
     "prefix cache capacity in tokens (0: none); cached prompt prefixes are not prefilled"),
    ("--prefix-cache-page-tokens", "prefix_cache_page_tokens", int,
     "prefix cache page: matches are whole pages (0: 1 for SGLang, 16 for vLLM)"),
    ("--model-path", "model_path", str, "model name reported by the server"),
    ("--flavor", "flavor", str, "the server played: sglang (native /generate) or vllm "
     "(OpenAI-compatible /v1/completions with token ids)"),
    ("--sglang-version", "sglang_version", str,
     "SGLang release whose reply shapes, errors, routes and context rule are played"),
    ("--api-key", "api_key", str, "require Authorization: Bearer KEY, as SGLang's --api-key"),
    ("--metrics-dp-ranks", "metrics_dp_ranks", int, "/metrics series per DP rank"),
    ("--metrics-tp-ranks", "metrics_tp_ranks", int,
     "/metrics series repeated per TP rank (--enable-metrics-for-all-schedulers)"),
    ("--hs-hidden-size", "hs_hidden_size", int,
     "with --extract-hidden-states: the width of each layer's states"),
    ("--hs-dtype", "hs_dtype", str,
     "with --extract-hidden-states: the dtype of the states, float32, bfloat16 or fp8_e4m3 "
     "(speculators' FP8 layout, as tokencap's connector writes it)"),
    ("--hs-states", "hs_states", str,
     "with --extract-hidden-states: full (a function of each token and the one before) or "
     "table (each token's a copy of one of 64 rows: a benchmark at a large model's size)"),
    ("--hs-storage-path", "hs_storage_path", str,
     "with --extract-hidden-states: the folder of the files (vLLM's shared_storage_path)"),
)  # fmt: skip
# (flag, FaultConfig field, help): the hidden-state file faults, merged into --faults
_HS_FAULT_FLAGS: tuple[tuple[str, str, str], ...] = (
    ("--hs-zero-layer-rate", "hs_zero_layer_rate",
     "one layer slot of the file is all zeros"),
    ("--hs-nan-rate", "hs_nan_rate", "one value of the file is NaN"),
    ("--hs-wrong-ids-rate", "hs_wrong_ids_rate",
     "one of the file's token_ids differs from the prompt"),
    ("--hs-truncate-rate", "hs_truncate_rate",
     "the file is cut short (a torn write) and its path still answered"),
)  # fmt: skip


def _layer_ids(text: str) -> list[int]:
    """``--hs-layer-ids``: "2,4,5,8" or a JSON list."""
    try:
        return [int(p) for p in text.strip().strip("[]").split(",") if p.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"layer ids must look like 2,4,5,8: {text!r}") from None


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m sglang_sim", description=DESCRIPTION)
    parser.add_argument("--host", default=DEFAULT_HOST, help="bind address (%(default)s)")
    parser.add_argument("--port", type=int, default=DEFAULT_PORT, help="0 = any free port")
    parser.add_argument(
        "--profile", choices=sorted(PROFILES), default="default", help="base settings"
    )
    for flag, _field, kind, help_text in _OVERRIDES:
        parser.add_argument(flag, type=kind, default=None, help=f"{help_text} (profile value)")
    parser.add_argument(
        "--length-profile",
        metavar="FILE",
        help='JSON {"default": {"mean_tokens": M, "sigma": S}, "categories": {NAME: {...}}}',
    )
    parser.add_argument(
        "--faults",
        metavar="JSON",
        help='initial fault knobs, e.g. \'{"error_rates": {"429": 0.1}, "stall_s": 0}\'',
    )
    parser.add_argument(
        "--tokenizer",
        metavar="DIR",
        help="a local tokenizer: answer text-like ids (words, reasoning, tool calls in the "
        "Qwen syntax) instead of random ones",
    )
    parser.add_argument(
        "--family",
        choices=sorted(FAMILIES),
        help="with --tokenizer: answer in this model family's grammar (reasoning block, "
        "tool-call syntax, end-of-turn token; SGLang's parser names). Default: Qwen's",
    )
    parser.add_argument("--trust-remote-code", action="store_true",
                        help="with --tokenizer: let the folder's own tokenizer code run")
    parser.add_argument(
        "--extract-hidden-states", action="store_true",
        help="with --flavor vllm: play vLLM's extract_hidden_states speculative method with "
        "ExampleHiddenStatesConnector: every /v1/completions request writes a safetensors "
        "file of its prompt's states (under --hs-storage-path) and its reply carries "
        '"kv_transfer_params": {"hidden_states_path": ...}',
    )
    parser.add_argument("--hs-layer-ids", type=_layer_ids, metavar="IDS",
                        help="with --extract-hidden-states: the layers whose states are "
                        "written, e.g. 2,4,5,8 (eagle_aux_hidden_state_layer_ids; profile "
                        "value)")
    parser.add_argument("--hs-metadata", action="store_true",
                        help="with --extract-hidden-states: the files say their layer ids and "
                        "final-norm side in their metadata, as tokencap's connector's do")
    for flag, _field, help_text in _HS_FAULT_FLAGS:
        parser.add_argument(flag, type=float, default=None, metavar="P",
                            help=f"fault: the probability that {help_text}")
    parser.add_argument(
        "--log-level",
        default="INFO",
        choices=("DEBUG", "INFO", "WARNING", "ERROR"),
        help="root log level (%(default)s)",
    )
    return parser


def config_from_args(ns: argparse.Namespace) -> Any:
    """The SimConfig for parsed arguments: profile, then flag overrides."""
    given = ((field, getattr(ns, field)) for _flag, field, _kind, _help in _OVERRIDES)
    changes: dict[str, Any] = {field: value for field, value in given if value is not None}
    if ns.length_profile:
        profile = load_length_profile(ns.length_profile)
        changes["default_length"] = profile.default
        changes["length_profiles"] = dict(profile.categories)
    if ns.faults:
        changes["faults"] = msgspec.json.decode(ns.faults, type=FaultConfig, strict=False)
    hs_faults = {field: getattr(ns, field) for _flag, field, _help in _HS_FAULT_FLAGS
                 if getattr(ns, field) is not None}
    if hs_faults:
        base = changes.get("faults", PROFILES[ns.profile].faults)
        changes["faults"] = msgspec.structs.replace(base, **hs_faults)
    if ns.extract_hidden_states:
        changes["extract_hidden_states"] = True
    if ns.hs_layer_ids is not None:
        changes["hs_layer_ids"] = ns.hs_layer_ids
    if ns.hs_metadata:
        changes["hs_metadata"] = True
    if ns.tokenizer:
        changes["tokenizer"] = ns.tokenizer
    if ns.family:
        changes["family"] = ns.family
    if ns.trust_remote_code:
        changes["trust_remote_code"] = True
    config = msgspec.structs.replace(PROFILES[ns.profile], **changes)
    config.validate()
    return config


async def _serve(ns: argparse.Namespace) -> None:
    config = config_from_args(ns)
    runner, _port = await start_server(config, ns.host, ns.port)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        logger.info("shutting down")
        await runner.cleanup()


def main(argv: Sequence[str] | None = None) -> int:
    ns = build_parser().parse_args(argv)
    logging.basicConfig(
        level=ns.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        asyncio.run(_serve(ns))
    except (ValueError, OSError, msgspec.DecodeError) as exc:
        logger.error("cannot start: %s", exc)
        return EXIT_BAD_CONFIG
    return 0


if __name__ == "__main__":
    sys.exit(main())
