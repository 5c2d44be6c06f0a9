"""The hidden-state stage (`tokencap hidden-states`): its rows/s against plain requests of
one token, and at Kimi-K2.5's size its bytes kept per second against the disk's own rate
and the bytes it writes per byte it keeps.

The kept rows of a written run (`write_run`) go through the stage: the producer, four worker
processes and the writer, the simulator playing vLLM's extraction server (a safetensors
file per request under its lock, as vLLM's connector writes it). Each worker maps the
engine's file, checks it (shape, dtype, finite, no layer all zeros, ids, the layer ids the
file says), keeps it under the row's name (one file system: fsync and link, no byte written
again) and removes the engine's name.

1. Small states (4 layers x 128, bf16, the simulator's states a copy of a table row per
   token, as below): the stage's rows/s against the same rows as prompts
   of a plain generation run with `max_new_tokens = 1` (the request an extraction is) on the
   same simulator without extraction, through the same pipeline: the one stage runner
   (`tokencap.stack.stage.StageRun`), its writer and workers processes of their own, as
   `tokencap up` runs generation. Both rates are taken while rows are made, from the first
   row's request to the last row's reply (read from the rows), as the Kimi-size figures
   are: a run's start (its processes' imports, the stage's plan over the run's rows) is a
   fixed cost a long run does not see; a second row gives both runs whole. What vLLM itself
   spends extracting (15-45% more CPU per request on a tiny model, measured by `make
   test-engine`'s server) is not here: the simulator stands in, and what it spends writing
   each file (a copy of a table row per token, written under its lock) is on the same two
   cores. A third row gives each whole run's CPU per row (`getrusage` of the bench process
   and of its reaped workers and writer): where both runs are CPU-bound (rows/s times CPU
   per row near the cores), the rows/s ratio is about the inverse of this one, and a plain
   request's CPU times 1/0.9 is what a stage's row may cost to meet the target, the
   simulator's file writes included. A fourth gives the simulator's own threads' share of
   it (psutil, per thread): what the engine's work adds to a row, which a GPU node's engine
   does on cores of its own.
2. Kimi-K2.5's states (4 layers x 7168 per token: 57,352 B in bf16, 28,684 B in FP8), three
   ways: bf16 (the engine's folder on the output's file system), FP8 written by tokencap's
   connector (the simulator writes the FP8 file and its metadata, as
   `tokencap.engine_side.vllm_connector` does), and FP8 quantized by the workers (the stock
   connector's bf16 file in /dev/shm, as docs/HIDDEN_STATES.md advises). The simulator's
   states are a copy of a table row per token (`hs_states = "table"`): the engine's cost is
   a copy, not the simulator's arithmetic. For each:
   (a) the state bytes kept per second while the stage keeps rows, over the middle 80% of
       its bytes (`_steady_rate`, from its rows: the workers' start, when one still imports
       while another keeps the first rows, and the last rows, when fewer than all are busy,
       are what a 5 TB run does not see), and beside it from the first kept row to the last,
       against the disk's own rate for the same bytes: files of the same sizes written whole and
       fsynced one after the other in the same folder, right after, each dropped from the
       page cache once fsynced as the stage drops the files it keeps
       (`foundation.hsfile.drop_cache`; on this VM a page cache that grows takes fresh
       memory at 2.3 s a GB, and before both dropped, whichever side grew it paid: the
       stage's disk baseline then ran at 400-780 MB/s on a disk that takes 1.3 GB/s);
   (c) the bytes written to storage per byte kept: the kernel's count (`write_bytes` less
       `cancelled_write_bytes` of /proc/self/io: this process, its simulator thread, and
       its workers and writer once reaped; tmpfs is not storage), over the stage.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

from bench.context import Bench, log, row

NAME = "hidden_states"
TOKENS = 400_000  # of rows: prompt + output
LAYERS = [2, 4, 5, 8]
HIDDEN = 128
WORKERS = 4
TARGET_RATIO = 0.9  # the stage's rows/s, at least this share of plain one-token requests
# Kimi-K2.5's states: EAGLE-3's layer ids of its 61 layers, 7168 wide
KIMI_LAYERS = [2, 30, 58, 61]
KIMI_HIDDEN = 7168
KIMI_TOKENS = 100_000  # of rows: 5.7 GB of bf16 states
KIMI_RATE_TARGET = 0.8  # bytes kept/s, at least this share of the disk's own
WRITTEN_TARGET = 1.02  # bytes written per byte kept (1.0, and the run's small JSON lines)
VOCAB = 150_000  # ids the simulator takes
PROMPT, REPLY_MEAN = 200, 300


def write_run(folder: Any, tokens: int, seed: int) -> int:
    """A finished run's part file of single-turn rows, about `tokens` tokens; the rows."""
    import random

    from foundation.wire import Result, encode

    rng = random.Random(seed)
    cat = folder / "chat"
    cat.mkdir(parents=True, exist_ok=True)
    n = written = 0
    with (cat / "part-00001.jsonl").open("wb") as f:
        while written < tokens:
            prompt = [rng.randrange(VOCAB) for _ in range(PROMPT)]
            output = [rng.randrange(VOCAB) for _ in range(max(1, int(rng.expovariate(
                1 / REPLY_MEAN))))]
            f.write(encode(Result(id=f"c{n}", category="chat", prompt_ids=prompt,
                                  output_ids=output, prompt_tokens=len(prompt),
                                  completion_tokens=len(output), finish_reason="stop",
                                  text="", sampling={}, counted_tokens=len(output))) + b"\n")
            written += len(prompt) + len(output)
            n += 1
    return n


