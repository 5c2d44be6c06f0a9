"""A minimal SGLang-protocol server on transformers + torch, with RANDOM weights.

This is a plumbing check, not a model: a small Qwen2-architecture causal LM is built from
a config with randomly initialised (seeded) weights; nothing is downloaded. Its outputs are
noise, but they are produced by a real `model.generate` loop on the GPU (CUDA when
available, else the CPU), so tokencap's workers, budget and writer run against real
generation latencies, batching and token ids.

Routes (SGLang's shapes, as in SGLang's http_server.py and io_struct.py):

- ``POST|PUT /generate``: ``{"input_ids": [...] | "text": "...", "sampling_params": {...},
  "rid": "..."}`` -> ``{"text", "output_ids", "meta_info": {"id", "finish_reason",
  "prompt_tokens", "completion_tokens", "cached_tokens", "e2e_latency", ...}}``;
  ``finish_reason`` is ``{"type": "stop", "matched": <id>}`` or
  ``{"type": "length", "length": N}``; errors are HTTP 400 ``{"error": {"message"}}``.
- ``GET /health``, ``/health_generate``; ``GET /server_info`` (alias ``/get_server_info``)
  with ``context_length``, ``"simulator": false``, ``"engine": "hf-random-weights"``,
  ``"random_weights": true`` and the engine's counters; ``GET /model_info``;
  ``GET /v1/models`` (``max_model_len``); ``GET /metrics`` (Prometheus text:
  ``sglang:num_running_reqs``, ``sglang:num_queue_reqs``, ``sglang:gen_throughput``,
  ``sglang:token_usage`` (always 0), token and request counters).
- ``GET /_engine/stats``: the counters as JSON; ``POST /_engine/benchmark``: one synthetic
  batch of n rows x s steps, timed (not SGLang).

Batching: a request waits in a queue for others: until as many requests are waiting as the
previous batch had (its clients usually come back together), then while more keep arriving
with gaps under ``--batch-wait-ms`` (5 ms); never longer than ``--batch-max-wait-ms`` (300 ms)
after the first. Then up to ``--max-batch`` requests are generated together with one
``model.generate`` call (left padding + attention mask, ``max_new_tokens`` = the batch's
largest). Sampling parameters
are applied per row by a logits processor (temperature, top_k, top_p, min_p; temperature 0
is greedy), and a per-row stopping criterion ends each row at its own ``max_new_tokens`` or
its first stop token (EOS ``<|im_end|>`` unless ``ignore_eos``, plus ``stop_token_ids``).
Each reply is cut there: ``finish_reason`` ``stop`` (the matched id is the last output id,
as in SGLang) or ``length``.

Random weights almost never pick EOS by themselves (about 1 in 150,000 per token). So that
the ``stop`` path and varied output lengths are exercised too, ``--stop-prob P`` (default
0.005) sets the EOS logit of every sampled row after warping so that EOS has probability P
at each step (greedy rows are not changed). ``--stop-prob 0`` turns this off.

Every reply can be appended to ``--reply-log`` (JSONL: rid, sha1 of the prompt ids,
output_ids, text, finish_reason) so a checker can compare what was stored with what was
generated.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import concurrent.futures
import hashlib
import json
import logging
import math
import os
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aiohttp import web

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script: the repository's packages
    sys.path.insert(0, str(ROOT))

from sglang_sim.config import SimConfig  # noqa: E402
from sglang_sim.protocol import TOP_K_ALL, ApiError  # noqa: E402

log = logging.getLogger("hf_engine")

EOS_NAME = "<|im_end|>"
PAD_NAME = "<|endoftext|>"
ENGINE_NAME = "hf-random-weights"
MODEL_PATH = "tokencap-hf-random-qwen2"
RANDOM_WARNING = (
    "hf_engine: the model has RANDOM WEIGHTS (seeded, nothing downloaded): outputs are noise. "
    "This is a plumbing / throughput check of the pipeline around a real generation loop, "
    "not a model."
)
THROUGHPUT_WINDOW_S = 10.0

def prompt_sha(ids: list[int]) -> str:
    """The key a checker uses to find the replies to a prompt."""
    return hashlib.sha1(",".join(map(str, ids)).encode()).hexdigest()


@dataclass
class Req:
    rid: str
    input_ids: list[int]
    max_new: int
    temperature: float
    top_p: float
    top_k: int
    min_p: float
    ignore_eos: bool
    stop_ids: frozenset[int]
    t0: float
    fut: asyncio.Future | None = None
    result: dict[str, Any] = field(default_factory=dict)


@dataclass
class Counters:
    requests: int = 0
    finished: int = 0
    errors: int = 0
    batches: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0   # delivered (after each row's own cut)
    computed_tokens: int = 0     # rows x decode steps, what the GPU actually generated
    busy_s: float = 0.0          # time inside model.generate
    stop: int = 0
    length: int = 0
    max_batch_seen: int = 0
    first_batch_at: float | None = None
    last_batch_at: float | None = None


class Engine:
    """The model, the tokenizer and one `generate_batch` at a time (called from one thread)."""

    def __init__(self, args: argparse.Namespace) -> None:
        import torch
        from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

        self.torch = torch
        self.args = args
        self.tok = AutoTokenizer.from_pretrained(args.tokenizer, local_files_only=True)
        self.tok_len = len(self.tok)
        self.eos = self.tok.convert_tokens_to_ids(EOS_NAME)
        self.pad = self.tok.convert_tokens_to_ids(PAD_NAME)
        vocab = int(math.ceil(self.tok_len / 128) * 128)
        if args.device == "auto":
            self.device = "cuda" if torch.cuda.is_available() else "cpu"
        else:
            self.device = args.device
        if args.dtype == "auto":
            dtype = torch.bfloat16 if self.device.startswith("cuda") else torch.float32
        else:
            dtype = getattr(torch, args.dtype)
        self.dtype = dtype
        heads = args.heads
        kv_heads = args.kv_heads or max(1, heads // 4)
        inter = args.intermediate or int(math.ceil(args.hidden * 2.75 / 64) * 64)
        self.config = Qwen2Config(
            vocab_size=vocab,
            hidden_size=args.hidden,
            intermediate_size=inter,
            num_hidden_layers=args.layers,
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            max_position_embeddings=args.context_length,
            tie_word_embeddings=True,
            bos_token_id=self.pad,
            eos_token_id=self.eos,
            pad_token_id=self.pad,
        )
        torch.manual_seed(args.seed)
        t0 = time.monotonic()
        with torch.device(self.device):  # random init on the GPU: seconds, not minutes
            model = Qwen2ForCausalLM(self.config)
        model.to(device=self.device, dtype=dtype)
        model.eval()
        self.model = model
        self.n_params = sum(p.numel() for p in model.parameters())
        self.gpu_name = torch.cuda.get_device_name(0) if self.device.startswith("cuda") else None
        self.build_s = time.monotonic() - t0
        # what SGLang would accept from a model with this tokenizer and context
        self.protocol = SimConfig(context_length=args.context_length, vocab_size=self.tok_len,
                                  eos_token_id=self.eos,
                                  max_total_tokens=args.context_length * args.max_batch)
        self.counters = Counters()
        self.lock = threading.Lock()
        self.window: collections.deque[tuple[float, int]] = collections.deque()
        self.reply_log: Any = None  # opened by open_reply_log(), after the warm-up
        self.gen_seed = args.seed
        log.warning(RANDOM_WARNING)
        log.warning("hf_engine: Qwen2 %d layers, hidden %d, %d heads (%d kv), vocab %d, "
                    "%.1fM params, %s on %s%s, built in %.1f s", args.layers, args.hidden,
                    heads, kv_heads, vocab, self.n_params / 1e6, str(dtype).replace("torch.", ""),
                    self.device, f" ({self.gpu_name})" if self.gpu_name else "", self.build_s)

    # -- request parsing ---------------------------------------------------------------
    def parse(self, body: Any) -> Req:
        """SGLang's checks and messages, from the simulator's protocol module (the same
        code decides what the simulator refuses); `text` goes through the real tokenizer."""
        from sglang_sim.protocol import parse_generate, validate_generate

        if isinstance(body, dict) and isinstance(body.get("text"), str) \
                and body.get("input_ids") is None:
            ids = self.tok(body["text"], add_special_tokens=False)["input_ids"]
            body = {**{k: v for k, v in body.items() if k != "text"}, "input_ids": ids}
        valid = validate_generate(parse_generate(body, self.protocol), self.protocol)
        sp = valid.sampling
        asked = valid.sampling.get("temperature")
        greedy = sp["top_k"] == 1 and (body.get("sampling_params") or {}).get(
            "temperature") is not None and float(body["sampling_params"]["temperature"]) < 1e-6
        stop_ids = set(valid.stop_token_ids)
        if not valid.ignore_eos:
            stop_ids.add(self.eos)
        top_k = sp["top_k"] if 0 < sp["top_k"] < TOP_K_ALL else 0
        return Req(rid=valid.rid, input_ids=valid.input_ids, max_new=valid.max_new_tokens,
                   temperature=0.0 if greedy else float(asked), top_p=float(sp["top_p"]),
                   top_k=top_k, min_p=float(sp["min_p"]), ignore_eos=valid.ignore_eos,
                   stop_ids=frozenset(stop_ids), t0=time.monotonic())

    # -- generation --------------------------------------------------------------------
    def generate_batch(self, batch: list[Req]) -> None:
        """Generate every request of `batch` together; fill each `req.result`."""
        torch = self.torch
        from transformers import GenerationConfig, LogitsProcessorList, StoppingCriteriaList

        live = [r for r in batch if r.max_new > 0]
        for r in batch:
            if r.max_new == 0:
                self._finish(r, [], {"type": "length", "length": 0})
        if not live:
            return
        n = len(live)
        width = max(len(r.input_ids) for r in live)
        max_new = max(r.max_new for r in live)
        dev = self.device
        input_ids = torch.full((n, width), self.pad, dtype=torch.long)
        mask = torch.zeros((n, width), dtype=torch.long)
        for i, r in enumerate(live):
            input_ids[i, width - len(r.input_ids):] = torch.tensor(r.input_ids, dtype=torch.long)
            mask[i, width - len(r.input_ids):] = 1
        sampler = RowSampler(live, self.eos, self.tok_len, self.args.stop_prob, dev, torch)
        stopper = RowStop(live, width, dev, torch)
        gen_cfg = GenerationConfig(
            max_new_tokens=max_new, do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
            eos_token_id=self.eos, pad_token_id=self.pad, use_cache=True,
        )
        self.gen_seed += 1
        torch.manual_seed(self.gen_seed)
        t0 = time.monotonic()
        with torch.inference_mode():
            out = self.model.generate(
                input_ids=input_ids.to(dev), attention_mask=mask.to(dev),
                generation_config=gen_cfg,
                logits_processor=LogitsProcessorList([sampler]),
                stopping_criteria=StoppingCriteriaList([stopper]),
            )
        gen = out[:, width:].tolist()
        busy = time.monotonic() - t0
        steps = len(gen[0]) if gen else 0
        delivered = 0
        for r, row in zip(live, gen, strict=True):
            row = row[: r.max_new]
            reason: dict[str, Any] = {"type": "length", "length": r.max_new}
            for j, t in enumerate(row):
                if t in r.stop_ids:
                    row = row[: j + 1]
                    reason = {"type": "stop", "matched": t}
                    break
            delivered += len(row)
            self._finish(r, row, reason)
        now = time.time()
        with self.lock:
            c = self.counters
            c.batches += 1
            c.busy_s += busy
            c.computed_tokens += n * steps
            c.max_batch_seen = max(c.max_batch_seen, len(batch))
            c.first_batch_at = c.first_batch_at or now - busy
            c.last_batch_at = now
            self.window.append((now, delivered))
        log.info("batch of %d: %d steps in %.2f s, %d tokens delivered (%.0f tok/s)",
                 n, steps, busy, delivered, delivered / busy if busy else 0.0)
        if self.reply_log:
            for r in batch:
                self.reply_log.write(json.dumps({
                    "rid": r.rid, "prompt_sha1": prompt_sha(r.input_ids),
                    "prompt_tokens": len(r.input_ids), "output_ids": r.result["output_ids"],
                    "text": r.result["text"],
                    "finish_reason": r.result["meta_info"]["finish_reason"]}) + "\n")
            self.reply_log.flush()

    def _finish(self, r: Req, ids: list[int], reason: dict[str, Any]) -> None:
        text = self.tok.decode(ids, skip_special_tokens=False)
        r.result = {
            "text": text,
            "output_ids": ids,
            "meta_info": {
                "id": r.rid,
                "finish_reason": reason,
                "prompt_tokens": len(r.input_ids),
                "weight_version": "random",
                "num_retractions": 0,
                "reasoning_tokens": 0,
                "completion_tokens": len(ids),
                "cached_tokens": 0,
                "e2e_latency": time.monotonic() - r.t0,
            },
        }
        with self.lock:
            c = self.counters
            c.finished += 1
            c.prompt_tokens += len(r.input_ids)
            c.completion_tokens += len(ids)
            if reason["type"] == "stop":
                c.stop += 1
            else:
                c.length += 1

    def open_reply_log(self) -> None:
        if self.args.reply_log:
            self.reply_log = open(self.args.reply_log, "a", encoding="utf-8")

    def throughput(self) -> float:
        """Delivered tokens per second over the last THROUGHPUT_WINDOW_S."""
        now = time.time()
        with self.lock:
            while self.window and self.window[0][0] < now - THROUGHPUT_WINDOW_S:
                self.window.popleft()
            return sum(t for _, t in self.window) / THROUGHPUT_WINDOW_S

    def stats(self) -> dict[str, Any]:
        with self.lock:
            c = dict(vars(self.counters))
        span = ((c["last_batch_at"] or 0) - (c["first_batch_at"] or 0)) or None
        c["delivered_tok_per_busy_s"] = c["completion_tokens"] / c["busy_s"] if c["busy_s"] else 0
        c["computed_tok_per_busy_s"] = c["computed_tokens"] / c["busy_s"] if c["busy_s"] else 0
        c["delivered_tok_per_s_first_to_last_batch"] = (
            c["completion_tokens"] / span if span else 0)
        c["gen_throughput_window"] = self.throughput()
        return c

    def describe(self) -> dict[str, Any]:
        return {
            "engine": ENGINE_NAME, "simulator": False, "random_weights": True,
            "warning": RANDOM_WARNING, "device": self.device, "gpu_name": self.gpu_name,
            "torch_version": self.torch.__version__, "dtype": str(self.dtype),
            "cuda_version": getattr(self.torch.version, "cuda", None),
            "n_params": self.n_params, "hidden": self.args.hidden, "layers": self.args.layers,
            "heads": self.args.heads, "vocab_size": self.config.vocab_size,
            "tokenizer_len": self.tok_len, "eos_token_id": self.eos, "pad_token_id": self.pad,
            "max_batch": self.args.max_batch, "batch_wait_ms": self.args.batch_wait_ms,
            "batch_max_wait_ms": self.args.batch_max_wait_ms,
            "stop_prob": self.args.stop_prob, "seed": self.args.seed,
            "model_build_s": self.build_s,
        }


class RowSampler:
    """Per-row temperature / top_k / top_p / min_p, ignore_eos, and the synthetic stop
    probability; ids past the tokenizer are never sampled. Runs after HF's own processors,
    which are identities here (temperature 1, top_k 0, top_p 1)."""

    def __init__(self, reqs: list[Req], eos: int, tok_len: int, stop_prob: float, dev: str,
                 torch: Any) -> None:
        self.torch = torch
        self.eos, self.tok_len = eos, tok_len
        f = lambda xs: torch.tensor(xs, dtype=torch.float32, device=dev).unsqueeze(1)  # noqa: E731
        self.greedy = torch.tensor([r.temperature < 1e-6 for r in reqs], device=dev)
        self.any_greedy = bool(self.greedy.any())
        self.temp = f([1.0 if r.temperature < 1e-6 else r.temperature for r in reqs])
        vocab_cut = tok_len  # ids past the tokenizer are masked, so k >= tok_len is "all"
        self.kmax = max([r.top_k for r in reqs if 0 < r.top_k < vocab_cut], default=0)
        if self.kmax:
            self.k_idx = torch.tensor([min(r.top_k, self.kmax) - 1 if 0 < r.top_k < vocab_cut
                                       else self.kmax - 1 for r in reqs], device=dev).unsqueeze(1)
            self.k_rows = torch.tensor([0 < r.top_k < vocab_cut for r in reqs],
                                       device=dev).unsqueeze(1)
        self.top_p = f([r.top_p for r in reqs])
        self.any_top_p = any(r.top_p < 1 for r in reqs)
        self.min_p = f([r.min_p for r in reqs])
        self.any_min_p = any(r.min_p > 0 for r in reqs)
        self.ignore_eos = torch.tensor([r.ignore_eos for r in reqs], device=dev)
        self.stop_rows = torch.tensor(
            [(not r.ignore_eos) and r.temperature >= 1e-6 for r in reqs], device=dev)
        self.stop_logit_offset = (math.log(stop_prob / (1 - stop_prob))
                                  if 0 < stop_prob < 1 else None)

    def __call__(self, input_ids: Any, scores: Any) -> Any:
        torch = self.torch
        neg = float("-inf")
        scores = scores.float()  # a copy in HF's float32 already: changed in place below
        if scores.shape[1] > self.tok_len:
            scores[:, self.tok_len:] = neg
        if self.any_greedy:
            best = scores.argmax(dim=1, keepdim=True)
            onehot = torch.full_like(scores, neg).scatter(1, best, 0.0)
            scores = torch.where(self.greedy.unsqueeze(1), onehot, scores)
        scores = scores / self.temp
        if self.kmax:
            kth = scores.topk(self.kmax, dim=1).values.gather(1, self.k_idx)
            scores = scores.masked_fill(self.k_rows & (scores < kth), neg)
        if self.any_top_p:
            sorted_s, order = scores.sort(dim=1, descending=True)
            probs = sorted_s.softmax(dim=1)
            cum = probs.cumsum(dim=1)
            drop_sorted = (cum - probs) > self.top_p
            drop = torch.zeros_like(drop_sorted).scatter(1, order, drop_sorted)
            scores = scores.masked_fill(drop, neg)
        if self.any_min_p:
            probs = scores.softmax(dim=1)
            thresh = probs.max(dim=1, keepdim=True).values * self.min_p
            scores = scores.masked_fill(probs < thresh, neg)
        if self.stop_logit_offset is not None:
            others = scores.clone()
            others[:, self.eos] = neg
            eos_logit = others.logsumexp(dim=1) + self.stop_logit_offset
            scores[:, self.eos] = torch.where(self.stop_rows, eos_logit, scores[:, self.eos])
        scores[:, self.eos] = torch.where(self.ignore_eos, neg, scores[:, self.eos])
        return scores


class RowStop:
    """Per-row stop: a row is done at its own max_new_tokens or its first stop id."""

    def __init__(self, reqs: list[Req], width: int, dev: str, torch: Any) -> None:
        self.torch = torch
        self.width = width
        self.max_new = torch.tensor([r.max_new for r in reqs], device=dev)
        stop_sets = [sorted(r.stop_ids) for r in reqs]
        m = max(1, max(len(s) for s in stop_sets))
        self.stop = torch.tensor([s + [-1] * (m - len(s)) for s in stop_sets], device=dev)

    def __call__(self, input_ids: Any, scores: Any, **kwargs: Any) -> Any:
        produced = input_ids.shape[1] - self.width
        last = input_ids[:, -1:]
        hit = (last == self.stop).any(dim=1)
        return hit | (self.max_new <= produced)


# -- HTTP ------------------------------------------------------------------------------
ENGINE = web.AppKey("engine", Engine)
QUEUE = web.AppKey("queue", asyncio.Queue)
STATE = web.AppKey("state", dict)


def _json(body: Any, status: int = 200) -> web.Response:
    return web.Response(text=json.dumps(body), status=status, content_type="application/json")


async def generate(request: web.Request) -> web.Response:
    app = request.app
    eng = app[ENGINE]
    with eng.lock:
        eng.counters.requests += 1
    try:
        try:
            body = await request.json()
        except ValueError as exc:
            return _json({"object": "error", "message": f"JSON decode error: {exc}",
                          "type": "Bad Request", "param": None, "code": 400}, 400)
        req = eng.parse(body)
    except ApiError as exc:  # SGLang's status and body (400s, a 500 for an unknown key)
        with eng.lock:
            eng.counters.errors += 1
        return _json(exc.body, exc.status)
    req.fut = asyncio.get_running_loop().create_future()
    await app[QUEUE].put(req)
    try:
        await req.fut
    except Exception as exc:  # a failed batch answers 500
        with eng.lock:
            eng.counters.errors += 1
        return _json({"object": "error", "message": f"{type(exc).__name__}: {exc}",
                      "type": "InternalServerError", "param": None, "code": 500}, 500)
    req.result["meta_info"]["e2e_latency"] = time.monotonic() - req.t0
    return _json(req.result)


async def batcher(app: web.Application) -> None:
    eng, queue, state = app[ENGINE], app[QUEUE], app[STATE]
    loop = asyncio.get_running_loop()
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="gpu")
    wait_s = eng.args.batch_wait_ms / 1000
    max_wait_s = max(eng.args.batch_max_wait_ms, eng.args.batch_wait_ms) / 1000
    max_batch = eng.args.max_batch
    while True:
        batch = [await queue.get()]
        deadline = loop.time() + max_wait_s
        # the clients of the last batch usually come back together: wait (up to max_wait_s)
        # until as many requests as it had are here, then while more keep arriving with gaps
        # under wait_s
        target = min(max_batch, state.get("last_batch", 1))
        while len(batch) < max_batch:
            left = deadline - loop.time()
            if len(batch) >= target:
                left = min(wait_s, left)
            if left <= 0:
                break
            try:
                batch.append(await asyncio.wait_for(queue.get(), left))
            except TimeoutError:
                break
        while len(batch) < max_batch and not queue.empty():
            batch.append(queue.get_nowait())
        state["running"] = state["last_batch"] = len(batch)
        try:
            await loop.run_in_executor(pool, eng.generate_batch, batch)
        except Exception as exc:
            log.exception("batch of %d failed", len(batch))
            for r in batch:
                if r.fut and not r.fut.done():
                    r.fut.set_exception(exc)
        else:
            for r in batch:
                if r.fut and not r.fut.done():
                    r.fut.set_result(None)
        finally:
            state["running"] = 0


async def health(request: web.Request) -> web.Response:
    return web.Response(status=200)


async def server_info(request: web.Request) -> web.Response:
    eng = request.app[ENGINE]
    a = eng.args
    info = {
        "model_path": MODEL_PATH, "tokenizer_path": a.tokenizer, "served_model_name": MODEL_PATH,
        "port": a.port, "context_length": a.context_length, "max_running_requests": a.max_batch,
        "max_queued_requests": None, "max_req_input_len": eng.protocol.max_req_input_len,
        "schedule_policy": "fcfs", "sampling_defaults": "openai", "tp_size": 1, "dp_size": 1,
        "enable_metrics": True, "random_seed": a.seed, "status": "ready",
        "internal_states": [{"last_gen_throughput": eng.throughput()}],
        "version": "hf_engine-0.1",
        **eng.describe(),
        "engine_stats": eng.stats(),
    }
    return _json(info)


async def model_info(request: web.Request) -> web.Response:
    return _json({"model_path": MODEL_PATH, "tokenizer_path": request.app[ENGINE].args.tokenizer,
                  "is_generation": True, "preferred_sampling_params": None,
                  "weight_version": "random", "model_type": "qwen2",
                  "architectures": ["Qwen2ForCausalLM"], "random_weights": True})


async def list_models(request: web.Request) -> web.Response:
    card = {"id": MODEL_PATH, "object": "model", "created": int(time.time()),
            "owned_by": "sglang", "root": MODEL_PATH,
            "max_model_len": request.app[ENGINE].args.context_length}
    return _json({"object": "list", "data": [card]})


async def metrics(request: web.Request) -> web.Response:
    app = request.app
    eng = app[ENGINE]
    s = eng.stats()
    label = f'model_name="{MODEL_PATH}"'
    rows = [
        ("sglang:num_running_reqs", "gauge", "The number of running requests.",
         app[STATE].get("running", 0)),
        ("sglang:num_queue_reqs", "gauge", "The number of requests in the waiting queue.",
         app[QUEUE].qsize()),
        ("sglang:token_usage", "gauge", "The token usage.", 0),
        ("sglang:gen_throughput", "gauge", "The generation throughput (token/s).",
         eng.throughput()),
        ("sglang:prompt_tokens_total", "counter", "Number of prefill tokens processed.",
         s["prompt_tokens"]),
        ("sglang:generation_tokens_total", "counter", "Number of generation tokens processed.",
         s["completion_tokens"]),
        ("sglang:num_requests_total", "counter", "Number of requests processed.", s["finished"]),
        ("hf_engine:computed_tokens_total", "counter", "Rows x decode steps generated.",
         s["computed_tokens"]),
        ("hf_engine:busy_seconds_total", "counter", "Seconds inside model.generate.",
         s["busy_s"]),
        ("hf_engine:batches_total", "counter", "model.generate calls.", s["batches"]),
    ]
    lines = []
    for name, kind, help_text, value in rows:
        lines += [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}",
                  f"{name}{{{label}}} {float(value)}"]
    return web.Response(text="\n".join(lines) + "\n", content_type="text/plain")


async def benchmark(request: web.Request) -> web.Response:
    """``POST /_engine/benchmark {"rows": n, "steps": s, "prompt_len": p}`` (not SGLang):
    n synthetic requests queued at once, so they run as one batch of n rows x s steps
    (ignore_eos; temperature 0.7, top_p 0.95). Answers the batch's timing."""
    app = request.app
    eng = app[ENGINE]
    body = await request.json()
    n = max(1, min(int(body.get("rows", 1)), eng.args.max_batch))
    steps = max(1, int(body.get("steps", 128)))
    plen = max(1, int(body.get("prompt_len", 100)))
    rng = __import__("random").Random(int(body.get("seed", 0)))
    loop = asyncio.get_running_loop()
    before = eng.stats()
    reqs = []
    for i in range(n):
        r = eng.parse({"input_ids": [rng.randrange(1000, 150000) for _ in range(plen)],
                       "rid": f"bench-{uuid.uuid4().hex[:8]}-{i}",
                       "sampling_params": {"max_new_tokens": steps, "temperature": 0.7,
                                           "top_p": 0.95, "ignore_eos": True}})
        r.fut = loop.create_future()
        reqs.append(r)
    t0 = time.monotonic()
    for r in reqs:
        app[QUEUE].put_nowait(r)
    await asyncio.gather(*(r.fut for r in reqs))
    wall = time.monotonic() - t0
    after = eng.stats()
    d = {k: after[k] - before[k] for k in ("batches", "busy_s", "computed_tokens",
                                             "completion_tokens")}
    d["computed_tok_per_s"] = d["computed_tokens"] / d["busy_s"] if d["busy_s"] else 0.0
    d["step_ms"] = 1000 * d["busy_s"] / steps if d["batches"] == 1 else None
    return _json({"rows": n, "steps": steps, "prompt_len": plen, "wall_s": wall, **d})


