"""docker/: compose.yaml is valid Compose and wires the real CLI; the image runs as non-root.

Docker is not run here (the machines that run these tests have no daemon): the compose file is
checked against the Compose Specification's JSON schema and against what tokencap needs (Redis
with AOF and noeviction, loopback-only budget port, replicas, a GPU profile), and the
Dockerfile is read stage by stage.
"""

from __future__ import annotations

import json
import os
import posixpath
import re
import shlex
import shutil
import subprocess
import tomllib
from typing import Any

import pytest

from tests.conftest import ROOT
from tokencap.cli.main import main

yaml = pytest.importorskip("yaml")
jsonschema = pytest.importorskip("jsonschema")

DOCKER = ROOT / "docker"
COMPOSE = DOCKER / "compose.yaml"
DOCKERFILE = DOCKER / "Dockerfile"
SCHEMA = ROOT / "tests" / "fixtures" / "schemas" / "compose-spec.json"

TOKENCAP_SERVICES = {"sim", "budget", "writer", "producer", "worker"}
INTERPOLATION = re.compile(r"\$\{(\w+)(?::?-([^}]*))?\}")
ENV_VALUE = re.compile(r"^\$\{[A-Z][A-Z0-9_]*:-[^}]*\}$")
IMAGE_APP = "/app"  # WORKDIR of docker/Dockerfile's final stage
IMAGE_OUT = "/out"  # where the results volume is mounted


def _default(value: Any) -> str:
    """`value` as Compose resolves it with none of its variables set."""
    return INTERPOLATION.sub(lambda m: m.group(2) or "", str(value))


def _argv(command: str | list[Any]) -> list[str]:
    return shlex.split(command) if isinstance(command, str) else [str(a) for a in command]


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    return yaml.safe_load(COMPOSE.read_text())


