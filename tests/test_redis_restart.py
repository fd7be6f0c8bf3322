"""Sessions survive a Redis restart (issue 14), with real processes and no mocks.

A stack like `specmesh up`'s: Redis as specmesh/stack/redis_server.py runs it (password, AOF
fsynced every second, CONFIG / DEBUG / KEYS disabled), a drafter and a verifier on the tiny models
(slowed to 5 ms a forward, so streams are long enough to be interrupted), and the gateway with
its default --redis-reconnect-seconds (30). Redis is killed (SIGKILL) while several streams are
running and started again ~2 s later on the same port with the same AOF directory: every stream
finishes OK with the tokens of an undisturbed run. And the supervisor of `specmesh up` restarts
its Redis with the data.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import io
import os
import signal
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import grpc
import pytest
import redis
import redis.asyncio

from specmesh.core.sampling import SamplingParams
from specmesh.stack.redis_server import RedisServer, redis_ping
from specmesh.stack.supervisor import Supervisor, plan_stack
from tests.servers import (
    Server,
    gateway_stub,
    redis_client,
    replica,
    session_keys,
    start_all,
    stop_all,
    wait_until,
)
from tests.test_engine import SPECS
from tests.test_gateway import gateway_pb2, make_request

pytestmark = pytest.mark.xdist_group("redis-restart")

TOKENS = 100
DOWN_SECONDS = 2.0
SLOW = ["--forward-latency-ms", "5"]


@dataclass
class Stack:
    redis: RedisServer
    drafter: Server
    verifier: Server
    gateway: Server


@pytest.fixture(scope="module")
def stack(models, tmp_path_factory) -> Iterator[Stack]:
    logs = tmp_path_factory.mktemp("redis-restart")
    with RedisServer() as redis_server:
        drafter = replica("drafter_service", models["draft"], logs / "drafter.log", SLOW)
        verifier = replica("verifier_service", models["target"], logs / "verifier.log", SLOW)
        args = [
            *("--drafters", drafter.address, "--verifiers", verifier.address),
            *("--redis-url", redis_server.url, "--max-new-tokens-limit", "200"),
            *("--health-interval", "0.2", "--round-timeout", "30"),
        ]
        gateway = Server("gateway", args, logs / "gateway.log")
        try:
            start_all(drafter, verifier, gateway)
            yield Stack(redis_server, drafter, verifier, gateway)
        finally:
            stop_all(drafter, verifier, gateway)


REQUESTS = {
    "greedy chain": make_request(SPECS["chain"], TOKENS),
    "greedy rsd_c": make_request(SPECS["rsd_c"], TOKENS),
    "T=1 chain seed 3": make_request(SPECS["chain"], TOKENS, SamplingParams(1.0, seed=3)),
    "T=0.8 mcsd seed 11": make_request(SPECS["mcsd_wor"], TOKENS, SamplingParams(0.8, seed=11)),
}


@dataclass
class Run:
    """One GenerateStream in a thread: its chunks, and the error that ended it, if any."""

    request: gateway_pb2.GenerateRequest
    chunks: list[gateway_pb2.GenerateChunk] = field(default_factory=list)
    error: grpc.RpcError | None = None
    started: threading.Event = field(default_factory=threading.Event)  # set at the first chunk

    def __call__(self, stub) -> None:
        try:
            for chunk in stub.GenerateStream(self.request, timeout=120):
                self.chunks.append(chunk)
                self.started.set()
        except grpc.RpcError as exc:
            self.error = exc
        finally:
            self.started.set()

    @property
    def token_ids(self) -> list[int]:
        return [t for c in self.chunks for t in c.token_ids]


def test_streams_ride_out_a_redis_restart_and_change_no_token(stack) -> None:
    with gateway_stub(stack.gateway.address) as stub:
        with concurrent.futures.ThreadPoolExecutor(len(REQUESTS)) as pool:  # the same load, no restart
            calls = {
                name: pool.submit(stub.Generate, request, timeout=120) for name, request in REQUESTS.items()
            }
            undisturbed = {name: call.result() for name, call in calls.items()}
        runs = {name: Run(request) for name, request in REQUESTS.items()}
        threads = [threading.Thread(target=run, args=(stub,)) for run in runs.values()]
        for thread in threads:
            thread.start()
        try:
            for run in runs.values():
                assert run.started.wait(60), "a stream never started"
            at_kill = {name: len(run.token_ids) for name, run in runs.items()}
            stack.redis.kill()  # a crash: the AOF directory stays
            time.sleep(DOWN_SECONDS)
        finally:
            stack.redis.start()  # same port, password and AOF directory
            for thread in threads:
                thread.join(120)
    for name, run in runs.items():
        assert run.error is None, f"{name}: {run.error.code()}: {run.error.details()}"
        assert at_kill[name] < len(run.token_ids), f"{name}: finished before Redis went down"
        expected = undisturbed[name]
        assert run.token_ids == list(expected.token_ids), name
        assert "".join(c.text for c in run.chunks) == expected.text, name
        assert run.chunks[-1].finish_reason == expected.finish_reason, name
    with redis_client(stack.redis.url) as raw:
        wait_until(lambda: not session_keys(raw), what="the sessions' keys to go")
    log = stack.gateway.log.read_text()
    assert "Redis does not answer; retrying" in log and "Redis answers again" in log
    assert stack.redis.password not in log  # the gateway logs the URL without it


def test_a_redis_that_comes_back_without_its_last_commits_ends_the_streams_without_a_duplicate(
    stack,
) -> None:
    """What a crash of the Redis host (the AOF's last second lost) or a failover to a replica that
    lagged does: Redis comes back at an older state. Emulated with real files: the AOF is copied
    while the streams run, Redis is killed a little later and restarted from that copy. A stream
    whose commits Redis lost ends with ABORTED; what it received is still exactly a prefix of the
    undisturbed tokens, never a token twice (resuming from Redis would stream those again)."""
    with gateway_stub(stack.gateway.address) as stub:
        with concurrent.futures.ThreadPoolExecutor(len(REQUESTS)) as pool:
            calls = {name: pool.submit(stub.Generate, r, timeout=120) for name, r in REQUESTS.items()}
            undisturbed = {name: call.result() for name, call in calls.items()}
        runs = {name: Run(request) for name, request in REQUESTS.items()}
        threads = [threading.Thread(target=run, args=(stub,)) for run in runs.values()]
        for thread in threads:
            thread.start()
        data = stack.redis.data_dir
        try:
            for run in runs.values():
                assert run.started.wait(60), "a stream never started"
            aof = {p: p.read_bytes() for p in data.rglob("appendonly*") if p.is_file()}  # Redis 6 / 7
            assert aof, sorted(data.iterdir())
            time.sleep(0.5)  # the streams commit more rounds, which the copy lacks
            stack.redis.kill()
            for path, content in aof.items():
                path.write_bytes(content)
        finally:
            stack.redis.start()
            for thread in threads:
                thread.join(120)
    lost = 0
    for name, run in runs.items():
        expected = list(undisturbed[name].token_ids)
        assert run.token_ids == expected[: len(run.token_ids)], f"{name}: a token repeated or changed"
        if run.error is not None:
            assert run.error.code() == grpc.StatusCode.ABORTED, f"{name}: {run.error.details()}"
            assert "lost committed rounds" in run.error.details(), run.error.details()
            lost += 1
        else:
            assert run.token_ids == expected, name
    assert lost >= 1  # the copy was taken half a second of commits before the kill
    with redis_client(stack.redis.url) as raw:
        wait_until(lambda: not session_keys(raw), what="the sessions' keys to go")


def test_the_supervisor_restarts_its_redis_with_the_data() -> None:
    """`specmesh up`'s Redis (plan_stack): SIGKILLed, restarted by the supervisor from the same
    config file, it comes back with what was written; the password is in no output."""
    plan = plan_stack("draft", "target", drafters=0, python="python")
    (spec,) = [s for s in plan.specs if s.name == "redis"]
    out = io.StringIO()

    async def scenario() -> None:
        supervisor = Supervisor([spec], output=out)
        client = redis.asyncio.Redis.from_url(plan.redis_url, decode_responses=True)
        try:
            await supervisor.start()
            await client.hset("specmesh:{s}:meta", mapping={"round": 3})
            with pytest.raises(redis.ResponseError, match="unknown command"):
                await client.execute_command("KEYS", "*")
            pid = supervisor.pid("redis")
            os.kill(pid, signal.SIGKILL)
            deadline = time.monotonic() + 20
            while supervisor.pid("redis") == pid or not await asyncio.to_thread(_pings, plan.redis_url):
                assert time.monotonic() < deadline, out.getvalue()
                await asyncio.sleep(0.1)
            await client.aclose()  # its connection died with the server: a new client
            client = redis.asyncio.Redis.from_url(plan.redis_url, decode_responses=True)
            assert await client.hget("specmesh:{s}:meta", "round") == "3"
        finally:
            await client.aclose()
            await supervisor.stop()

    try:
        asyncio.run(scenario())
    finally:
        plan.cleanup()
    assert "restart 1/3" in out.getvalue()
    password = redis.connection.parse_url(plan.redis_url)["password"]
    assert password not in out.getvalue()


def _pings(url: str) -> bool:
    options = redis.connection.parse_url(url)
    return redis_ping(options["host"], options["port"], password=options["password"])
