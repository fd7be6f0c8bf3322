"""No gateway is a single point of failure for a stream (issue 27): a stream whose gateway is
SIGKILLed, or SIGTERMed in a rollout, is resumed on another gateway by the client helper
(gateway/client.py) and gives exactly the undisturbed output; two gateways asked to resume one
session at once run it once; an abandoned session leaves Redis and the replicas.

Real processes: Redis, a drafter and a verifier on the tiny pair (the verifier slowed to 15 ms a
forward, so that a kill lands mid-stream), three gateways on the same Redis and replicas.
"""

from __future__ import annotations

import concurrent.futures
import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import grpc
import httpx2 as httpx
import pytest
import redis

from gateway.client import RetryBudget, resumable_sse, resumable_stream, resume_request
from specmesh.core.sampling import SamplingParams
from specmesh.stack.ports import free_port
from specmesh.stack.redis_server import RedisServer
from tests.servers import Server, redis_client, replica, session_keys, start_all, stop_all, wait_until
from tests.test_engine import PROMPT, SPECS
from tests.test_gateway import gateway_grpc, gateway_pb2, make_request

pytestmark = pytest.mark.xdist_group("resume")

LEASE = 1.0
IDLE = 4.0  # the replicas release a session nobody touched for this long
TOKENS = 120


@dataclass
class Mesh:
    redis: RedisServer
    drafter: Server
    verifier: Server
    gateways: list[Server]
    http_ports: list[int]

    def alive(self) -> list[int]:
        return [i for i, g in enumerate(self.gateways) if g.proc is not None and g.proc.poll() is None]

    def stub(self):
        """A stub over the live gateways' addresses, the first that takes the connection serving it
        (gRPC's pick_first): what a DNS name or a proxy in front of them gives. A stopping gateway
        has closed its port, so the next one answers."""
        addresses = ",".join(self.gateways[i].address for i in self.alive())
        return gateway_grpc.GatewayStub(grpc.insecure_channel(f"ipv4:{addresses}"))

    def url(self) -> str:
        return f"http://127.0.0.1:{self.http_ports[self.alive()[0]]}/v1/completions"

    def restart(self, i: int) -> None:
        if self.gateways[i].proc.poll() is None:
            self.gateways[i].kill()
        self.gateways[i].start()
        self.gateways[i].wait_serving()


@pytest.fixture(scope="module")
def mesh(models, tmp_path_factory) -> Iterator[Mesh]:
    logs = tmp_path_factory.mktemp("resume")
    with RedisServer() as redis_server:
        idle = ["--session-idle-seconds", str(IDLE)]
        drafter = replica("drafter_service", models["draft"], logs / "drafter.log", idle)
        verifier = replica(
            "verifier_service", models["target"], logs / "verifier.log", [*idle, "--forward-latency-ms", "15"]
        )
        ports = [free_port() for _ in range(3)]
        common = [
            *("--drafters", drafter.address, "--verifiers", verifier.address),
            *("--redis-url", redis_server.url),
            *("--lease-seconds", str(LEASE), "--session-ttl", "3", "--grace-seconds", "1"),
            *("--health-interval", "0.2", "--max-new-tokens-limit", "250"),
        ]  # fmt: skip
        gateways = [
            Server("gateway", [*common, "--http-port", str(p)], logs / f"gateway{i}.log")
            for i, p in enumerate(ports)
        ]
        try:
            start_all(drafter, verifier, *gateways)
            yield Mesh(redis_server, drafter, verifier, gateways, ports)
        finally:
            stop_all(drafter, verifier, *gateways)


@pytest.fixture(autouse=True)
def all_gateways_up(mesh) -> None:
    """Each test starts with the three gateways serving: the gateway a test killed or stopped is
    started again here (after a failed test too)."""
    for i in range(len(mesh.gateways)):
        if i not in mesh.alive():
            mesh.restart(i)


@pytest.fixture
def raw(mesh) -> Iterator[redis.Redis]:
    with redis_client(mesh.redis.url) as client:
        yield client


def reference(mesh: Mesh, request) -> list[int]:
    return list(mesh.stub().Generate(request, timeout=60).token_ids)


def dsi(request):
    """`request` in DSI mode (gateway/dsi.py), its shape fixed: at T = 0 its output is the target's
    greedy decode whatever the timing (at T > 0 a seed does not fix DSI's text)."""
    request.speculation.CopyFrom(gateway_pb2.Speculation(dsi=True, depth=3, parallel=1))
    return request


# greedy through draft trees and DSI, and seeded T = 0.8 with a fixed speculation shape
CASES = {
    "greedy-chain": make_request(SPECS["chain"], TOKENS),
    "greedy-dsi": dsi(make_request(SPECS["chain"], TOKENS)),
    "t0.8-chain": make_request(SPECS["chain"], TOKENS, SamplingParams(0.8, seed=7)),
    "t0.8-none": make_request(SPECS["none"], TOKENS, SamplingParams(0.8, seed=9)),
}


def interrupted(mesh: Mesh, request, fault) -> tuple[list[int], float, Any]:
    """Stream `request` through the helper; `fault(gateway index)` hits the serving gateway after the
    first chunk. -> (tokens received, the longest wait between two chunks, the last chunk)."""
    serving = mesh.alive()[0]
    tokens, gaps, last, hit, chunk = [], [], None, False, None
    for chunk in resumable_stream(mesh.stub, request, budget=RetryBudget(attempts=30), timeout=60):
        now = time.monotonic()
        if last is not None:
            gaps.append(now - last)
        last = now
        tokens += chunk.token_ids
        if not hit and tokens:
            hit = True
            fault(serving)
    return tokens, max(gaps, default=0.0), chunk


