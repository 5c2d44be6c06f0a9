"""aiohttp app speaking SGLang's native HTTP protocol on top of the simulated engine.

SGLang routes: ``POST|PUT /generate``, ``GET /health`` and ``/health_generate``,
``GET /server_info`` (alias ``/get_server_info``), ``GET /model_info`` (alias
``/get_model_info``), ``GET /v1/models``, ``GET /get_load``, ``GET|POST /flush_cache``,
``POST /abort_request``, ``GET /metrics``. The server calls itself a simulator: model path
``tokencap-sglang-sim``, ``"simulator": true`` in ``/server_info``, a WARNING at start.

Simulator-only routes (not SGLang):

- ``GET /_sim/stats``: engine counters and histograms (see ``Engine.stats``) plus
  ``requests_total`` (``/generate`` requests received, whatever their outcome),
  ``responses_by_status`` and ``faults_injected``;
- ``POST /_sim/reset_stats``: zero them;
- ``POST /_sim/pause`` and ``POST /_sim/resume``: freeze and restart the simulated clock
  (requests are still accepted while paused, so a load can be queued at one instant);
- ``GET /_sim/faults``: the fault knobs (``FaultConfig`` as JSON);
- ``POST /_sim/faults``: change the knobs named in the JSON body, keep the others.

With ``extract_hidden_states`` (vllm flavor), every ``/v1/completions`` request writes its
hidden-state file before the reply and the reply carries ``"kv_transfer_params":
{"hidden_states_path": ...}`` (`sglang_sim.hidden`).

The optional request header ``X-Tokencap-Category`` picks the output-length distribution.
``meta_info.e2e_latency`` is wall-clock seconds, as the client saw them; simulated-time figures
are in ``/_sim/stats``.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import struct
import time
import uuid
from collections import Counter, deque
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

import msgspec
from aiohttp import web

from sglang_sim import hidden, info
from sglang_sim.config import VLLM_VERSION, SimConfig, version
from sglang_sim.faults import FaultInjector
from sglang_sim.jobs import DuplicateRidError, Job, QueueFullError
from sglang_sim.metrics import LatencyHistogram, render, split
from sglang_sim.outputs import natural_length, output_ids, render_text, request_seed
from sglang_sim.prefix_cache import RadixCache
from sglang_sim.protocol import (
    ApiError,
    ValidRequest,
    bad_request,
    parse_completion,
    parse_generate,
    queue_full,
    schema_error,
    validate_generate,
)
from sglang_sim.scheduler import Engine
from sglang_sim.text import TextOutputs

logger = logging.getLogger(__name__)

CATEGORY_HEADER = "X-Tokencap-Category"
SHUTDOWN_TIMEOUT_S = 5.0
FLUSH_CACHE_TEXT = (
    "Cache flushed.\nPlease check backend logs for more details. (When there are running or "
    "waiting requests, the operation will not be performed.)\n"
)
_LINGER_RESET = struct.pack("ii", 1, 0)  # SO_LINGER on, 0 s: close() sends a TCP RST

ENGINE_KEY = web.AppKey("engine", Engine)
FAULTS_KEY = web.AppKey("faults", FaultInjector)
CONFIG_KEY = web.AppKey("config", SimConfig)
E2E_KEY = web.AppKey("e2e", LatencyHistogram)
TASK_KEY = web.AppKey("engine_task", asyncio.Task)
# "requests_total" and one count per HTTP status of /generate replies.
HTTP_KEY = web.AppKey("http_counts", Counter)
TEXT_KEY = web.AppKey("text_outputs", TextOutputs)
CACHE_KEY = web.AppKey("prefix_cache", RadixCache)
# the sampling params of the last requests, as received (`GET /_sim/requests`)
REQUESTS_KEY: web.AppKey[deque[dict[str, Any]]] = web.AppKey("request_log", deque)
REQUEST_LOG_SIZE = 10_000


def _json(body: Any, status: int = 200, headers: dict[str, str] | None = None) -> web.Response:
    return web.Response(
        body=msgspec.json.encode(body),
        status=status,
        headers=headers,
        content_type="application/json",
    )


def _error(exc: ApiError) -> web.Response:
    if isinstance(exc.body, str):  # SGLang's uncaught errors: plain text
        return web.Response(text=exc.body, status=exc.status, headers=exc.headers)
    return _json(exc.body, exc.status, exc.headers)


def _vllm_error(exc: ApiError) -> web.Response:
    """An error as vLLM's OpenAI server writes it."""
    if isinstance(exc.body, dict) and isinstance(exc.body.get("error"), dict):
        message = str(exc.body["error"].get("message", ""))
    elif isinstance(exc.body, dict):
        message = str(exc.body.get("error") or exc.body.get("message") or "")
    else:
        message = exc.body
    kind = {400: "BadRequestError", 404: "NotFoundError", 503: "ServiceUnavailableError"}
    return _json({"error": {"message": message, "type": kind.get(exc.status, "InternalError"),
                            "param": None, "code": exc.status}}, exc.status, exc.headers)


