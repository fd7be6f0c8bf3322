"""docker-compose.yml and docker/Dockerfile, checked without a Docker engine.

The file is parsed with PyYAML and its structure checked; every command a service or a
healthcheck runs must be an entry point of this repo that accepts the flags given to it. If a
compose CLI is installed (`docker compose` v2 or the `docker-compose` v1 package), it must
also accept the file (`config` needs no engine).
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from tests.entrypoints import parse_command

ROOT = Path(__file__).resolve().parent.parent
COMPOSE = ROOT / "docker-compose.yml"
DOCKERFILE = ROOT / "docker" / "Dockerfile"
OUR_SERVICES = ("models", "drafter", "verifier", "verifier-cpu", "gateway")
MODEL_SERVICES = ("drafter", "verifier", "verifier-cpu")


@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load(COMPOSE.read_text())


@pytest.fixture(scope="module")
def services(compose) -> dict:
    return compose["services"]


def flag(command: list[str], name: str) -> str:
    return command[command.index(name) + 1]


def test_services_and_images(services):
    assert set(services) == {"redis", *OUR_SERVICES}
    assert services["redis"]["image"].startswith("redis:")
    for name in OUR_SERVICES:
        build = services[name]["build"]
        assert (ROOT / build["context"] / build["dockerfile"]).resolve() == DOCKERFILE
    assert "cu" in services["verifier"]["build"]["args"]["TORCH_INDEX_URL"].rsplit("/", 1)[1]
    assert services["drafter"]["build"]["args"]["TORCH_INDEX_URL"].endswith("/cpu")


def test_healthchecks(services):
    assert services["redis"]["healthcheck"]["test"] == ["CMD", "redis-cli", "ping"]
    for name in (*MODEL_SERVICES, "gateway"):
        test = services[name]["healthcheck"]["test"]
        assert test[:4] == ["CMD", "python", "-m", "specmesh.rpc.health"], name
        assert test[4] == f"127.0.0.1:{flag(services[name]['command'], '--port')}", name
    assert "healthcheck" not in services["models"]  # a one-shot job


def test_drafters_scale_and_the_gateway_finds_them_by_dns(services):
    drafter, gateway = services["drafter"], services["gateway"]
    assert drafter["deploy"]["replicas"] >= 2
    assert "ports" not in drafter and "container_name" not in drafter  # both would block --scale
    command = gateway["command"]
    assert flag(command, "--drafters") == f"dns:///drafter:{flag(drafter['command'], '--port')}"
    verifier_port = flag(services["verifier"]["command"], "--port")
    assert flag(command, "--verifiers") == f"dns:///verifier:{verifier_port}"
    assert flag(command, "--redis-url") == "redis://redis:6379/0"
    assert flag(command, "--port") == "50051" and "50051:50051" in gateway["ports"]
    for name in (*MODEL_SERVICES, "gateway"):
        assert flag(services[name]["command"], "--host") == "0.0.0.0", name


def test_gpu_reservation_and_cpu_profile(services):
    gpu, cpu = services["verifier"], services["verifier-cpu"]
    (device,) = gpu["deploy"]["resources"]["reservations"]["devices"]
    assert device["driver"] == "nvidia" and "gpu" in device["capabilities"]
    assert gpu["profiles"] == ["gpu"] and cpu["profiles"] == ["cpu"]
    assert "deploy" not in cpu
    assert "verifier" in cpu["networks"]["default"]["aliases"]  # the gateway's dns:///verifier
    assert flag(gpu["command"], "--device") == "cuda" and "--device" not in cpu["command"]
    assert gpu["command"][:4] == cpu["command"][:4]
    for name, service in services.items():  # nothing that starts by default waits on a profile
        if "profiles" not in service:
            assert not set(service.get("depends_on", {})) & {"verifier", "verifier-cpu"}, name


def test_dependencies(services):
    gateway = services["gateway"]["depends_on"]
    assert gateway["redis"]["condition"] == "service_healthy"
    assert gateway["drafter"]["condition"] == "service_healthy"
    for name in (*MODEL_SERVICES, "gateway"):
        assert services[name]["depends_on"]["models"]["condition"] == "service_completed_successfully"


def test_model_cache_volume(compose, services):
    assert "models" in compose["volumes"]
    for name in (*MODEL_SERVICES, "models", "gateway"):
        assert "models:/models" in services[name]["volumes"], name
        assert services[name]["environment"]["SPECMESH_CACHE"] == "/models", name
    assert services["models"]["command"][:3] == ["specmesh", "models", "pull"]


def test_dockerfile_installs_cpu_torch_first():
    text = DOCKERFILE.read_text()
    assert re.search(r"^ARG PYTHON_IMAGE=python:3\.11-slim$", text, re.M)
    assert re.search(r"^ARG TORCH_INDEX_URL=https://download\.pytorch\.org/whl/cpu$", text, re.M)
    torch = text.index('"torch==${TORCH_VERSION}"')
    assert "ARG TORCH_VERSION=2.13.0" in text
    assert torch < text.index("pip install /wheels/*.whl")
    for path in re.findall(r"^COPY (?:--\S+ )*(\S+) ", text, re.M):
        assert (ROOT / path).exists(), path


# ---- every command is an entry point of this repo, with flags it accepts -------------------------


def _commands(services: dict) -> list[tuple[str, list[str]]]:
    out = []
    for name in OUR_SERVICES:
        out.append((name, services[name]["command"]))
        if "healthcheck" in services[name]:
            out.append((f"{name} healthcheck", services[name]["healthcheck"]["test"][1:]))
    return out


def test_every_command_exists(services):
    for where, command in _commands(services):
        env = services[where.removesuffix(" healthcheck")].get("environment", {})
        parse_command(where, command, env)  # the service's own flag parser, with its environment


# ---- a real compose CLI, where one is installed ----------------------------------------------------


def _compose_cli() -> list[str] | None:
    docker = shutil.which("docker")
    if docker and subprocess.run([docker, "compose", "version"], capture_output=True).returncode == 0:
        return [docker, "compose"]
    legacy = shutil.which("docker-compose")
    return [legacy] if legacy else None


@pytest.mark.parametrize("profile", ["cpu", "gpu"])
def test_compose_cli_accepts_the_file(profile):
    cli = _compose_cli()
    if cli is None:
        pytest.skip(
            "no compose CLI here (neither `docker compose` nor `docker-compose`); structure checked above"
        )
    result = subprocess.run(
        [*cli, "-f", str(COMPOSE), "--profile", profile, "config", "-q"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
