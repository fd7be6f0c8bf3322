"""docker-compose.yml and docker/Dockerfile, checked without a Docker engine.

The file is parsed with PyYAML and its structure checked; every command a service or a
healthcheck runs must be an entry point of this repo that accepts the flags given to it. If a
compose CLI is installed (`docker compose` v2 or the `docker-compose` v1 package), it must
also accept the file (`config` needs no engine).
"""

from __future__ import annotations

import os
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
OUR_SERVICES = ("models", "certs", "drafter", "verifier", "verifier-cpu", "gateway")
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
    assert "--redis-url" not in command  # in the environment: it carries the password
    assert services["gateway"]["environment"]["SPECMESH_REDIS_URL"].endswith("@redis:6379/0")
    assert flag(command, "--port") == "50051" and "50051:50051" in gateway["ports"]
    for name in (*MODEL_SERVICES, "gateway"):
        assert flag(services[name]["command"], "--host") == "0.0.0.0", name


def test_redis_persists_requires_a_password_and_disables_config_debug_keys(compose, services):
    """AOF (everysec) on a volume, so a restarted Redis keeps the sessions; the password from
    SPECMESH_REDIS_PASSWORD, also in the gateway's URL and for the healthcheck's redis-cli."""
    redis, gateway = services["redis"], services["gateway"]
    command = redis["command"]
    assert command[0] == "redis-server"
    assert flag(command, "--appendonly") == "yes" and flag(command, "--appendfsync") == "everysec"
    assert flag(command, "--dir") == "/data" and "redis-data:/data" in redis["volumes"]
    assert "redis-data" in compose["volumes"]
    password = flag(command, "--requirepass")
    assert password.startswith("${SPECMESH_REDIS_PASSWORD:?")  # required: compose refuses to start without it
    renamed = {command[i + 1]: command[i + 2] for i, arg in enumerate(command) if arg == "--rename-command"}
    assert renamed == {"CONFIG": "", "DEBUG": "", "KEYS": ""}
    assert redis["environment"]["REDISCLI_AUTH"].startswith("${SPECMESH_REDIS_PASSWORD:?")
    url = gateway["environment"]["SPECMESH_REDIS_URL"]
    assert url.startswith("redis://:${SPECMESH_REDIS_PASSWORD:?") and url.endswith("}@redis:6379/0")


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
        for job in ("models", "certs"):
            assert services[name]["depends_on"][job]["condition"] == "service_completed_successfully"


def test_tls_on_every_hop(services):
    """Every server listens with TLS only, with the files the `certs` job writes into the shared
    volume; the replicas require a client certificate of its CA, which the gateway shows; the
    server certificate names every dns:/// host the gateway dials; healthchecks speak TLS."""
    from gateway.pools import parse_targets
    from specmesh.rpc.tls import ClientTls, ServerTls
    from specmesh.stack.certs import cert_files

    job = parse_command("certs", services["certs"]["command"])
    files = cert_files(job.out)
    assert f"certs:{job.out}" in services["certs"]["volumes"]
    ca, cert, key = str(files.ca), str(files.server_cert), str(files.server_key)
    configs = {}
    for name in (*MODEL_SERVICES, "gateway"):
        service = services[name]
        assert f"certs:{job.out}:ro" in service["volumes"], name
        configs[name] = config = parse_command(name, service["command"], service["environment"])
        client_ca = ca if name in MODEL_SERVICES else ""  # the gateway's clients use API keys
        assert config.server_tls() == ServerTls(cert, key, client_ca), name
        probe = service["healthcheck"]["test"][5:]
        assert flag(probe, "--ca") == ca, name
        if name in MODEL_SERVICES:  # mutual TLS: the replica's own certificate
            assert (flag(probe, "--cert"), flag(probe, "--key")) == (cert, key), name
    gateway = configs["gateway"]
    assert gateway.replica_tls() == ClientTls(ca, str(files.gateway_cert), str(files.gateway_key))
    for target in parse_targets(f"{gateway.drafters},{gateway.verifiers}"):
        assert target.host in job.host, f"the server certificate does not name {target.host}"


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
        env={**os.environ, "SPECMESH_REDIS_PASSWORD": "0123abcd"},  # required by the file
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