def _config(work: Any, out: Any, hs: Any, source: Any, sampling: str,
            layers: list[int] | None = None, hidden: int = HIDDEN, dtype: str = "bfloat16"
            ) -> Any:
    from foundation.config import load_config

    ids = layers or LAYERS
    model = work / f"model-{hidden}"
    model.mkdir(exist_ok=True)
    (model / "config.json").write_text(json.dumps(
        {"num_hidden_layers": max(ids), "hidden_size": hidden, "torch_dtype": "bfloat16"}))
    path = work / f"{out.name}.toml"
    path.write_text(f"""
run = "{out.name}"
output_dir = "{out}"
sampling_defaults = "engine"
count = "total"
reply_gate = false
lease_s = 30.0
[hidden_states]
model_config = "{model / 'config.json'}"
output_dir = "{hs}"
layers = {json.dumps(ids)}
dtype = "{dtype}"
[[category]]
name = "chat"
source = "{source}"
format = "input_ids"
cap_tokens = "none"
sampling = {sampling}
""")
    return load_config(path)


def run(bench: Bench) -> dict[str, Any]:
    small = _small(bench)
    kimi = [_kimi(bench, way) for way in KIMI_WAYS]
    bf16 = kimi[0]["figures"]
    rows = small["rows"]
    for k in kimi:
        f = k["figures"]
        rate, disk = f["kept_bytes_s_10_90"], f["disk_bytes_s"]
        # the workers' FP8 is the stock connector's fallback, bound by their CPU (the rate
        # below says what it costs); FP8 at the source is the way with a target
        fallback = f["way"] == "fp8 by the workers"
        rows.append(row(NAME, f"Kimi-K2.5 states ({f['way']}): bytes kept/s over the middle "
                        "80% of the bytes vs fsync'd sequential writes of the same files, "
                        "same folder", rate / 1e6, disk / 1e6, "MB/s",
                        "- (CPU-bound: the quantization rate below)" if fallback
                        else f"ratio >= {KIMI_RATE_TARGET:g}",
                        None if fallback else rate / disk >= KIMI_RATE_TARGET and f["complete"]))
        rows.append(row(NAME, f"Kimi-K2.5 states ({f['way']}): the same from the first kept "
                        "row to the last", f["kept_bytes_s"] / 1e6, disk / 1e6, "MB/s"))
        rows.append(row(NAME, f"Kimi-K2.5 states ({f['way']}): bytes written to storage per "
                        "byte kept", f["written_per_kept"], None, "B/B",
                        f"<= {WRITTEN_TARGET:g}", f["written_per_kept"] <= WRITTEN_TARGET))
        rows.append(row(NAME, f"Kimi-K2.5 states ({f['way']}): CPU seconds of the stage's "
                        "workers and writer per GB kept (what a GPU node's workers need)",
                        f["workers_cpu_s_per_gb"], None, "s/GB"))
        if f["way"] != "bf16":
            share = f["kept_bytes"] / bf16["kept_bytes"]
            rows.append(row(NAME, f"Kimi-K2.5 states ({f['way']}): bytes kept vs bf16's, the "
                            "same rows", f["kept_bytes"] / 1e9, bf16["kept_bytes"] / 1e9, "GB",
                            "ratio 0.5 (+ the scales: 28,684 / 57,352 B a token)",
                            abs(share - 28_684 / 57_352) < 0.001))
        if f["way"] == "fp8 by the workers":
            rows.append(row(NAME, "FP8 quantized by the workers: bf16 bytes quantized per "
                            "second of one core (hsfile.to_fp8, Kimi-size rows)",
                            f["quantize_bytes_s"] / 1e6, None, "MB/s"))
    return {"figures": {"small": small["figures"], "kimi": [k["figures"] for k in kimi]},
            "rows": rows}