FORCING_BIAS = 100.0  # vLLM's and SGLang's largest logit bias: that token is sampled


def build_job(
    valid: ValidRequest, config: SimConfig, category: str | None, text: TextOutputs | None = None,
    cached: int = 0, shape_of: Callable[[int], str] | None = None,
) -> tuple[Job, int, int, list[int] | None]:
    """The engine job of a validated request, with its output seed, natural length and, for
    a simulator with a tokenizer, its whole text-like answer (None: random ids)."""
    seed = request_seed(valid.input_ids, valid.sampling_seed, config.seed)
    natural = max(natural_length(seed, config.length_for(category)), valid.min_new_tokens)
    answer = None
    forced = [int(t) for t, bias in (valid.sampling.get("logit_bias") or {}).items()
              if float(bias) >= FORCING_BIAS]
    if forced and not valid.ignore_eos:  # a bias that makes one token the only likely one
        ends = {config.eos_token_id, *valid.stop_token_ids}
        answer = [forced[0]] if forced[0] in ends else [forced[0]] * valid.max_new_tokens
        natural = len(answer)
    elif text is not None and not valid.ignore_eos:
        shape = shape_of(seed) if shape_of is not None else ""
        answer = text.natural_ids(seed, natural, valid.input_ids, shape)
        stops = set(valid.stop_token_ids)
        cut = next((k for k, t in enumerate(answer) if t in stops), None)
        if cut is not None:  # an engine stops at the first stop id it generates
            answer = answer[:cut + 1]
        if len(answer) >= valid.min_new_tokens:
            natural = len(answer)
        else:
            answer = None
    cap = valid.max_new_tokens
    if valid.ignore_eos or cap <= natural:
        target, reason = cap, {"type": "length", "length": cap}
    else:
        matched = answer[-1] if answer else config.eos_token_id
        target, reason = natural, {"type": "stop", "matched": matched}
    job = Job(valid.rid, len(valid.input_ids), cap, target, reason, cached)
    return job, seed, natural, answer


def sim_stats(app: web.Application) -> dict[str, Any]:
    """The ``/_sim/stats`` body: engine stats plus HTTP and fault counters."""
    stats = app[ENGINE_KEY].stats()
    http = app[HTTP_KEY]
    stats["requests_total"] = http["requests_total"]
    stats["responses_by_status"] = {k: v for k, v in sorted(http.items()) if k.isdigit()}
    stats["faults_injected"] = app[FAULTS_KEY].counts()
    return stats


def reset_sim_stats(app: web.Application) -> None:
    """Zero every counter of ``/_sim/stats``; requests in flight are untouched."""
    app[ENGINE_KEY].reset_stats()
    app[FAULTS_KEY].reset_counts()
    app[HTTP_KEY].clear()


def _drop_connection(request: web.Request) -> None:
    transport = request.transport
    if transport is None:
        return
    sock = transport.get_extra_info("socket")
    if sock is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _LINGER_RESET)
    transport.abort()


async def generate(request: web.Request) -> web.StreamResponse:
    """``/generate``, counted in ``requests_total`` and ``responses_by_status``."""
    return await _counted(request, _generate)


async def completions(request: web.Request) -> web.StreamResponse:
    """vLLM's ``/v1/completions`` (token-id prompts), counted like ``/generate``."""
    return await _counted(request, _completions)


async def _counted(request: web.Request, handler: Any) -> web.StreamResponse:
    http = request.app[HTTP_KEY]
    http["requests_total"] += 1
    response = await handler(request)
    http[str(response.status)] += 1
    return response


