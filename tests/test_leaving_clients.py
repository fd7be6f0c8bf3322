"""A client may leave at any moment: mid-stream, after its last chunk but before the call's status,
before the first event of an SSE stream reaches it. Its session must end everywhere at once (keys
out of Redis, KV released on the replicas), without waiting for Python's garbage collector to
finalize an abandoned generator: the gateway here runs with the cyclic collector off, so a session
that only a collection would end stays, its lease renewed, until the test fails.
"""

from __future__ import annotations

from collections.abc import Iterator

import grpc
import httpx2 as httpx
import pytest
import redis

from specmesh.stack.ports import free_port
from specmesh.stack.redis_server import RedisServer
from tests.servers import Server, replica, start_all, stop_all, wait_until
from tests.test_gateway import gateway_grpc, make_request
from tests.test_http_api import WORDS, Stack, assert_no_sessions

pytestmark = pytest.mark.xdist_group("leaving")


class NoGcServer(Server):
    """The server with Python's cyclic garbage collector disabled from its first line."""

    def command(self) -> list[str]:
        python, _, module, *rest = super().command()
        run = f"runpy.run_module({module!r}, run_name='__main__', alter_sys=True)"
        return [python, "-c", f"import gc, runpy; gc.disable(); {run}", *rest]


@pytest.fixture(scope="module")
def stack(models, tmp_path_factory) -> Iterator[Stack]:
    logs = tmp_path_factory.mktemp("leaving")
    with RedisServer() as redis_server:
        drafter = replica("drafter_service", models["draft"], logs / "drafter.log")
        verifier = replica("verifier_service", models["target"], logs / "verifier.log")
        http_port = free_port()
        args = [
            *("--drafters", drafter.address, "--verifiers", verifier.address),
            *("--redis-url", redis_server.url, "--health-interval", "0.2", "--round-timeout", "30"),
            *("--served-model-name", "tiny", "--http-port", str(http_port)),
        ]
        gateway = NoGcServer("gateway", args, logs / "gateway.log")
        try:
            start_all(drafter, verifier, gateway)
            yield Stack(redis_server, [drafter, verifier], gateway, http_port, "tiny")
        finally:
            stop_all(drafter, verifier, gateway)


def assert_nothing_left(stack: Stack, raw_redis: redis.Redis) -> None:
    running = ("specmesh:num_requests_running", ())
    wait_until(lambda: stack.gateway.metrics()[running] == 0, what="the gateway's runs to end")
    assert_no_sessions(stack, raw_redis)


@pytest.mark.parametrize("chunks", [1, 3], ids=["after-first", "after-third"])
def test_a_grpc_stream_cancelled_mid_way_ends_its_session(stack, raw_redis, chunks: int) -> None:
    with grpc.insecure_channel(stack.gateway.address) as channel:
        stub = gateway_grpc.GatewayStub(channel)
        calls = [stub.GenerateStream(make_request(max_new_tokens=150), timeout=60) for _ in range(4)]
        for call in calls:
            for _, chunk in zip(range(chunks), call, strict=False):
                assert not chunk.finish_reason
        for call in calls:
            call.cancel()
        assert_nothing_left(stack, raw_redis)


def test_a_grpc_stream_cancelled_after_its_last_chunk_ends_its_session(stack, raw_redis) -> None:
    """The last chunk is sent before the session is cleaned up: a client that has it may cancel
    before the call's status arrives."""
    with grpc.insecure_channel(stack.gateway.address) as channel:
        stub = gateway_grpc.GatewayStub(channel)
        for _ in range(4):
            call = stub.GenerateStream(make_request(max_new_tokens=6), timeout=60)
            for chunk in call:
                if chunk.finish_reason:
                    call.cancel()
                    break
        assert_nothing_left(stack, raw_redis)


@pytest.mark.parametrize("n", [1, 2])
@pytest.mark.parametrize("events", [0, 1, 3])
def test_an_sse_client_that_leaves_ends_its_sessions(stack, raw_redis, n: int, events: int) -> None:
    """events: the data events read before the connection is closed (0: the response's headers)."""
    body = {"model": "tiny", "prompt": WORDS, "max_tokens": 150, "temperature": 0, "stream": True, "n": n}
    body["speculation"] = {"method": "chain", "depth": 2}
    with httpx.Client(timeout=60) as http:
        for _ in range(3):
            with http.stream("POST", f"{stack.base_url}/v1/completions", json=body) as response:
                assert response.status_code == 200
                lines = (line for line in response.iter_lines() if line.startswith("data: "))
                for _, line in zip(range(events), lines, strict=False):
                    assert line != "data: [DONE]"
    assert_nothing_left(stack, raw_redis)


def test_an_sse_client_that_leaves_before_done_ends_its_session(stack, raw_redis) -> None:
    body = {"model": "tiny", "prompt": WORDS, "max_tokens": 6, "temperature": 0, "stream": True}
    with httpx.Client(timeout=60) as http:
        for _ in range(4):
            with http.stream("POST", f"{stack.base_url}/v1/completions", json=body) as response:
                for line in response.iter_lines():
                    if '"finish_reason": "' in line or '"finish_reason":"' in line:
                        break
    assert_nothing_left(stack, raw_redis)
