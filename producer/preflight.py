"""Before the first sample is fed: every engine is reachable, speaks a protocol version
tokencap reads, and serves the model the run's tokenizer belongs to.

Per engine (`foundation.engine.info.discover`): its API, served model, version and context
length; then one probe generation of a fixed short chat prompt (greedy, 16 tokens) sent
exactly as samples are, whose reply must have the right shape (SGLang 0.5.1 or later: token
ids in the reply; vLLM 0.10.2 or later: `return_token_ids`) and whose ids must lie in the
tokenizer's vocabulary; a probe that SGLang reports stopped on a token must have stopped on
one of the tokenizer's end-of-turn ids (its eos token, and the generation config's
`eos_token_id`); and, where SGLang tells it, the engine's vocabulary size must be the
tokenizer's (a model's embedding table may be padded past the tokenizer: up to
`VOCAB_PADDING` ids). A mismatch raises `EngineUnusable` (exit 9) naming both sides, before
anything is enqueued. A simulator passes, and says so: its rows are labelled simulated.

What a later try may change (no connection yet, a reset, a timeout, 429 or any 5xx:
`EngineNotReady`) is tried again with the worker's backoff (`retry_delay_s`), each wait
logged (`waiting for engine URL (503), 3rd try, up to 20 s`), for `preflight_wait_s`; then,
or at once for what retrying cannot change (another model, too old, no output ids, a refused
key), the run stops with exit 9 and says which.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

import msgspec
import requests

from foundation import hsfile
from foundation.config import RunConfig
from foundation.engine.api import (
    EngineError,
    EngineSpec,
    Generation,
    engine_specs,
    error_message,
    parse,
    request,
    retry_delay_s,
    transient_status,
)
from foundation.engine.info import EngineInfo, discover, vocab_size, why_unreachable
from foundation.errors import EngineNotReady, EngineUnusable, TokencapError

if TYPE_CHECKING:
    from producer.render import Renderer

log = logging.getLogger(__name__)

PROBE_MESSAGES = [{"role": "user", "content": "Say hello in one short sentence."}]
PROBE_IDS = [1, 2, 3, 4]  # a run of token-id prompts only (no tokenizer): any small ids
PROBE_SAMPLING = {"max_new_tokens": 16, "temperature": 0.0}
PROBE_TIMEOUT_S = (3.05, 120.0)
VOCAB_PADDING = 1024  # ids a model's vocabulary may have past its tokenizer's (Qwen2.5: 271)
T = TypeVar("T")


def preflight(cfg: RunConfig, urls: list[str], renderer: Renderer | None,
              sleep: Callable[[float], None] = time.sleep) -> list[EngineInfo]:
    """Check every engine of `urls` (module docstring); return what each serves."""
    specs = engine_specs(urls)
    if not specs:
        raise TokencapError("no engine: set SGLANG_URL (or --sglang-url) to your SGLang or "
                            "vLLM server, or pass --sim to run on the simulator")
    infos = []
    for spec in specs:

        def check(spec: EngineSpec = spec) -> EngineInfo:
            info = discover(spec)
            if cfg.stage == "hidden_states" and info.api == "sglang":
                raise EngineUnusable(
                    f"engine {spec.url} is SGLang: stock SGLang returns the last layer's "
                    "state only (return_hidden_states), not EAGLE-3's three layers and the "
                    "pre-norm last one; extract with vLLM (docs/HIDDEN_STATES.md)")
            folder = _probe(spec, info, renderer, cfg)
            return msgspec.structs.replace(info, states_folder=folder) if folder else info

        info = until_ready(spec.url, check, cfg.preflight_wait_s, cfg.backoff_max_s, sleep)
        log.info("engine %s: %s API, model %r, version %s, context %s%s", spec.url, info.api,
                 info.model, info.version or "?", info.context_length or "?",
                 " -- a SIMULATOR: its outputs are synthetic" if info.simulated else "")
        infos.append(info)
    return infos


def until_ready(url: str, check: Callable[[], T], wait_s: float, backoff_max_s: float,
                sleep: Callable[[float], None] = time.sleep,
                clock: Callable[[], float] = time.monotonic) -> T:
    """`check()`, tried again while it raises `EngineNotReady` and `wait_s` has not passed
    since the first try (waits as the worker's client backs off, logged); then the last
    error, saying how long it waited."""
    start = clock()
    failed = 0
    while True:
        try:
            return check()
        except EngineNotReady as exc:
            failed += 1
            left = start + wait_s - clock()
            if left <= 0:
                tries = f"{failed} tries" if failed > 1 else "1 try"
                raise EngineUnusable(f"{exc} (still after {tries} in {clock() - start:.0f} s; "
                                     f"preflight_wait_s = {wait_s:g})") from None
            log.warning("waiting for engine %s (%s), %s try, up to %g s", url, exc.reason,
                        _ordinal(failed + 1), wait_s)
            sleep(min(retry_delay_s(failed, backoff_max_s), left))


def _ordinal(n: int) -> str:
    suffix = "th" if 10 <= n % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"{n}{suffix}"


def _probe(spec: EngineSpec, info: EngineInfo, renderer: Renderer | None,
           cfg: RunConfig) -> str | None:
    """One generation, sent as samples are, checked against the tokenizer; for a
    hidden-state stage, its file checked, and the folder the server writes files in
    returned."""
    ids = renderer.render(PROBE_MESSAGES)[1] if renderer is not None else PROBE_IDS
    path, body = request(info.api, ids, PROBE_SAMPLING, f"tokencap-probe-{uuid.uuid4().hex}")
    who = f"engine {spec.url} ({info.api} {info.version or 'version ?'}, model " \
          f"{info.model or '?'})"
    try:
        r = requests.post(f"{spec.url}{path}", data=body, timeout=PROBE_TIMEOUT_S,
                          headers={"Content-Type": "application/json", **spec.headers()})
    except requests.RequestException as exc:
        why = why_unreachable(exc, PROBE_TIMEOUT_S)
        raise EngineNotReady(f"{who}: the probe generation failed ({why})", why) from None
    if r.status_code != 200:
        failed = f"{who}: the probe generation failed: HTTP {r.status_code}: " \
                 f"{error_message(r.content)}"
        if transient_status(r.status_code):
            raise EngineNotReady(failed, str(r.status_code))
        raise EngineUnusable(failed)
    try:
        gen = parse(info.api, r.content, len(ids), spec.url, 0.0)
    except EngineError as exc:
        raise EngineUnusable(f"{who}: {exc}") from None
    if cfg.stage == "hidden_states":
        return _probe_states(who, gen, ids, cfg)
    if renderer is None:
        return None
    n = int(renderer.vocab_size)
    tok = cfg.tokenizer
    outside = [t for t in gen.output_ids if t >= n]
    if outside:
        raise EngineUnusable(f"{who} does not serve the tokenizer's model: the probe "
                             f"generation returned id {outside[0]}, outside the {n} ids of "
                             f"the tokenizer {tok}. Point the run at the served model's "
                             "tokenizer (or the engine at the tokenizer's model).")
    eot = end_of_turn_ids(cfg, renderer)
    matched = gen.finish.get("matched") if info.api != "openai" else None
    if gen.finish_reason == "stop" and isinstance(matched, int) and eot and matched not in eot:
        raise EngineUnusable(f"{who} does not serve the tokenizer's model: the probe "
                             f"generation stopped on id {matched}, the end-of-turn ids of the "
                             f"tokenizer {tok} are {sorted(eot)}. Point the run at the served "
                             "model's tokenizer (or the engine at the tokenizer's model).")
    v = vocab_size(spec) if info.api != "openai" else None
    if v is not None and not n <= v <= n + VOCAB_PADDING:
        raise EngineUnusable(f"{who} does not serve the tokenizer's model: its vocabulary has "
                             f"{v} ids, the tokenizer {tok} has {n}. Point the run at the "
                             "served model's tokenizer (or the engine at the tokenizer's "
                             "model).")
    log.info("%s: probe ok (%d ids, finish %s)", who, len(gen.output_ids), gen.finish)
    return None


def _probe_states(who: str, gen: Generation, ids: list[int], cfg: RunConfig) -> str:
    """The extraction server's file for the probe, checked before any row is sent: the
    blocker named when it cannot extract (not vLLM's extract_hidden_states, the connector
    not loaded, other layers, states all zero). Returns the folder it writes files in."""
    hs = cfg.states()
    if not gen.hidden_states_path:
        raise EngineUnusable(
            f"{who} gave no hidden-state file (kv_transfer_params.hidden_states_path): it is "
            "not a vLLM server started with --speculative-config method "
            "extract_hidden_states and --kv-transfer-config naming a hidden-state connector "
            "(docs/HIDDEN_STATES.md gives the command line)")
    src = gen.hidden_states_path
    try:
        tensors, meta = hsfile.decode(hsfile.map_engine_file(src), src)
        layers = hsfile.check_row_file(src, tensors, meta, ids, hs.layers, hs.hidden_size,
                                       hsfile.DTYPE_NAMES[hs.dtype], engine_file=True)
    except OSError as exc:
        raise EngineUnusable(f"{who}: cannot read its hidden-state file {src} "
                             f"({exc.strerror or exc}): tokencap's workers must see the "
                             "engine's shared_storage_path at the same path") from None
    except hsfile.BadFile as exc:
        hint = {"shape": f"; the config asks for layers {list(hs.layers)} of a model with "
                         f"hidden size {hs.hidden_size}: start the server with "
                         f"eagle_aux_hidden_state_layer_ids = {list(hs.layers)}",
                "dtype": f"; the config asks for {hs.dtype}: set hidden_states.dtype to what "
                         "the server writes (its --dtype), or fp8_e4m3"}
        raise EngineUnusable(f"{who}: its hidden states fail a check [{exc.reason}]: {exc}"
                             f"{hint.get(exc.reason, '')}") from None
    finally:
        hsfile.remove_engine_file(src)
    engine_dtype = tensors["hidden_states"].dtype
    log.info("%s: hidden states ok (layers %s, hidden size %s, %s%s)", who, list(hs.layers),
             hs.hidden_size, hs.dtype,
             f"; the workers quantize the server's {engine_dtype} to FP8" if
             hs.dtype == "fp8_e4m3" and engine_dtype != hsfile.FP8 else "")
    if layers.read_from != "file":
        log.warning("%s: its files do not say which layers they hold (vLLM's stock connector): "
                    "the layer ids %s cannot be checked, only their number; tokencap's "
                    "connector (tokencap.engine_side.vllm_connector, docs/HIDDEN_STATES.md) "
                    "writes them into every file, and then a server started with other ids "
                    "is refused", who, list(hs.layers))
    return str(Path(src).parent)


def end_of_turn_ids(cfg: RunConfig, renderer: Renderer | None) -> set[int]:
    """The ids a generation of the tokenizer's model ends on: the tokenizer's eos token, the
    generation config's `eos_token_id`, and the family's own (gpt-oss's <|call|>, Llama's
    <|eom_id|>): `ReplyParser.end_of_turn_ids`."""
    from producer.reply_parser import reply_parser

    return set(reply_parser(cfg, renderer).end_of_turn_ids)
