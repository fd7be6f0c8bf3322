"""gateway.pools against real grpc.aio servers that run the standard health service."""

from __future__ import annotations

import asyncio
import gc
import logging
import time

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from gateway.pools import NoHealthyReplica, ReplicaPool, Target, parse_targets
from specmesh.core.sampling import SamplingParams
from specmesh.rpc.tick_client import Role
from specmesh.rpc.ticks import Opened

# every replica every round, idle or not (the idle interval has its own test)
FAST = {"health_interval": 0.05, "idle_health_interval": 0.05, "health_timeout": 0.5, "failure_cooldown": 0.2}


class HealthServer:
    """A gRPC server with only grpc.health.v1, like a replica without its model."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0) -> None:
        self.host, self.port = host, port
        self.server: grpc.aio.Server | None = None
        self.servicer = health.aio.HealthServicer()

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    async def start(self) -> HealthServer:
        self.server = grpc.aio.server()
        health_pb2_grpc.add_HealthServicer_to_server(self.servicer, self.server)
        self.port = self.server.add_insecure_port(f"{self.host}:{self.port}")
        await self.server.start()
        return self

    async def stop(self) -> None:
        await self.server.stop(None)


async def servers(n: int) -> list[HealthServer]:
    return [await HealthServer().start() for _ in range(n)]


async def until(predicate, timeout: float = 3.0) -> None:
    async def poll():
        while not predicate():
            await asyncio.sleep(0.02)

    async with asyncio.timeout(timeout):
        await poll()


def test_parse_targets():
    assert parse_targets("a:1, b:2,a:1") == [Target("a", 1, False), Target("b", 2, False)]
    assert parse_targets(["dns:///drafter:50061", "[::1]:7"]) == [
        Target("drafter", 50061, True),
        Target("::1", 7, False),
    ]
    assert Target("::1", 7, False).address == "[::1]:7"
    for bad in ("", "a", "a:b", "a:0", "dns:///name", ":5"):
        with pytest.raises(ValueError):
            parse_targets(bad)


def test_static_list_affinity_and_spread():
    async def scenario():
        a, b = await servers(2)
        async with ReplicaPool(f"{a.address},{b.address}", name="drafter", **FAST) as pool:
            assert pool.healthy() == [a.address, b.address]
            first = pool.pick("s1")
            assert all(pool.pick("s1") == first for _ in range(5))  # affinity
            second = pool.pick("s2")
            assert {first, second} == {a.address, b.address}  # least loaded spreads sessions
            assert pool.pick("s3", preferred=first) == first  # the stored assignment wins
            assert pool.pick("s3", exclude=[first]) == second
            pool.release("s3")
            assert pool.assigned("s3") is None
        await a.stop()
        await b.stop()

    asyncio.run(scenario())


def test_failover_when_a_replica_stops_and_recovery():
    async def scenario():
        a, b = await servers(2)
        async with ReplicaPool([a.address, b.address], name="verifier", **FAST) as pool:
            session_on = {pool.pick(s): s for s in ("s1", "s2")}
            moved = session_on[a.address]
            await a.stop()
            await until(lambda: pool.healthy() == [b.address])
            assert pool.pick(moved) == b.address
            assert pool.pick(moved) == b.address  # and it stays there
            restarted = await HealthServer(port=a.port).start()
            await until(lambda: a.address in pool.healthy())
            assert pool.pick(moved) == b.address  # its cache is on b now: no move back
            await restarted.stop()
        await b.stop()

    asyncio.run(scenario())


def test_mark_failed_takes_a_replica_out_for_the_cooldown():
    async def scenario():
        a, b = await servers(2)
        async with ReplicaPool([a.address, b.address], **FAST) as pool:
            on = pool.pick("s")
            other = b.address if on == a.address else a.address
            pool.mark_failed(on, "Draft failed: UNAVAILABLE")
            assert pool.healthy() == [other]
            assert pool.pick("s") == other
            await until(lambda: on in pool.healthy())  # healthy again after the cooldown
        await a.stop()
        await b.stop()

    asyncio.run(scenario())


def test_not_serving_and_no_healthy_replica():
    async def scenario():
        (a,) = await servers(1)
        async with ReplicaPool(a.address, name="drafter", **FAST) as pool:
            await a.servicer.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
            await until(lambda: not pool.healthy())
            with pytest.raises(NoHealthyReplica, match="NOT_SERVING"):
                pool.pick("s")
            await a.servicer.set("", health_pb2.HealthCheckResponse.SERVING)
            assert await pool.wait_healthy(1, timeout=3) == [a.address]
            await a.stop()
            await until(lambda: not pool.healthy())
            with pytest.raises(NoHealthyReplica, match="no healthy drafter replica"):
                pool.pick("s")
            with pytest.raises(TimeoutError):
                await pool.wait_healthy(1, timeout=0.2)

    asyncio.run(scenario())


class HungHealth(health.aio.HealthServicer):
    """A replica that accepts connections but answers nothing (SIGSTOPped, in effect)."""

    async def Check(self, request, context):
        await asyncio.Event().wait()


def test_a_hung_replicas_probe_does_not_hold_back_the_others():
    """A paused drafter's probe runs to its timeout; a probe round that waited for it held back a
    restarted spare's recovery, and the gateway found no spare for a slow call (CI saw 4.02 s
    stalls against a 4 s limit in tests/test_gateway.py)."""

    async def scenario():
        a, b = await servers(2)
        async with ReplicaPool(
            [a.address, b.address], name="drafter", **{**FAST, "health_timeout": 3.0}
        ) as pool:
            await b.servicer.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
            await until(lambda: pool.healthy() == [a.address])
            hung = HealthServer(port=a.port)
            hung.servicer = HungHealth()
            await a.stop()
            await hung.start()  # a's probes now hang for the 3 s timeout
            await asyncio.sleep(0.2)  # a probe of a is in flight
            await b.servicer.set("", health_pb2.HealthCheckResponse.SERVING)
            await until(lambda: b.address in pool.healthy(), timeout=1.0)
            await hung.stop()
        await b.stop()

    asyncio.run(scenario())


class CountingHealth(health.aio.HealthServicer):
    def __init__(self) -> None:
        super().__init__()
        self.checks = 0

    async def Check(self, request, context):
        self.checks += 1
        return await super().Check(request, context)


def test_idle_replicas_are_probed_at_the_idle_interval():
    """A replica the pool's tick loop sends work to is probed every round; a healthy idle one
    every idle interval (a probe wakes two idle processes, ~20 ms of CPU a side on a small host);
    one whose probe failed, or that is unhealthy, every round again; after a failed call every
    replica at the next round (the spares)."""

    async def scenario():
        a, b = HealthServer(), HealthServer()
        a.servicer, b.servicer = CountingHealth(), CountingHealth()
        await a.start()
        await b.start()
        idle = 0.6
        options = {**FAST, "idle_health_interval": idle, "role": Role.VERIFIER}
        async with ReplicaPool([a.address, b.address], **options) as pool:
            busy = pool.loop(b.address)
            start, began = (a.servicer.checks, b.servicer.checks), time.monotonic()
            for _ in range(30):
                busy._on_tick(1)  # what the loop calls for every tick it sends
                await asyncio.sleep(0.05)
            elapsed = time.monotonic() - began
            idle_checks, busy_checks = a.servicer.checks - start[0], b.servicer.checks - start[1]
            assert 1 <= idle_checks <= 1 + elapsed / (idle - 0.025), (idle_checks, elapsed)
            assert busy_checks >= 15, busy_checks

            # a failed probe of the idle one: probed every round until out (2 failures)
            await a.servicer.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
            failed_at = a.servicer.checks
            await until(lambda: a.servicer.checks > failed_at, timeout=2 * idle)
            await until(lambda: pool.healthy() == [b.address], timeout=0.3)
            await a.servicer.set("", health_pb2.HealthCheckResponse.SERVING)
            await until(lambda: a.address in pool.healthy(), timeout=0.3)  # unhealthy: every round

            # idle again; a failed call elsewhere makes it due at the next round
            await asyncio.sleep(0.1)  # its next probe would come ~0.5 s from now
            before = a.servicer.checks
            pool.mark_failed(b.address, "Verify failed: UNAVAILABLE")
            await until(lambda: a.servicer.checks > before, timeout=0.3)
        await a.stop()
        await b.stop()

    asyncio.run(scenario())


def test_an_idle_pool_sleeps_through_the_rounds_that_probe_nothing():
    """While every replica is idle and healthy the pool wakes for its next idle probe only (a
    round wakes the gateway: ~8 ms of CPU on a small shared host); a tick to an idle replica ends
    that rest at once, and the replica is probed every round from then on; so does a failed call."""

    async def scenario():
        a = HealthServer()
        a.servicer = CountingHealth()
        await a.start()
        idle = 1.0
        options = {**FAST, "idle_health_interval": idle, "role": Role.VERIFIER}
        async with ReplicaPool([a.address], **options) as pool:
            rounds, began = pool.rounds, time.monotonic()
            await asyncio.sleep(1.6)
            elapsed = time.monotonic() - began
            # a probe's round and the one after it (its answer still in flight) per idle interval;
            # every health_interval (0.05 s) would be ~32
            assert pool.rounds - rounds <= 2 * (1 + elapsed / (idle - 0.025)), pool.rounds - rounds

            probed = a.servicer.checks
            await until(lambda: a.servicer.checks > probed, timeout=2 * idle)  # an idle probe now
            await asyncio.sleep(0.2)  # its answer is in: the pool rests until the next, ~0.8 s away
            before = a.servicer.checks
            pool.loop(a.address)._on_tick(1)  # what the loop calls for every tick it sends
            await until(lambda: a.servicer.checks > before, timeout=0.4)
            for _ in range(10):
                pool.loop(a.address)._on_tick(1)
                await asyncio.sleep(0.05)
            assert a.servicer.checks - before >= 5, a.servicer.checks - before

            # idle again; a failed call ends the rest too (the spares are checked at once)
            await asyncio.sleep(idle)
            probed = a.servicer.checks
            await until(lambda: a.servicer.checks > probed, timeout=2 * idle)
            await asyncio.sleep(0.2)
            before = a.servicer.checks
            pool.mark_failed(a.address, "Verify failed: UNAVAILABLE")
            await until(lambda: a.servicer.checks > before, timeout=0.4)
        await a.stop()

    asyncio.run(scenario())


def test_service_specific_health():
    async def scenario():
        (a,) = await servers(1)
        await a.servicer.set("specmesh.v1.Drafter", health_pb2.HealthCheckResponse.SERVING)
        async with ReplicaPool(a.address, service="specmesh.v1.Drafter", **FAST) as pool:
            assert pool.healthy() == [a.address]
        async with ReplicaPool(a.address, service="specmesh.v1.Verifier", **FAST) as pool:
            assert pool.healthy() == []  # NOT_FOUND: that server is no verifier
        await a.stop()

    asyncio.run(scenario())


def test_dns_name_resolves_to_replicas():
    async def scenario():
        server = await HealthServer(host="[::]").start()  # all interfaces, v4 and v6
        async with ReplicaPool(f"dns:///localhost:{server.port}", resolve_interval=0.1, **FAST) as pool:
            addresses = pool.addresses()
            assert f"127.0.0.1:{server.port}" in addresses
            assert all(a.endswith(f":{server.port}") for a in addresses)
            assert pool.healthy() == addresses
            assert pool.pick("s") in addresses
        async with ReplicaPool(f"dns:///no-such-host.invalid:{server.port}", **FAST) as pool:
            assert pool.addresses() == []
            with pytest.raises(NoHealthyReplica, match="resolved to no address"):
                pool.pick("s")
        await server.stop()

    asyncio.run(scenario())


def test_a_tick_stream_that_fails_leaves_no_task_behind(caplog):
    """The tick loops' streams go over channels without the tracing interceptors: an intercepted
    stream call relays every write through a queue and a task of its own (grpc.aio's
    InterceptedStreamStreamCall), and when the stream ended in an error that task stayed pending
    for good (asyncio logged it as destroyed, and its generator's close as an error)."""

    async def refuse(requests, context):  # a verifier that ends every tick stream in an error
        async for _ in requests:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "going away")

    async def scenario():
        server = HealthServer()
        await server.start()
        ticks = grpc.stream_stream_rpc_method_handler(refuse)
        server.server.add_generic_rpc_handlers(
            [grpc.method_handlers_generic_handler("specmesh.v1.Verifier", {"Ticks": ticks})]
        )
        async with ReplicaPool(server.address, name="verifier", role=Role.VERIFIER, **FAST) as pool:
            loop = pool.loop(server.address)
            for n in range(3):
                session = Opened(f"s{n}", f"key-{n}", SamplingParams(temperature=0.0, seed=1))
                with pytest.raises(grpc.aio.AioRpcError) as failed:
                    await loop.verify(session, 1, [1], None)
                assert failed.value.code() == grpc.StatusCode.UNAVAILABLE
            await asyncio.sleep(0.1)
            left = [t for t in asyncio.all_tasks() if "request_iterator" in repr(t.get_coro())]
            assert not left, left
        await server.stop()

    with caplog.at_level(logging.ERROR, logger="asyncio"):
        asyncio.run(scenario())
        gc.collect()
    assert not caplog.records, caplog.text