def _small(bench: Bench) -> dict[str, Any]:
    from foundation.outputs import category_dir, rows_file
    from sglang_sim.testing import SimServer
    from tokencap.stack import processes
    from tokencap.stack.stage import Stage, StageRun, run_hidden_states
    from tokencap.stack.supervisor import Supervisor

    work = bench.sub(NAME)
    gen = work / "gen"
    rows = write_run(gen, TOKENS, 3)
    log(f"{NAME}: {rows:,} rows ({TOKENS:,} tokens) through the stage, {WORKERS} workers")
    dummy = work / "dummy.jsonl"
    dummy.write_text(json.dumps({"input_ids": [1, 2, 3]}) + "\n")
    cfg = _config(work, gen, work / "hs", dummy, "{ max_new_tokens = 1 }")
    storage = work / "engine-files"
    storage.mkdir(exist_ok=True)
    redis = bench.fresh_redis()
    with SimServer(flavor="vllm", time_scale=1000.0, extract_hidden_states=True,
                   hs_layer_ids=LAYERS, hs_hidden_size=HIDDEN, hs_dtype="bfloat16",
                   hs_storage_path=str(storage), hs_states="table", hs_metadata=True) as sim:
        t0, cpu0, sim0 = time.perf_counter(), _all_cpu(), _sim_cpu()
        status = run_hidden_states(cfg, bench.redis.url, WORKERS, extract_url=sim.url,
                                   redis=redis, progress_s=1.0, say=lambda line: None)
        stage_s, stage_cpu = time.perf_counter() - t0, _all_cpu() - cpu0
        stage_sim = _since(_sim_cpu(), sim0)
    st = status.categories["chat"]
    kept = status.state_bytes(st)
    assert kept is not None  # a hidden-state stage's status says its bytes
    # the baseline: the same rows, as one-token prompts of a plain run on the same pipeline
    log(f"{NAME}: the baseline, the same rows as plain one-token requests")
    plain_out = work / "plain"
    plain_cfg = _config(work, plain_out, work / "unused",
                        rows_file(cfg.states().output_dir, "chat"), "{ max_new_tokens = 1 }")
    redis = bench.fresh_redis()
    with SimServer(flavor="vllm", time_scale=1000.0) as sim:
        # its workers' and writer's start counted, as the stage's are
        t0, cpu0, sim0 = time.perf_counter(), _all_cpu(), _sim_cpu()
        plain_status = StageRun(Stage(plain_cfg, bench.redis.url, sim.url, WORKERS), redis,
                                Supervisor(processes.Table(None)),
                                say=lambda line: None).run(progress_s=1.0)
        plain_s, plain_cpu = time.perf_counter() - t0, _all_cpu() - cpu0
        plain_sim = _since(_sim_cpu(), sim0)
    plain_rows = plain_status.categories["chat"].samples
    stage_rate = _keeping_rate(category_dir(Path(cfg.states().output_dir), "chat"))
    plain_rate = _keeping_rate(category_dir(plain_out, "chat"))
    figures = {"rows": rows, "stage_rows": st.samples, "stage_s": stage_s,
               "bytes": kept.used, "plain_rows": plain_rows, "plain_s": plain_s,
               "stage_rows_s": stage_rate, "plain_rows_s": plain_rate,
               "stage_cpu_ms_per_row": stage_cpu / max(1, st.samples) * 1000,
               "plain_cpu_ms_per_row": plain_cpu / max(1, plain_rows) * 1000,
               "stage_sim_cpu_ms_per_row": stage_sim / max(1, st.samples) * 1000,
               "plain_sim_cpu_ms_per_row": plain_sim / max(1, plain_rows) * 1000,
               "layers": LAYERS, "hidden": HIDDEN, "workers": WORKERS}
    return {"figures": figures, "rows": [
        row(NAME, f"stage rows/s while keeping rows (states of {len(LAYERS)} x {HIDDEN}, "
            "bf16, checked and kept) vs plain max_tokens = 1 requests, same runner and "
            "simulator", stage_rate, plain_rate, "rows/s", f"ratio >= {TARGET_RATIO:g}",
            stage_rate / plain_rate >= TARGET_RATIO and st.samples == rows),
        row(NAME, "the same, each run whole (its processes' start and the stage's plan "
            "included)", st.samples / stage_s, plain_rows / plain_s, "rows/s"),
        row(NAME, "the same, CPU per row of each whole run: the bench process (the producer, "
            "the simulator's threads: its file writes are the stage's) and its workers and "
            "writer (where both runs are CPU-bound, the rows/s ratio follows this one's "
            "inverse)", figures["stage_cpu_ms_per_row"], figures["plain_cpu_ms_per_row"],
            "ms/row"),
        row(NAME, "the same, of it the simulator's threads (serving; for the stage also "
            "writing each file, the engine's work): what the stage's row adds there counts "
            "against the target's allowance, 0.1/0.9 of a plain request's CPU",
            figures["stage_sim_cpu_ms_per_row"], figures["plain_sim_cpu_ms_per_row"],
            "ms/row"),
        row(NAME, "bytes of states kept per second (small states)", kept.used / stage_s / 1e6,
            None, "MB/s"),
    ]}