@pytest.mark.parametrize("case", CASES)
def test_a_sigkilled_gateways_stream_is_resumed_elsewhere_identically(mesh, raw, case) -> None:
    want = reference(mesh, CASES[case])
    got, stall, final = interrupted(mesh, CASES[case], lambda i: mesh.gateways[i].kill())
    assert got == want  # every token once, in order: none lost, none repeated
    assert len(want) > 20
    assert final.stats.dsi_lookahead == (3 if "dsi" in case else 0)  # resumed in its own mode
    print(f"{case}: {len(got)} tokens, longest stall {stall:.2f}s")
    assert stall < LEASE + 3.0
    wait_until(lambda: not session_keys(raw), what="the sessions' keys to go")


def test_sigterm_hands_the_stream_over_without_a_visible_error(mesh, raw) -> None:
    request = CASES["t0.8-chain"]
    want = reference(mesh, request)
    terminated = []

    def rollout(i: int) -> None:
        mesh.gateways[i].proc.send_signal(signal.SIGTERM)
        terminated.append(i)

    got, stall, _ = interrupted(mesh, request, rollout)
    assert got == want
    gateway = mesh.gateways[terminated[0]]
    assert gateway.proc.wait(timeout=15) == 0  # it stopped on its own, cleanly
    assert "handed sessions over" in gateway.log.read_text()
    print(f"rollout: longest stall {stall:.2f}s")
    wait_until(lambda: not session_keys(raw), what="the sessions' keys to go")


def test_two_gateways_resuming_one_session_at_once_run_it_once(mesh, raw) -> None:
    request = CASES["greedy-chain"]
    want = reference(mesh, request)
    owner = mesh.gateways[2]
    with grpc.insecure_channel(owner.address) as channel:
        stream = gateway_grpc.GatewayStub(channel).GenerateStream(request, timeout=60)
        first = next(stream)
        owner.kill()
        with pytest.raises(grpc.RpcError):
            list(stream)
    have = len(first.token_ids)

    def resume(i: int):
        with grpc.insecure_channel(mesh.gateways[i].address) as channel:
            stub = gateway_grpc.GatewayStub(channel)
            try:
                return list(stub.GenerateStream(resume_request(first.session_id, have), timeout=60))
            except grpc.RpcError as exc:
                return exc

    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        outcomes = list(pool.map(resume, [0, 1]))
    runs = [o for o in outcomes if isinstance(o, list)]
    errors = [o for o in outcomes if isinstance(o, grpc.RpcError)]
    assert len(runs) == 1 and len(errors) == 1, outcomes
    assert errors[0].code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "run by another gateway" in errors[0].details()
    assert list(first.token_ids) + [t for c in runs[0] for t in c.token_ids] == want
    assert runs[0][-1].finish_reason
    wait_until(lambda: not session_keys(raw), what="the sessions' keys to go")


def test_an_sse_stream_is_resumed_with_last_event_id(mesh, raw) -> None:
    body = {"model": mesh_model(mesh), "prompt": PROMPT, "max_tokens": TOKENS, "temperature": 0.8,
            "seed": 5, "stream": True, "speculation": {"method": "chain", "depth": 3}}  # fmt: skip
    plain = httpx.post(mesh.url(), json={**body, "stream": False}, timeout=60).json()["choices"][0]["text"]
    serving, texts, killed = mesh.alive()[0], [], False
    for event in resumable_sse(mesh.url, body, budget=RetryBudget(attempts=30)):
        texts.append(event["choices"][0]["text"] if event["choices"] else "")
        if not killed:
            killed = True
            mesh.gateways[serving].kill()
    assert "".join(texts) == plain
    wait_until(lambda: not session_keys(raw), what="the sessions' keys to go")


def test_an_abandoned_session_expires_and_its_replicas_release_it(mesh, raw) -> None:
    owner = mesh.gateways[0]
    with grpc.insecure_channel(owner.address) as channel:
        stream = gateway_grpc.GatewayStub(channel).GenerateStream(CASES["greedy-chain"], timeout=60)
        next(stream)
        owner.kill()
        with pytest.raises(grpc.RpcError):
            list(stream)
    assert session_keys(raw)  # the dead gateway deleted nothing
    wait_until(
        lambda: not session_keys(raw), timeout=10, what="the session's keys to expire (--session-ttl 3)"
    )
    for server in (mesh.drafter, mesh.verifier):
        wait_until(
            lambda s=server: s.metrics()[("specmesh:num_sessions", ())] == 0,
            timeout=3 * IDLE, what=f"{server.module} to release the idle session",
        )  # fmt: skip
    assert mesh.verifier.metrics()[("specmesh:idle_sessions_released_total", ())] >= 1


def mesh_model(mesh: Mesh) -> str:
    return httpx.get(mesh.url().replace("/completions", "/models"), timeout=10).json()["data"][0]["id"]


def test_sigusr1_logs_where_every_task_waits_and_the_gateway_goes_on(mesh) -> None:
    """The tool for a stream that hangs (specmesh/rpc/server.py, dump_tasks)."""
    gateway = mesh.gateways[1]
    gateway.proc.send_signal(signal.SIGUSR1)
    wait_until(lambda: '"msg": "task"' in gateway.log.read_text(), what="the task dump")
    dumped = [line for line in gateway.log.read_text().splitlines() if '"msg": "task"' in line]
    assert any("serve" in line for line in dumped), dumped[:3]
    with grpc.insecure_channel(gateway.address) as channel:
        assert gateway_grpc.GatewayStub(channel).Generate(CASES["greedy-chain"], timeout=60).token_ids