@pytest.fixture(scope="module")
def services(compose: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return compose["services"]


def _stages(text: str) -> tuple[dict[str, str], list[list[tuple[str, str]]]]:
    """(global ARG defaults, stages as lists of (INSTRUCTION, arguments))."""
    lines = [ln for ln in text.splitlines() if not ln.lstrip().startswith("#")]
    logical = re.sub(r"\\\n", " ", "\n".join(lines))
    args: dict[str, str] = {}
    stages: list[list[tuple[str, str]]] = []
    for line in logical.splitlines():
        if not line.strip():
            continue
        instr, _, rest = line.strip().partition(" ")
        instr = instr.upper()
        if instr == "FROM":
            stages.append([])
        if not stages:
            if instr == "ARG":
                name, _, value = rest.partition("=")
                args[name.strip()] = value.strip()
            continue
        stages[-1].append((instr, rest.strip()))
    return args, stages


@pytest.fixture(scope="module")
def dockerfile() -> tuple[dict[str, str], list[list[tuple[str, str]]]]:
    return _stages(DOCKERFILE.read_text())


# -- compose.yaml --------------------------------------------------------------------------


def test_compose_matches_the_compose_specification(compose: dict[str, Any]) -> None:
    if not SCHEMA.is_file():
        pytest.skip(f"no Compose schema at {SCHEMA}")
    schema = json.loads(SCHEMA.read_text())
    validator_cls = jsonschema.validators.validator_for(schema, jsonschema.Draft7Validator)
    validator_cls.check_schema(schema)
    errors = sorted(validator_cls(schema).iter_errors(compose), key=lambda e: list(e.path))
    assert not errors, "\n".join(f"{list(e.path)}: {e.message}" for e in errors)


def test_the_services_are_the_pipeline(services: dict[str, dict[str, Any]]) -> None:
    assert set(services) == TOKENCAP_SERVICES | {"redis", "sglang"}


def test_redis_keeps_its_data_and_never_evicts(
    compose: dict[str, Any], services: dict[str, dict[str, Any]]
) -> None:
    redis = services["redis"]
    argv = _argv(redis["command"])
    options = dict(zip(argv[1::2], argv[2::2], strict=False))
    assert argv[0] == "redis-server"
    assert options["--appendonly"] == "yes"
    assert options["--appendfsync"] == "everysec"
    assert options["--maxmemory-policy"] == "noeviction"
    data = [v for v in redis["volumes"] if str(v).endswith(":/data")]
    assert data and data[0].split(":")[0] in compose["volumes"], "/data must be a named volume"
    assert _argv(redis["healthcheck"]["test"])[-2:] == ["redis-cli", "ping"]


def test_every_tokencap_service_uses_the_image_built_from_the_dockerfile(
    services: dict[str, dict[str, Any]],
) -> None:
    images = set()
    for name in TOKENCAP_SERVICES:
        build = services[name]["build"]
        assert (DOCKER / build["context"]).resolve() == ROOT, name
        assert build["dockerfile"] == "docker/Dockerfile", name
        assert (ROOT / build["dockerfile"]).is_file()
        images.add(services[name]["image"])
    assert len(images) == 1, f"one image for every tokencap service, got {images}"
    for name in set(services) - TOKENCAP_SERVICES:
        assert "build" not in services[name], name


def test_every_tokencap_subcommand_used_exists_in_the_cli(
    services: dict[str, dict[str, Any]],
) -> None:
    used = {name: _argv(services[name]["command"])[0] for name in TOKENCAP_SERVICES}
    assert used == {
        "sim": "sim",
        "budget": "serve",
        "writer": "writer",
        "producer": "run",
        "worker": "worker",
    }
    for name, subcommand in used.items():
        assert subcommand in main.commands, f"{name}: `tokencap {subcommand}` does not exist"


def test_budget_is_published_on_loopback_only_and_binds_all_in_its_container(
    services: dict[str, dict[str, Any]],
) -> None:
    argv = _argv(services["budget"]["command"])
    assert argv[argv.index("--host") + 1] == "0.0.0.0"
    port = argv[argv.index("--port") + 1]
    ports = services["budget"]["ports"]
    assert ports
    for p in ports:
        if isinstance(p, dict):
            assert p["host_ip"] == "127.0.0.1"
            assert str(p["target"]) == port
        else:
            assert str(p).startswith("127.0.0.1:"), p
    published = {n for n, s in services.items() if s.get("ports")}
    assert published == {"budget"}, "nothing but the budget service is published"


def test_no_secret_is_committed_and_every_variable_has_a_default(
    services: dict[str, dict[str, Any]],
) -> None:
    assert _default(services["budget"]["environment"]["TOKENCAP_TOKEN"]) == ""
    assert _default(services["sglang"]["environment"]["HF_TOKEN"]) == ""
    for name, svc in services.items():
        for key, value in (svc.get("environment") or {}).items():
            assert ENV_VALUE.match(str(value)), f"{name}.{key}: {value!r} is not ${{VAR:-...}}"


def test_workers_have_replicas_and_share_the_engine_url(
    services: dict[str, dict[str, Any]],
) -> None:
    worker = services["worker"]
    assert int(_default(worker["deploy"]["replicas"])) >= 1
    assert "container_name" not in worker
    for key in ("SGLANG_URL", "SGLANG_API_KEY"):
        assert services["producer"]["environment"][key] == worker["environment"][key]
    engine = worker["environment"]["SGLANG_URL"]
    sglang_argv = _argv(services["sglang"]["command"])
    port = sglang_argv[sglang_argv.index("--port") + 1]
    # the real engine by default; never the simulator unless SGLANG_URL names it
    assert _default(engine) == f"http://sglang:{port}"


def test_sglang_runs_on_gpus_under_the_gpu_profile_with_metrics(
    services: dict[str, dict[str, Any]],
) -> None:
    sglang = services["sglang"]
    assert sglang["profiles"] == ["gpu"]
    assert sglang["image"].startswith("lmsysorg/sglang")
    argv = _argv(sglang["command"])
    assert argv[1:3] == ["-m", "sglang.launch_server"]
    assert "--enable-metrics" in argv
    assert argv[argv.index("--host") + 1] == "0.0.0.0"
    assert _default(argv[argv.index("--context-length") + 1]).isdigit()
    devices = sglang["deploy"]["resources"]["reservations"]["devices"]
    assert any(d["driver"] == "nvidia" and "gpu" in d["capabilities"] for d in devices)
    assert "/health" in " ".join(_argv(sglang["healthcheck"]["test"]))
    assert sglang["ipc"] == "host" and sglang["shm_size"]
    assert services["sim"]["profiles"] == ["sim"], "the simulator only when asked for"
    for name, svc in services.items():
        if name not in ("sglang", "sim"):
            assert "profiles" not in svc, f"{name} must start without a profile"


def test_compose_config_under_the_gpu_profile_points_workers_at_sglang() -> None:
    """What `docker compose --profile gpu config` resolves (needs Compose v2: v1 does not read
    the Compose Specification)."""
    for argv in (["docker", "compose"], ["docker-compose"]):
        if shutil.which(argv[0]) is None:
            continue
        version = subprocess.run([*argv, "version", "--short"], capture_output=True, text=True,
                                 timeout=60)
        if version.returncode != 0 or not version.stdout.strip().lstrip("v").startswith("2"):
            continue
        env = {k: v for k, v in os.environ.items() if k not in ("SGLANG_URL", "SGLANG_API_KEY")}
        done = subprocess.run([*argv, "-f", str(COMPOSE), "--profile", "gpu", "config"],
                              capture_output=True, text=True, env=env, timeout=60)
        assert done.returncode == 0, done.stderr
        resolved = yaml.safe_load(done.stdout)["services"]
        for name in ("producer", "worker"):
            assert resolved[name]["environment"]["SGLANG_URL"] == "http://sglang:30000"
        assert "sglang" in resolved and "sim" not in resolved
        return
    pytest.skip("no Compose v2 binary (docker compose / docker-compose 2.x)")


def test_services_wait_for_a_healthy_redis_and_restart_until_the_run_exists(
    services: dict[str, dict[str, Any]],
) -> None:
    for name in TOKENCAP_SERVICES - {"sim"}:
        svc = services[name]
        assert svc["depends_on"]["redis"]["condition"] == "service_healthy", name
        assert svc["restart"] in {"on-failure", "unless-stopped", "always"}, name
    for name in ("producer", "worker"):
        engines = services[name]["depends_on"]
        for engine in ("sim", "sglang"):
            assert engines[engine] == {"condition": "service_healthy", "required": False}
    assert services["producer"]["restart"] == "on-failure", "the producer exits 0 when done"


def test_producer_reads_the_results_the_writer_writes(
    services: dict[str, dict[str, Any]],
) -> None:
    writer_vols = [v for v in services["writer"]["volumes"] if v.endswith(f":{IMAGE_OUT}")]
    producer_vols = [v for v in services["producer"]["volumes"] if f":{IMAGE_OUT}" in v]
    assert len(writer_vols) == 1 and len(producer_vols) == 1
    assert writer_vols[0].split(":")[0] == producer_vols[0].split(":")[0]
    # The default config is the shipped demo, and its output_dir lands in the volume (the
    # image links /app/out to /out; the writer's TOKENCAP_OUT defaults to that output_dir).
    config = _default(_argv(services["producer"]["command"])[1])
    assert config.startswith(f"{IMAGE_APP}/configs/")
    local = ROOT / config.removeprefix(f"{IMAGE_APP}/")
    output_dir = tomllib.loads(local.read_text())["output_dir"]
    in_image = posixpath.normpath(posixpath.join(posixpath.dirname(config), output_dir))
    assert in_image.startswith(f"{IMAGE_APP}/out/")
    assert _default(services["writer"]["environment"]["TOKENCAP_OUT"]) == ""


def test_producer_reads_tokenizers_and_datasets_from_the_cache_sglang_fills(
    services: dict[str, dict[str, Any]],
) -> None:
    sglang_cache = [v for v in services["sglang"]["volumes"]
                    if v.endswith(":/root/.cache/huggingface")]
    assert len(sglang_cache) == 1
    volume = sglang_cache[0].split(":")[0]
    env = services["producer"]["environment"]
    mounts = [v for v in services["producer"]["volumes"] if v.startswith(f"{volume}:")]
    assert len(mounts) == 1 and mounts[0].endswith(":ro")
    assert _default(mounts[0].split(":", 1)[1].rsplit(":", 1)[0]) == _default(env["HF_HOME"])
    assert _default(env["HF_HUB_OFFLINE"]) == "1"


# -- Dockerfile ----------------------------------------------------------------------------


def test_image_is_built_in_two_stages_from_python_slim(dockerfile: Any) -> None:
    args, stages = dockerfile
    assert len(stages) >= 2
    for stage in (stages[0], stages[-1]):
        base = re.sub(r"\$\{(\w+)\}", lambda m: args[m.group(1)], stage[0][1].split()[0])
        assert base == "python:3.11-slim"
    assert any(i == "RUN" and "pip install ." in rest for i, rest in stages[0])


def test_final_stage_runs_tokencap_as_a_non_root_user(dockerfile: Any) -> None:
    _args, stages = dockerfile
    final = stages[-1]
    users = [rest for i, rest in final if i == "USER"]
    assert users, "the final stage needs a USER"
    user = users[-1].split(":")[0]
    assert user not in {"root", "0"}
    assert [rest for i, rest in final if i == "ENTRYPOINT"] == ['["tokencap"]']
    assert [rest for i, rest in final if i == "WORKDIR"] == [IMAGE_APP]
    env = " ".join(rest for i, rest in final if i == "ENV")
    for var in ("HF_HUB_OFFLINE=1", "TRANSFORMERS_OFFLINE=1", "PYTHONUNBUFFERED=1"):
        assert var in env
    copies = [rest for i, rest in final if i == "COPY"]
    assert any(c.startswith("--from=builder /opt/venv") for c in copies)
    assert any(c.split()[0] == "configs/" for c in copies)
    assert any(i == "RUN" and f"ln -s {IMAGE_OUT} {IMAGE_APP}/out" in rest for i, rest in final)


def test_final_stage_has_no_compilers_pip_cache_or_healthcheck(dockerfile: Any) -> None:
    _args, stages = dockerfile
    final = " ".join(f"{i} {rest}" for i, rest in stages[-1])
    for word in ("gcc", "build-essential", "apt-get install", "pip install", ".cache/pip"):
        assert word not in final, word
    for stage in stages:
        assert all(i != "HEALTHCHECK" for i, _ in stage), "compose sets the healthchecks"


def test_dockerignore_keeps_local_state_out_of_the_build_context() -> None:
    ignored = set((ROOT / ".dockerignore").read_text().split())
    assert {".git", ".venv", ".run", "out"} <= ignored


def test_builder_copies_every_package_pyproject_installs(dockerfile: Any) -> None:
    _args, stages = dockerfile
    copied = {rest.split()[0].rstrip("/") for i, rest in stages[0] if i == "COPY"}
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    packages = set(pyproject["tool"]["hatch"]["build"]["targets"]["wheel"]["packages"])
    assert packages <= copied, f"add to docker/Dockerfile: COPY {sorted(packages - copied)}"
    assert {"pyproject.toml", pyproject["project"]["readme"]} <= {
        arg for i, rest in stages[0] if i == "COPY" for arg in rest.split()[:-1]
    }