def _keeping_rate(cat_dir: Path) -> float:
    """Rows per second of a run's category from its first row's request sent to its last
    row's reply, read from the rows (`sent_at_ms`, `latency_s`): a run's start (its
    processes' imports, the stage's plan) is a fixed cost a long run does not see, as the
    Kimi-size figures leave it out."""
    done = _results(cat_dir)
    first = min(r.sent_at_ms for r in done) / 1000
    last = max(_replied_s(r) for r in done)
    return (len(done) - 1) / (last - first)


def _results(cat_dir: Path) -> list[Any]:
    """A run's committed rows (`Result`s) in a category."""
    from foundation.outputs import read_committed
    from foundation.wire import Result

    return [r for r in read_committed(cat_dir) if isinstance(r, Result)]


def _replied_s(r: Any) -> float:
    """When a row's reply came: its request's send time plus its latency (seconds)."""
    return float(r.sent_at_ms / 1000 + r.latency_s)


# (the way's name, the engine's dtype, the config's dtype, tokencap's connector's metadata,
# the engine's folder in /dev/shm)
KIMI_WAYS = (("bf16", "bfloat16", "bfloat16", True, False),
             ("fp8 by tokencap's connector", "fp8_e4m3", "fp8_e4m3", True, False),
             ("fp8 by the workers", "bfloat16", "fp8_e4m3", False, True))


def _io() -> int:
    """Bytes this process (its threads, and its children once reaped) sent to storage."""
    fields = dict(line.split(":") for line in Path("/proc/self/io").read_text().splitlines())
    return int(fields["write_bytes"]) - int(fields["cancelled_write_bytes"])