class _Done:
    """A request the engine finished: its ids and what the reply reports."""

    def __init__(self, valid: ValidRequest, done: Any, ids: list[int], reported: int,
                 text: str, cached: int = 0, hs_path: str | None = None) -> None:
        self.valid, self.done, self.ids, self.reported, self.text, self.cached = (
            valid, done, ids, reported, text, cached)
        self.hs_path = hs_path


async def _write_states(app: web.Application, request_id: str, token_ids: list[int]) -> str:
    """The request's hidden-state file, written (under its lock) before the reply, as
    vLLM's ExampleHiddenStatesConnector does; its path."""
    config = app[CONFIG_KEY]
    assert config.hs_storage_path is not None  # validated
    path = hidden.path_for(config.hs_storage_path, request_id)
    damage = app[FAULTS_KEY].hs_damage()

    def write() -> None:
        data = hidden.file_parts(token_ids, config.hs_layer_ids, config.hs_hidden_size,
                                 config.hs_dtype, damage, config.vocab_size,
                                 table=config.hs_states == "table",
                                 metadata=config.hs_metadata)
        hidden.write_locked(path, data)

    await asyncio.to_thread(write)
    return str(path)


async def _run(request: web.Request, parsed: Any,
               kv_transfer_params: dict[str, Any] | None = None) -> _Done:
    """Fault injection, SGLang's checks, the engine, the ids: what both APIs share. With
    ``kv_transfer_params`` (vLLM with extract_hidden_states), the hidden-state file too."""
    app = request.app
    config, engine, faults = app[CONFIG_KEY], app[ENGINE_KEY], app[FAULTS_KEY]
    app[REQUESTS_KEY].append(parsed.sampling_params)
    fault = faults.before_generate(parsed.input_ids)
    if fault is not None:
        raise fault
    valid = validate_generate(parsed, config)
    text = app.get(TEXT_KEY)
    cache = app[CACHE_KEY]
    cached = cache.match(valid.input_ids)
    job, seed, natural, answer = build_job(valid, config, request.headers.get(CATEGORY_HEADER),
                                           text, cached, faults.reply_shape)
    try:
        done = await engine.generate(job)
    except QueueFullError as exc:
        raise queue_full() from exc
    except DuplicateRidError as exc:
        raise bad_request(f"Duplicate request ID detected: {job.rid}") from exc
    if answer is not None:
        ids = answer[: done.completion_tokens]
    else:
        ids = output_ids(seed, done.completion_tokens, natural, vocab_size=config.vocab_size,
                         eos_token_id=config.eos_token_id, ignore_eos=valid.ignore_eos)
    app[E2E_KEY].observe(done.e2e_latency_s)
    cache.insert([*valid.input_ids, *ids][:-1])  # the last token's KV was never computed
    http = app[HTTP_KEY]
    http["prefix_cache_queries"] += len(valid.input_ids)
    http["prefix_cache_hits"] += cached
    http["prompt_tokens"] += len(valid.input_ids)
    http["generation_tokens"] += len(ids)
    hs_path = None
    if kv_transfer_params is not None:  # the prompt, and with include_output_tokens the
        # output but its last token (whose states were never computed)
        stored = list(valid.input_ids)
        if kv_transfer_params.get("include_output_tokens"):
            stored += ids[:-1]
        # vLLM's internal request id: cmpl-<the request's id>-<prompt index>-<8 random hex>
        hs_path = await _write_states(app, f"cmpl-{done.rid}-0-{uuid.uuid4().hex[:8]}",
                                      stored)
    if faults.should_reset():
        logger.info("simulated fault: dropping the connection of %s", done.rid)
        _drop_connection(request)
        # End the handler as a cancelled one, so aiohttp writes nothing to the dead socket.
        raise asyncio.CancelledError
    reported = done.completion_tokens + int(faults.should_bad_count())
    decoded = text.decode(ids) if text is not None else render_text(ids, config.eos_token_id)
    stall_s = faults.stall_s()
    if stall_s > 0:
        await asyncio.sleep(stall_s)
    return _Done(valid, done, ids, reported, decoded, cached, hs_path)


async def _body(request: web.Request) -> Any:
    try:
        return await request.json(loads=msgspec.json.decode)
    except (msgspec.DecodeError, ValueError) as exc:
        raise schema_error(f"JSON decode error: {exc}") from exc