async def engine_stats(request: web.Request) -> web.Response:
    eng = request.app[ENGINE]
    return _json({**eng.describe(), "stats": eng.stats()})


def create_app(eng: Engine) -> web.Application:
    app = web.Application(client_max_size=64 * 1024 * 1024)
    app[ENGINE] = eng
    app[QUEUE] = asyncio.Queue()
    app[STATE] = {"running": 0}

    async def start(app: web.Application) -> None:
        app[STATE]["task"] = asyncio.create_task(batcher(app))

    async def stop(app: web.Application) -> None:
        task = app[STATE].get("task")
        if task:
            task.cancel()

    app.on_startup.append(start)
    app.on_cleanup.append(stop)
    r = app.router
    for method in ("POST", "PUT"):
        r.add_route(method, "/generate", generate)
    for path in ("/health", "/health_generate"):
        r.add_get(path, health)
    for path in ("/server_info", "/get_server_info"):
        r.add_get(path, server_info)
    for path in ("/model_info", "/get_model_info"):
        r.add_get(path, model_info)
    r.add_get("/v1/models", list_models)
    r.add_get("/metrics", metrics)
    r.add_get("/_engine/stats", engine_stats)
    r.add_post("/_engine/benchmark", benchmark)
    return app


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    here = os.path.dirname(os.path.abspath(__file__))
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--tokenizer",
                   default=os.path.join(here, "..", "configs", "tokenizers", "qwen2.5-instruct"))
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=0, help="default heads // 4")
    p.add_argument("--intermediate", type=int, default=0, help="default 2.75 x hidden")
    p.add_argument("--tiny", action="store_true", help="hidden 64, 2 layers, 4 heads (CPU test)")
    p.add_argument("--device", default="auto", help="auto, cuda, cuda:0, cpu")
    p.add_argument("--dtype", default="auto", help="auto (bf16 on GPU, fp32 on CPU) or a torch "
                                                   "dtype name")
    p.add_argument("--max-batch", type=int, default=64)
    p.add_argument("--batch-wait-ms", type=float, default=5.0,
                   help="once a batch is as large as the last one, it closes when no "
                        "request came for this long ...")
    p.add_argument("--batch-max-wait-ms", type=float, default=300.0,
                   help="... or this long after its first request, or at --max-batch")
    p.add_argument("--context-length", type=int, default=4096)
    p.add_argument("--stop-prob", type=float, default=0.005,
                   help="per-step EOS probability forced on sampled rows (0: off)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--reply-log", default=None, help="append every reply to this JSONL file")
    p.add_argument("--log-level", default="INFO")
    args = p.parse_args(argv)
    if args.tiny:
        args.hidden, args.layers, args.heads = 64, 2, 4
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    eng = Engine(args)
    # one tiny generate first, so CUDA kernels are loaded before /health answers
    warm = eng.parse({"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 2}})
    eng.generate_batch([warm])
    with eng.lock:
        eng.counters = Counters()
        eng.window.clear()
    eng.open_reply_log()
    log.warning("hf_engine: serving on http://%s:%d (engine=%s, random weights)",
                args.host, args.port, ENGINE_NAME)
    web.run_app(create_app(eng), host=args.host, port=args.port, access_log=None,
                print=None, handle_signals=True)


if __name__ == "__main__":
    main()