def _sim_cpu() -> dict[int, float]:
    """CPU seconds of each of the simulator's threads (its event loop, `sglang_sim`, and the
    loop's executor, `asyncio_*`, which writes the states files), by thread id."""
    import threading

    import psutil

    ours = {t.native_id for t in threading.enumerate()
            if t.name == "sglang_sim" or t.name.startswith("asyncio")}
    return {t.id: t.user_time + t.system_time for t in psutil.Process().threads()
            if t.id in ours}


def _since(now: dict[int, float], before: dict[int, float]) -> float:
    return sum(v - before.get(tid, 0.0) for tid, v in now.items())


def _all_cpu() -> float:
    """CPU seconds of this process (its threads: the producer, the simulator) and of its
    reaped children (the run's workers and writer)."""
    import resource

    use = resource.getrusage(resource.RUSAGE_SELF)
    return use.ru_utime + use.ru_stime + _children_cpu()


def _children_cpu() -> float:
    """CPU seconds of this process's reaped children (the stage's workers and writer)."""
    import resource

    use = resource.getrusage(resource.RUSAGE_CHILDREN)
    return use.ru_utime + use.ru_stime


def _kimi(bench: Bench, way: tuple[str, str, str, bool, bool]) -> dict[str, Any]:
    import shutil
    import tempfile

    from foundation import hsfile
    from foundation.outputs import category_dir
    from sglang_sim.testing import SimServer
    from tokencap.stack.stage import run_hidden_states

    name, engine_dtype, dtype, metadata, shm = way
    work = bench.sub(f"{NAME}-kimi")
    gen = work / "gen"
    if not gen.exists():
        write_run(gen, KIMI_TOKENS, 5)
    dummy = work / "dummy.jsonl"
    dummy.write_text(json.dumps({"input_ids": [1, 2, 3]}) + "\n")
    hs = work / "hs"
    shutil.rmtree(hs, ignore_errors=True)
    cfg = _config(work, gen, hs, dummy, "{ max_new_tokens = 1 }", KIMI_LAYERS, KIMI_HIDDEN,
                  dtype)
    storage = Path(tempfile.mkdtemp(prefix="tokencap-bench-", dir="/dev/shm")) if shm \
        else work / "engine-files"
    storage.mkdir(exist_ok=True)
    log(f"{NAME}: Kimi-K2.5 states, {name}: {KIMI_TOKENS:,} row tokens, {WORKERS} workers, "
        f"the engine's files in {storage}")
    redis = bench.fresh_redis()
    seen: dict[str, float] = {}
    total = sum(1 for _ in (gen / "chat" / "part-00001.jsonl").open())

    def watch(status: Any) -> None:
        st = status.categories.get("chat")
        if st is None or st.samples == 0:
            return
        kept = status.state_bytes(st)
        now = time.perf_counter()
        if "t_first" not in seen:
            seen.update(t_first=now, bytes_first=kept.used)
        if st.samples >= total and "t_last" not in seen:
            seen.update(t_last=now, bytes_last=kept.used)

    try:
        with SimServer(flavor="vllm", time_scale=1000.0, extract_hidden_states=True,
                       hs_layer_ids=KIMI_LAYERS, hs_hidden_size=KIMI_HIDDEN,
                       hs_dtype=engine_dtype, hs_storage_path=str(storage),
                       hs_states="table", hs_metadata=metadata) as sim:
            before, cpu_before = _io(), _children_cpu()
            t0 = time.perf_counter()
            status = run_hidden_states(cfg, bench.redis.url, WORKERS, extract_url=sim.url,
                                       redis=redis, progress_s=0.1, say=lambda line: None,
                                       on_progress=watch)
            stage_s = time.perf_counter() - t0
            written = _io() - before
            children_cpu = _children_cpu() - cpu_before
    finally:
        if shm:
            shutil.rmtree(storage, ignore_errors=True)
    st = status.categories["chat"]
    files = sorted((hs / "chat" / "states").glob("*.safetensors"))
    sizes = [f.stat().st_size for f in files]
    kept_bytes = sum(sizes)
    window = seen.get("t_last", t0 + stage_s) - seen.get("t_first", t0)
    window_bytes = seen.get("bytes_last", 0) - seen.get("bytes_first", 0)
    steady = _steady_rate(category_dir(hs, "chat"))
    sample = files[len(files) // 2].read_bytes() if files else b""
    quantize_s = None
    if name == "fp8 by the workers" and files:
        quantize_s = _quantize_rate(work)
    shutil.rmtree(hs, ignore_errors=True)
    # the disk's own rate: the same sizes written whole and fsynced, one after another
    base = work / "disk-baseline"
    base.mkdir(exist_ok=True)
    buffer = memoryview(sample * (max(sizes, default=0) // max(1, len(sample)) + 1))
    t1 = time.perf_counter()
    for i, size in enumerate(sizes):
        with (base / f"{i}.safetensors").open("wb") as f:
            f.write(buffer[:size])
            f.flush()
            os.fsync(f.fileno())
        hsfile.drop_cache(base / f"{i}.safetensors")  # as the stage drops each kept file
    folder = os.open(base, os.O_RDONLY)
    try:
        os.fsync(folder)
    finally:
        os.close(folder)
    disk_s = time.perf_counter() - t1
    shutil.rmtree(base, ignore_errors=True)
    kept_rate = window_bytes / window if window > 0 else 0.0
    written_per_kept = written / max(1, kept_bytes)
    figures = {"way": name, "rows": total, "kept_rows": st.samples,
               "complete": st.samples == total == len(files), "kept_bytes": kept_bytes,
               "stage_s": stage_s, "keeping_s": window, "keeping_bytes": window_bytes,
               "kept_bytes_s": kept_rate, "kept_bytes_s_10_90": steady,
               "disk_s": disk_s, "disk_bytes_s": kept_bytes / disk_s,
               "written_bytes": written, "written_per_kept": written_per_kept,
               "quantize_bytes_s": quantize_s,
               "workers_cpu_s": children_cpu,
               "workers_cpu_s_per_gb": children_cpu / max(1e-9, kept_bytes / 1e9),
               "engine_folder": "tmpfs" if shm else "same",
               "layers": KIMI_LAYERS, "hidden": KIMI_HIDDEN, "workers": WORKERS}
    log(f"{NAME}: {name}: {kept_bytes / 1e9:.2f} GB kept in {stage_s:.1f} s "
        f"({kept_rate / 1e6:,.0f} MB/s while keeping; the disk "
        f"{kept_bytes / disk_s / 1e6:,.0f} MB/s), {written_per_kept:.3f} "
        "B written per B kept")
    return {"figures": figures}


def _steady_rate(cat_dir: Path) -> float:
    """The stage's state bytes kept per second over the middle 80% of its bytes: the rows in
    the order of their replies (`sent_at_ms` + `latency_s`), from the reply by which 10% of
    the bytes were asked for to the one by which 90% were (its workers' start, when a
    worker still importing shares the cores with the first rows, and the end, when fewer
    than all are busy, left out, as a 5 TB run does not see them)."""
    done = sorted((_replied_s(r), int(r.hidden_states["bytes"]))
                  for r in _results(cat_dir) if r.hidden_states)
    total = sum(b for _, b in done)
    cum, marks = 0, {}
    for t, b in done:
        cum += b
        for share in (0.1, 0.9):
            if share not in marks and cum >= share * total:
                marks[share] = (t, cum)
    if len(marks) < 2 or marks[0.9][0] <= marks[0.1][0]:
        return 0.0
    return (marks[0.9][1] - marks[0.1][1]) / (marks[0.9][0] - marks[0.1][0])


def _quantize_rate(work: Any) -> float:
    """hsfile.to_fp8's bf16 bytes per second on one core, on one Kimi-size row (1,000
    tokens), best of three."""
    from foundation import hsfile
    from sglang_sim import hidden

    ids = list(range(1000))
    tensors, _ = hsfile.decode(hidden.file_bytes(ids, KIMI_LAYERS, KIMI_HIDDEN, "bfloat16",
                                                 table=True), work / "row")
    best = 0.0
    for _ in range(3):
        t0 = time.perf_counter()
        hsfile.to_fp8(tensors["hidden_states"])
        best = max(best, len(tensors["hidden_states"].data) / (time.perf_counter() - t0))
    return best