async def _completions(request: web.Request) -> web.StreamResponse:
    config = request.app[CONFIG_KEY]
    try:
        body = await _body(request)
        parsed, want_ids, max_tokens = parse_completion(body, config)
        kv_params = None
        if config.extract_hidden_states:
            given = body.get("kv_transfer_params")
            kv_params = given if isinstance(given, dict) else {}
        r = await _run(request, parsed, kv_params)
    except ApiError as exc:
        return _vllm_error(exc)
    fr = r.done.finish_reason
    stop = fr.get("type") == "stop"
    matched = fr.get("matched")
    reply: dict[str, Any] = {
        "id": f"cmpl-{r.done.rid}", "object": "text_completion", "created": int(time.time()),
        "model": config.model_path,
        "choices": [{
            "index": 0, "text": r.text, "logprobs": None,
            "finish_reason": "stop" if stop else "length",
            # vLLM: None for the model's EOS, the id of another stop token
            "stop_reason": None if matched == config.eos_token_id else matched,
            "token_ids": r.ids if want_ids else None,
            "prompt_logprobs": None,
            "prompt_token_ids": parsed.input_ids if want_ids else None,
        }],
        "usage": {"prompt_tokens": r.done.prompt_tokens, "completion_tokens": r.reported,
                  "total_tokens": r.done.prompt_tokens + r.reported,
                  # as vLLM with --enable-prompt-tokens-details
                  "prompt_tokens_details": {"cached_tokens": r.cached},
                  "completion_tokens_details": None},
    }
    if r.hs_path is not None:
        reply["kv_transfer_params"] = {"hidden_states_path": r.hs_path}
    return _json(reply)


async def _generate(request: web.Request) -> web.StreamResponse:
    app = request.app
    config = app[CONFIG_KEY]
    release = version(config.sglang_version)
    try:
        r = await _run(request, parse_generate(await _body(request), config))
    except ApiError as exc:
        return _error(exc)
    ids = r.ids
    if (0, 5, 1) <= release < (0, 5, 5):  # output_ids start with prompt ids (#17240)
        ids = r.valid.input_ids[-min(5, len(r.valid.input_ids)):] + ids
    done = r.done
    reply: dict[str, Any] = {
        "text": r.text,
        "output_ids": ids,
        "meta_info": {
            "id": done.rid,
            "finish_reason": done.finish_reason,
            "prompt_tokens": done.prompt_tokens,
            "weight_version": config.weight_version,
            "num_retractions": done.num_retractions,
            "reasoning_tokens": 0,
            "completion_tokens": r.reported,
            "cached_tokens": r.cached,
            "e2e_latency": done.e2e_latency_s,
        },
    }
    if release < (0, 5, 1):  # output_ids only with --skip-tokenizer-init before 0.5.1
        del reply["output_ids"]
    return _json(reply)


OPEN_PATHS = ("/health", "/health_generate", "/metrics", "/_sim/")


@web.middleware
async def _api_key(request: web.Request, handler: Any) -> web.StreamResponse:
    """`--api-key`: SGLang checks every route but /health* and /metrics; vLLM only /v1/*."""
    config = request.app[CONFIG_KEY]
    path = request.path
    guarded = path.startswith("/v1/") if config.flavor == "vllm" else not path.startswith(
        OPEN_PATHS)
    if guarded and request.headers.get("Authorization") != f"Bearer {config.api_key}":
        return _json({"error": "Unauthorized"}, 401)
    return await handler(request)


async def vllm_version(request: web.Request) -> web.Response:
    return _json({"version": VLLM_VERSION})


async def health(request: web.Request) -> web.Response:
    return web.Response(status=503 if request.app[ENGINE_KEY].closed else 200)


async def server_info(request: web.Request) -> web.Response:
    app = request.app
    sockname = request.transport.get_extra_info("sockname") if request.transport else None
    rate = app[ENGINE_KEY].decode_rate_tok_per_sim_s() * app[CONFIG_KEY].time_scale
    return _json(info.server_info(app[CONFIG_KEY], sockname[1] if sockname else None, rate))


async def model_info(request: web.Request) -> web.Response:
    return _json(info.model_info(request.app[CONFIG_KEY]))


async def list_models(request: web.Request) -> web.Response:
    return _json(info.models_list(request.app[CONFIG_KEY]))


