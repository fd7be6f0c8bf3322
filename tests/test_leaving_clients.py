"""A client may leave at any moment: mid-stream, after its last chunk but before the call's status,
before the first event of an SSE stream reaches it. Its session must end everywhere at once (keys
out of Redis, KV released on the replicas), without waiting for Python's garbage collector to
finalize an abandoned generator: the gateway here runs with the cyclic collector off, so a session
that only a collection would end stays, its lease renewed, until the test fails.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import threading
from collections.abc import AsyncIterator, Iterator
from typing import Any

import grpc
import httpx2 as httpx
import pytest
import redis
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from specmesh.rpc.metrics import RpcMetrics
from specmesh.rpc.server import RpcService, interceptors, rpc_stream
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


# ---- the server's side of a stream a client left ------------------------------------------------

_ENTERED: contextvars.ContextVar[str] = contextvars.ContextVar("entered", default="")


class Endless(RpcService):
    """A Gateway whose GenerateStream yields forever without awaiting: a cancellation can only land
    while a message is being sent, the case that leaves a handler parked at its `yield`."""

    full_name = "specmesh.v1.Gateway"  # a method the tracing interceptor traces

    def __init__(self) -> None:
        self.metrics = RpcMetrics("endless")
        self.closed: list[str] = []

    @rpc_stream
    async def GenerateStream(self, request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        token = _ENTERED.set("in the call")
        try:
            while True:
                yield b"chunk"
        finally:
            try:
                _ENTERED.reset(token)  # ValueError when this runs in another task's Context
                self.closed.append("in the call")
            except ValueError:
                self.closed.append("elsewhere")


def test_a_stream_a_client_left_is_closed_and_counted_in_its_own_call(caplog) -> None:
    """A client that cancels while a message is being sent used to leave the handler and the
    tracing interceptor's generator parked at their `yield`, closed later by the event loop's
    finalizer in other tasks: opentelemetry logged "Failed to detach context" as an error, the
    handler's `finally` ran outside the call, and the call was never counted
    (specmesh.rpc.server's `_StreamsClosedInTheirCall`)."""
    service = Endless()
    method = grpc.unary_stream_rpc_method_handler(service.GenerateStream)  # bytes in, bytes out
    port, ready, loop, stop = free_port(), threading.Event(), asyncio.new_event_loop(), asyncio.Event()

    async def serve() -> None:
        server = grpc.aio.server(interceptors=interceptors())
        server.add_generic_rpc_handlers(
            [grpc.method_handlers_generic_handler(service.full_name, {"GenerateStream": method})]
        )
        health_pb2_grpc.add_HealthServicer_to_server(health.aio.HealthServicer(), server)
        server.add_insecure_port(f"127.0.0.1:{port}")
        await server.start()
        ready.set()
        await stop.wait()
        await server.stop(1)

    thread = threading.Thread(target=loop.run_until_complete, args=(serve(),), daemon=True)
    thread.start()
    try:
        assert ready.wait(30)
        with (
            caplog.at_level(logging.ERROR, logger="opentelemetry.context"),
            grpc.insecure_channel(f"127.0.0.1:{port}") as channel,
        ):
            stream = channel.unary_stream(f"/{service.full_name}/GenerateStream")
            for _ in range(3):
                call = stream(b"")
                for _, chunk in zip(range(5), call, strict=False):
                    assert chunk == b"chunk"
                call.cancel()
            wait_until(lambda: len(service.closed) == 3, timeout=30, what="the three handlers to close")
            # a coroutine handler's stream (health's Watch, which writes its messages itself)
            watch = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(), timeout=30)
            assert next(watch).status == health_pb2.HealthCheckResponse.SERVING
            watch.cancel()
        assert service.closed == ["in the call"] * 3
        assert service.metrics.requests.labels("GenerateStream", "CANCELLED")._value.get() == 3
        assert not [r for r in caplog.records if r.name == "opentelemetry.context"], caplog.text
    finally:
        loop.call_soon_threadsafe(stop.set)
        thread.join(30)