async def get_load(request: web.Request) -> web.Response:
    engine = request.app[ENGINE_KEY]
    stats = engine.stats()
    load = {
        "dp_rank": 0,
        "num_reqs": stats["running"] + stats["queued"],
        "num_waiting_reqs": stats["queued"],
        "num_tokens": stats["kv_used_tokens"],
        "num_pending_tokens": engine.pending_prompt_tokens(),
        "ts_tic": time.time(),
    }
    return _json([load])


async def v1_loads(request: web.Request) -> web.Response:
    """``/v1/loads`` (0.5.9 and later): one entry per DP rank, the requests split across them."""
    config, stats = request.app[CONFIG_KEY], request.app[ENGINE_KEY].stats()
    ranks = config.metrics_dp_ranks
    running, queued = split(stats["running"], ranks), split(stats["queued"], ranks)
    used = split(stats["kv_used_tokens"], ranks)
    loads = [{"dp_rank": i, "num_running_reqs": int(running[i]),
              "num_waiting_reqs": int(queued[i]), "num_used_tokens": int(used[i]),
              "max_running_requests": config.max_running_requests,
              "token_usage": stats["token_usage"]} for i in range(ranks)]
    return _json({"timestamp": datetime.now(UTC).isoformat(),
                  "version": config.sglang_version, "accelerator": None,
                  "num_accelerators": 1, "loads": loads})


async def flush_cache(request: web.Request) -> web.Response:
    idle = request.app[ENGINE_KEY].is_idle()
    return web.Response(text=FLUSH_CACHE_TEXT, status=200 if idle else 400)


async def abort_request(request: web.Request) -> web.Response:
    try:
        body = await request.json(loads=msgspec.json.decode)
    except (msgspec.DecodeError, ValueError) as exc:
        return _error(schema_error(f"JSON decode error: {exc}"))
    if not isinstance(body, dict):
        return _error(schema_error("Input should be a valid dictionary or object"))
    rid, abort_all = body.get("rid") or "", bool(body.get("abort_all"))
    if not isinstance(rid, str):
        return _error(schema_error("rid: Input should be a valid string"))
    if not rid and not abort_all:
        logger.warning("Empty rid would startswith-match every request; ignored")
    found = request.app[ENGINE_KEY].abort(rid, abort_all=abort_all)
    logger.info("abort_request rid=%r abort_all=%s matched %d", rid, abort_all, found)
    return web.Response(status=200)


async def metrics(request: web.Request) -> web.Response:
    app = request.app
    engine, config = app[ENGINE_KEY], app[CONFIG_KEY]
    http = app[HTTP_KEY]
    text = render(
        {**engine.stats(), "prefix_cache_queries": http["prefix_cache_queries"],
         "prefix_cache_hits": http["prefix_cache_hits"], "prompt_tokens": http["prompt_tokens"],
         "generation_tokens": http["generation_tokens"]},
        model_name=config.model_path,
        gen_throughput_tok_s=engine.decode_rate_tok_per_sim_s() * config.time_scale,
        e2e=app[E2E_KEY],
        flavor=config.flavor,
        dp_ranks=config.metrics_dp_ranks,
        tp_ranks=config.metrics_tp_ranks,
        priority=config.metrics_priority,
    )
    return web.Response(text=text, content_type="text/plain", charset="utf-8")


async def get_stats(request: web.Request) -> web.Response:
    return _json(sim_stats(request.app))


async def get_requests(request: web.Request) -> web.Response:
    """The sampling params of the last `REQUEST_LOG_SIZE` requests, oldest first."""
    log: deque[dict[str, Any]] = request.app[REQUESTS_KEY]
    return _json(list(log))


async def reset_stats(request: web.Request) -> web.Response:
    reset_sim_stats(request.app)
    return _json(sim_stats(request.app))


async def pause(request: web.Request) -> web.Response:
    request.app[ENGINE_KEY].pause()
    return _json(sim_stats(request.app))


async def resume(request: web.Request) -> web.Response:
    request.app[ENGINE_KEY].resume()
    return _json(sim_stats(request.app))


async def get_faults(request: web.Request) -> web.Response:
    return _json(request.app[FAULTS_KEY].config)


async def post_faults(request: web.Request) -> web.Response:
    try:
        body = await request.json(loads=msgspec.json.decode)
        if not isinstance(body, dict):
            raise ValueError("body must be a JSON object")
        new = request.app[FAULTS_KEY].update(body)
    except (msgspec.DecodeError, ValueError) as exc:
        return _error(bad_request(str(exc)))
    return _json(new)


async def _start_engine(app: web.Application) -> None:
    app[TASK_KEY] = asyncio.create_task(app[ENGINE_KEY].run(), name="sglang_sim.scheduler")


async def _stop_engine(app: web.Application) -> None:
    app[ENGINE_KEY].close()
    task = app.get(TASK_KEY)
    if task is not None:
        await task


VOCAB_ALIGN = 64  # a model's embedding rows: the tokenizer's ids, padded to a multiple


def create_app(config: SimConfig) -> web.Application:
    """The aiohttp application; the engine runs while the app is started. With a tokenizer,
    the vocabulary is the tokenizer's (padded as a model's embedding table is) and the
    end-of-turn id its eos, unless given."""
    config.validate()
    text = TextOutputs(config.tokenizer, config.eos_token_id, config.family,
                       config.trust_remote_code) if config.tokenizer else None
    if text is not None:
        n = len(text.tokenizer)
        padded = -(-n // VOCAB_ALIGN) * VOCAB_ALIGN
        if config.vocab_size < n:
            config = msgspec.structs.replace(config, vocab_size=padded)
        text.eos_token_id = config.eos_token_id if config.eos_token_id < n else \
            int(text.tokenizer.eos_token_id or 0)
    app = web.Application(middlewares=[_api_key] if config.api_key else [])
    app[CONFIG_KEY] = config
    app[ENGINE_KEY] = Engine(config)
    app[FAULTS_KEY] = FaultInjector(config.faults, config.seed)
    app[E2E_KEY] = LatencyHistogram()
    app[HTTP_KEY] = Counter()
    app[REQUESTS_KEY] = deque(maxlen=REQUEST_LOG_SIZE)
    if text is not None:
        app[TEXT_KEY] = text
    app[CACHE_KEY] = RadixCache(config.prefix_cache_tokens, config.page_tokens())
    app.on_startup.append(_start_engine)
    app.on_shutdown.append(_stop_engine)
    r = app.router
    release = version(config.sglang_version)
    if config.flavor == "vllm":
        r.add_post("/v1/completions", completions)
        r.add_get("/version", vllm_version)
        r.add_get("/health", health)
    else:
        for method in ("POST", "PUT"):
            r.add_route(method, "/generate", generate)
        for path in ("/health", "/health_generate"):
            r.add_get(path, health)
        # /server_info and /model_info from 0.5.9; the get_ names stay as aliases
        names = ("", "get_") if release >= (0, 5, 9) else ("get_",)
        for prefix in names:
            r.add_get(f"/{prefix}server_info", server_info)
            r.add_get(f"/{prefix}model_info", model_info)
        if release >= (0, 5, 9):
            r.add_get("/v1/loads", v1_loads)
        if release < (0, 5, 23):  # removed in 0.5.23
            r.add_get("/get_load", get_load)
        r.add_get("/flush_cache", flush_cache)
        r.add_post("/flush_cache", flush_cache)
        r.add_post("/abort_request", abort_request)
    r.add_get("/v1/models", list_models)
    r.add_get("/metrics", metrics)
    r.add_get("/_sim/stats", get_stats)
    r.add_get("/_sim/requests", get_requests)
    r.add_post("/_sim/reset_stats", reset_stats)
    r.add_post("/_sim/pause", pause)
    r.add_post("/_sim/resume", resume)
    r.add_get("/_sim/faults", get_faults)
    r.add_post("/_sim/faults", post_faults)
    return app


async def start_server(config: SimConfig, host: str, port: int) -> tuple[web.AppRunner, int]:
    """Start serving ``config`` on host:port (0 = any free port); return runner and port.

    Handlers are cancelled when their client disconnects, which aborts the request in the
    engine, as SGLang does. Stop with ``await runner.cleanup()``.
    """
    app = create_app(config)
    runner = web.AppRunner(
        app,
        handler_cancellation=True,
        access_log=None,
        shutdown_timeout=SHUTDOWN_TIMEOUT_S,
    )
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    bound = runner.addresses[0][1]
    logger.warning(
        "sglang_sim: this is a SIMULATOR, not SGLang: no model runs and outputs are synthetic "
        "(model_path=%s, time_scale=%g, max_running_requests=%d) on http://%s:%d",
        config.model_path,
        config.time_scale,
        config.max_running_requests,
        host,
        bound,
    )
    return runner, bound
