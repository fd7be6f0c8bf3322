"""Replica pools: which drafter / verifier replica serves a session, and failover.

A pool is built from a target list, `host:port,host:port` and/or `dns:///name:port` (a name that
resolves to several addresses, e.g. a docker compose service scaled to N replicas; re-resolved
every `resolve_interval`). A background task probes every replica each `health_interval` with the
standard grpc.health.v1 service (each answer counts as it comes; a replica whose probe is still
in flight is skipped). A healthy replica no work has gone to for at least `idle_health_interval`
is probed only that often (cf. Envoy's `no_traffic_healthy_interval`, per replica here): a probe
wakes two idle processes, and on a small shared host their cold caches made a probe a second
cost each side ~20-45 ms of CPU, taken from the forwards of the replicas in use; while every
replica is idle and healthy the task sleeps through the rounds that would probe nothing, until
the next idle probe, or a tick or a failed call wakes it. A failed call
(`mark_failed`) makes every replica due at the next round, so the spares a round may move to
are checked then; a session placed on an idle replica that died meanwhile fails over as after
any failed call, one that hangs after its per-try timeout. `pick(session_id)` keeps a session on
its replica while that replica is healthy (its KV cache is there), otherwise moves it to the
least loaded healthy one. A caller whose RPC failed calls `mark_failed(addr)`: the replica stays
out for `failure_cooldown` seconds even if its health service still says SERVING, so a flapping
replica is not picked again at once.

Single event loop: pick / mark_failed / healthy are plain methods that never await, so they need no
locks. Channels are shared per address (`channel(addr)`), for the health checks and the callers;
with `tls` (specmesh.rpc.tls.ClientTls) they are TLS channels, mutual when it has a certificate.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hashlib
import logging
import math
import socket
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from specmesh.rpc.tick_client import Role, TickLoop
from specmesh.rpc.tls import ClientTls, aio_channel
from specmesh.rpc.tracing import client_interceptors

__all__ = ["NoHealthyReplica", "ReplicaPool", "Target", "parse_targets"]

log = logging.getLogger("specmesh.gateway.pools")

# Reconnect quickly after a replica restarts (gRPC's default backoff grows to two minutes).
DEFAULT_CHANNEL_OPTIONS: tuple[tuple[str, int], ...] = (
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.min_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 2000),
    ("grpc.max_receive_message_length", 64 * 1024 * 1024),
    ("grpc.max_send_message_length", 64 * 1024 * 1024),
)
MAX_AFFINITIES = 100_000  # sessions remembered per pool; the oldest are forgotten first


class NoHealthyReplica(Exception):
    """No replica of the pool can take the session now (the gateway answers UNAVAILABLE)."""


@dataclass(frozen=True)
class Target:
    host: str
    port: int
    dns: bool  # resolve `host` (all its addresses), else `host` is the one address

    @property
    def address(self) -> str:
        return _join(self.host, self.port)


def _join(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _split(hostport: str) -> tuple[str, int]:
    if hostport.startswith("["):  # [v6]:port
        host, sep, port = hostport[1:].partition("]:")
    else:
        host, sep, port = hostport.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"expected host:port, got {hostport!r}")
    return host, int(port)


def parse_targets(spec: str | Iterable[str]) -> list[Target]:
    """`a:1,b:2,dns:///name:3` (or a list of such items) -> targets, in order, without repeats."""
    items = spec.split(",") if isinstance(spec, str) else list(spec)
    out: list[Target] = []
    for raw in (item.strip() for item in items):
        if not raw:
            continue
        dns = raw.startswith("dns:")
        hostport = raw.removeprefix("dns:").lstrip("/") if dns else raw
        target = Target(*_split(hostport), dns=dns)
        if target not in out:
            out.append(target)
    if not out:
        raise ValueError(f"no replica addresses in {spec!r}")
    return out


async def resolve(target: Target) -> list[str]:
    """All addresses of a target (TCP), in resolver order, without repeats."""
    if not target.dns:
        return [target.address]
    infos = await asyncio.get_running_loop().getaddrinfo(target.host, target.port, type=socket.SOCK_STREAM)
    return list(dict.fromkeys(_join(info[4][0], target.port) for info in infos))


@dataclass
class Replica:
    address: str
    healthy: bool = False
    failed_until: float = 0.0  # monotonic time before which a probe cannot make it healthy
    last_error: str = "not checked yet"
    sessions: int = 0  # sessions currently assigned here (for least-loaded placement)
    failed_probes: int = 0  # consecutive failed health checks
    probed_at: float = -math.inf  # monotonic time the last probe went out
    used_at: float = -math.inf  # monotonic time a tick last went to it (`_ticked`)
    kv_usage: float = 0.0  # its KV positions held / its budget, as its last tick result said


class ReplicaPool:
    """Replicas of one service (drafter or verifier), health-checked in the background."""

    def __init__(
        self,
        targets: str | Iterable[str],
        *,
        name: str = "replica",
        service: str = "",
        health_interval: float = 2.0,
        idle_health_interval: float | None = None,
        health_timeout: float = 1.0,
        resolve_interval: float = 10.0,
        failure_cooldown: float | None = None,
        unhealthy_after: int = 2,
        channel_factory: Callable[[str, bool], grpc.aio.Channel] | None = None,
        tls: ClientTls | None = None,
        role: Role | None = None,
        on_tick: Callable[[int], None] | None = None,
        max_tick_tokens: int = 0,
        on_prefix_version: Callable[[str, int], None] | None = None,
    ) -> None:
        """role: the replicas' service, for their tick loops (`loop`); on_tick(items): told of
        every tick those send; max_tick_tokens: their ticks' prefill budget (chunked prefill, 0:
        none); on_prefix_version(address, version): told of a replica's prefix summary version in
        every tick result (gateway/prefixes.py); idle_health_interval: None (or 0) = 10 x
        health_interval."""
        self.max_tick_tokens, self._on_prefix_version = max_tick_tokens, on_prefix_version
        self.targets = parse_targets(targets)
        self.name = name
        self.role, self._on_tick = role, on_tick
        self.service = service  # "" = the server as a whole
        self.health_interval = health_interval
        self.idle_health_interval = idle_health_interval or 10 * health_interval
        self.health_timeout = health_timeout
        self.resolve_interval = resolve_interval
        self.failure_cooldown = health_interval if failure_cooldown is None else failure_cooldown
        # failed probes in a row before a healthy replica is taken out: one probe that misses its
        # timeout on a busy host must not take away the spare a per-try timeout moves sessions to
        self.unhealthy_after = unhealthy_after
        self.tls = tls  # None: plaintext channels
        self._channel_factory = channel_factory or self._open_channel
        self._server_names: dict[str, str] = {}  # address -> the dns:/// name it was resolved from
        self._replicas: dict[str, Replica] = {}
        self._resolved: dict[Target, list[str]] = {}
        self._channels: dict[tuple[str, bool], grpc.aio.Channel] = {}  # by (address, traced)
        self._health_stubs: dict[str, health_pb2_grpc.HealthStub] = {}  # on those channels
        self._loops: dict[str, TickLoop] = {}
        self._affinity: OrderedDict[str, str] = OrderedDict()
        self._changed = asyncio.Condition()
        self._task: asyncio.Task[None] | None = None
        self._probing: dict[str, asyncio.Task[None]] = {}  # address -> its probe in flight
        self._poked = asyncio.Event()  # ends a long rest between rounds (`_rest`)
        self.rounds = 0  # health rounds run
        self._last_resolve = 0.0

    # ---- lifecycle ----------------------------------------------------------------------------

    async def start(self) -> ReplicaPool:
        """Resolve and probe once (so health is known on return), then keep checking."""
        await self._resolve_all()
        await self.check_now()
        self._task = asyncio.create_task(self._loop(), name=f"{self.name}-pool-health")
        return self

    async def close(self) -> None:
        tasks = [t for t in (self._task, *self._probing.values()) if t is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._task, self._probing = None, {}
        loops, self._loops = list(self._loops.values()), {}
        await asyncio.gather(*(loop.close() for loop in loops), return_exceptions=True)
        channels, self._channels, self._health_stubs = list(self._channels.values()), {}, {}
        await asyncio.gather(*(c.close() for c in channels), return_exceptions=True)

    async def __aenter__(self) -> ReplicaPool:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def _loop(self) -> None:
        while True:
            await self._rest()
            self.rounds += 1
            try:
                if time.monotonic() - self._last_resolve >= self.resolve_interval:
                    await self._resolve_all()
                # not awaited: a hung replica's probe must not delay the others'
                self._probe_all(due_only=True)
            except Exception:  # a bug must not stop health checking for good
                log.exception("%s pool: health round failed", self.name)

    async def _rest(self) -> None:
        """Until the next round: one `health_interval`, and on while no replica is due before the
        earliest idle probe (`_quiet_until`): a round that probes nothing still wakes the gateway,
        ~8 ms of CPU a time on a small shared host. A tick to an idle replica or a failed call
        (`_poke`) ends the rest at once; a probe's answer counts at the next rest, since a probe
        in flight keeps the rounds coming."""
        self._poked.clear()
        await asyncio.sleep(self.health_interval)
        wait = self._quiet_until(time.monotonic()) - time.monotonic()
        if wait > 0:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(wait):
                    await self._poked.wait()

    def _quiet_until(self, now: float) -> float:
        """When the next round has work: now while a probe is in flight, else the earliest due
        probe (`_due_at`: now for a replica probed every round) or re-resolution of a DNS target."""
        if self._probing:
            return now
        times = [self._due_at(r, now) for r in self._replicas.values()]
        if any(t.dns for t in self.targets):
            times.append(self._last_resolve + self.resolve_interval)
        return min(times, default=now + self.idle_health_interval)

    def _poke(self) -> None:
        """A replica may be due every round from now on: end a long rest (`_rest`)."""
        self._poked.set()

    # ---- membership ---------------------------------------------------------------------------

    async def _resolve_all(self) -> None:
        self._last_resolve = time.monotonic()
        for target in self.targets:
            try:
                self._resolved[target] = await resolve(target)
                if target.dns:
                    self._server_names.update(dict.fromkeys(self._resolved[target], target.host))
            except OSError as exc:  # keep the last known addresses through a DNS hiccup
                log.warning("%s pool: cannot resolve %s: %s", self.name, target.host, exc)
                self._resolved.setdefault(target, [])
        wanted = list(dict.fromkeys(a for t in self.targets for a in self._resolved.get(t, [])))
        await self._set_members(wanted)

    async def _set_members(self, addresses: Sequence[str]) -> None:
        for addr in addresses:
            if addr not in self._replicas:
                log.info("%s pool: new replica %s", self.name, addr)
                self._replicas[addr] = Replica(addr)
        gone = [addr for addr in self._replicas if addr not in addresses]
        for addr in gone:
            log.info("%s pool: replica %s no longer resolves; removed", self.name, addr)
            del self._replicas[addr]
            self._server_names.pop(addr, None)
            for session in [s for s, a in self._affinity.items() if a == addr]:
                del self._affinity[session]
            loop = self._loops.pop(addr, None)
            if loop is not None:
                await loop.close()
            self._health_stubs.pop(addr, None)
            for traced in (True, False):
                channel = self._channels.pop((addr, traced), None)
                if channel is not None:
                    await channel.close()
        # keep the configured order (deterministic placement and logs)
        self._replicas = {a: self._replicas[a] for a in addresses}
        if gone:
            await self._notify()

    def addresses(self) -> list[str]:
        return list(self._replicas)

    def channel(self, address: str, traced: bool = True) -> grpc.aio.Channel:
        """The pool's shared channel to a replica (created on first use). traced=False: one
        without the tracing interceptors, for the tick streams, which are not traced (one stream
        carries many requests); an intercepted stream call relays every write through a queue and
        a task of its own (grpc.aio's InterceptedStreamStreamCall), and that task was left pending,
        logged as destroyed, when a stream ended in an error."""
        key = (address, traced)
        if key not in self._channels:
            self._channels[key] = self._channel_factory(address, traced)
        return self._channels[key]

    def loop(self, address: str) -> TickLoop:
        """The gateway's one tick loop to a replica (created on first use): every session's work
        for it goes out in its ticks."""
        loop = self._loops.get(address)
        if loop is None:
            if self.role is None:
                raise ValueError(f"{self.name} pool: no role, no tick loops")
            loop = TickLoop(
                self.channel(address, traced=False),
                self.role,
                address,
                on_tick=lambda items: self._ticked(address, items),
                max_tick_tokens=self.max_tick_tokens,
                on_result=functools.partial(self._replica_said, address),
            )
            self._loops[address] = loop
        return loop

    def _replica_said(self, address: str, prefix_version: int, kv_usage: float) -> None:
        """What a tick result says of its replica: its KV usage, its prefix summary's version."""
        replica = self._replicas.get(address)
        if replica is not None:
            replica.kv_usage = kv_usage
        if self._on_prefix_version is not None and prefix_version:
            self._on_prefix_version(address, prefix_version)

    def kv_usage(self) -> float:
        """The healthy replicas' mean KV usage, as their tick results said (0: none healthy)."""
        usage = [self._replicas[a].kv_usage for a in self.healthy()]
        return sum(usage) / len(usage) if usage else 0.0

    def _ticked(self, address: str, items: int) -> None:
        """A tick went to this replica: it is in use, and probed every round (`_due`)."""
        replica = self._replicas.get(address)
        if replica is not None:
            now = time.monotonic()
            if now - replica.used_at >= self.idle_health_interval:
                self._poke()  # idle until now: probed every round from here on
            replica.used_at = now
        if self._on_tick is not None:
            self._on_tick(items)

    def _open_channel(self, address: str, traced: bool) -> grpc.aio.Channel:
        """The default channel: TLS when the pool has `tls`, the replica's certificate checked
        for the name its address was resolved from (a dns:/// target is dialled by IP)."""
        return aio_channel(
            address,
            self.tls,
            options=DEFAULT_CHANNEL_OPTIONS,
            interceptors=client_interceptors() if traced else None,
            server_name=self._server_names.get(address, ""),
        )

    # ---- health -------------------------------------------------------------------------------

    async def check_now(self) -> None:
        """Probe every replica once, concurrently, and wait for the answers."""
        await asyncio.gather(*self._probe_all())

    def _probe_all(self, due_only: bool = False) -> list[asyncio.Task[None]]:
        """A probe for every replica that has none in flight (due_only: and is due, `_due`). Each
        answer counts as soon as it is in: a paused replica's probe runs to its timeout, and a round
        that waited for it held back a restarted spare's recovery (the gateway then found no spare
        for a slow call)."""
        tasks, now = [], time.monotonic()
        for replica in self._replicas.values():
            task = self._probing.get(replica.address)
            if task is None:
                if due_only and not self._due(replica, now):
                    continue
                replica.probed_at = now
                task = asyncio.create_task(self._check(replica), name=f"{self.name}-probe")
                self._probing[replica.address] = task
                task.add_done_callback(lambda _, address=replica.address: self._probing.pop(address, None))
            tasks.append(task)
        return tasks

    def _due(self, replica: Replica, now: float) -> bool:
        return self._due_at(replica, now) <= now

    def _due_at(self, replica: Replica, now: float) -> float:
        """When its next probe is due: now (every round) for a replica in use, unhealthy or whose
        last probe failed; for a healthy idle one `idle_health_interval` after its last probe
        (half a round early, so the rounds' jitter does not add a round), which `mark_failed`
        makes the next round."""
        idle = self.idle_health_interval
        if not replica.healthy or replica.failed_probes or now - replica.used_at < idle:
            return now
        return replica.probed_at + idle - self.health_interval / 2

    async def _check(self, replica: Replica) -> None:
        try:
            error = await self._probe(replica.address)
        except Exception:  # a bug must not stop health checking, nor vanish in an unawaited task
            log.exception("%s pool: probe of %s failed", self.name, replica.address)
            return
        if self._replicas.get(replica.address) is not replica:
            return  # removed meanwhile
        replica.failed_probes = 0 if error is None else replica.failed_probes + 1
        tolerated = replica.healthy and 0 < replica.failed_probes < self.unhealthy_after
        healthy = (error is None or tolerated) and time.monotonic() >= replica.failed_until
        changed = healthy != replica.healthy
        if changed:
            level = logging.INFO if healthy else logging.WARNING
            log.log(level, "%s pool: %s is %s", self.name, replica.address, error or "healthy")
        replica.healthy = healthy
        replica.last_error = error or ("cooling down after a failure" if not healthy else "")
        if changed:
            await self._notify()

    async def _probe(self, address: str) -> str | None:
        """None if the replica answers SERVING, else why not."""
        stub = self._health_stubs.get(address)
        if stub is None:  # one per replica: a stub's making was a fifth of an idle probe's CPU
            stub = self._health_stubs[address] = health_pb2_grpc.HealthStub(self.channel(address))
        try:
            reply = await stub.Check(
                health_pb2.HealthCheckRequest(service=self.service), timeout=self.health_timeout
            )
        except grpc.aio.AioRpcError as exc:
            return f"health check failed: {exc.code().name} {exc.details() or ''}".strip()
        if reply.status != health_pb2.HealthCheckResponse.SERVING:
            return f"health status {health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)}"
        return None

    def mark_failed(self, address: str, reason: str = "marked failed by a caller") -> None:
        """A call to this replica failed: take it out until a health check after the cooldown."""
        replica = self._replicas.get(address)
        if replica is None:
            return
        if replica.healthy:
            log.warning("%s pool: %s taken out: %s", self.name, address, reason)
        replica.healthy = False
        replica.failed_until = time.monotonic() + self.failure_cooldown
        replica.last_error = reason
        for other in self._replicas.values():  # the spares: checked at the next round (`_due`)
            other.probed_at = -math.inf
        self._poke()

    def healthy(self) -> list[str]:
        return [r.address for r in self._replicas.values() if r.healthy]

    def is_healthy(self, address: str) -> bool:
        replica = self._replicas.get(address)
        return replica is not None and replica.healthy

    async def wait_healthy(self, count: int = 1, timeout: float | None = None) -> list[str]:
        """Wait until at least `count` replicas are healthy; TimeoutError otherwise."""

        async def ready() -> list[str]:
            async with self._changed:
                await self._changed.wait_for(lambda: len(self.healthy()) >= count)
            return self.healthy()

        async with asyncio.timeout(timeout):
            return await ready()

    async def _notify(self) -> None:
        async with self._changed:
            self._changed.notify_all()

    # ---- placement ----------------------------------------------------------------------------

    def pick(self, session_id: str, preferred: str | None = None, exclude: Iterable[str] = ()) -> str:
        """The replica for this session's next call.

        Order: `preferred` (the assignment stored with the session, e.g. in Redis), then this
        pool's own memory of the session, if healthy and not excluded; else the healthy replica
        with the fewest sessions (ties broken by a hash of session and address, so placement is
        stable). Raises NoHealthyReplica when no replica is left.
        """
        excluded = set(exclude)
        candidates = [a for a in self.healthy() if a not in excluded]
        if not candidates:
            raise NoHealthyReplica(self._no_replica_message(excluded))
        current = self._affinity.get(session_id)
        for choice in (preferred, current):
            if choice in candidates:
                self._assign(session_id, choice)
                return choice
        choice = min(candidates, key=lambda a: (self._replicas[a].sessions, _rendezvous(session_id, a)))
        self._assign(session_id, choice)
        return choice

    def prefill_chunk(self, tokens: int) -> None:
        """Its tick loops' prefill budget from now on (chunked prefill; 0: none)."""
        self.max_tick_tokens = tokens
        for loop in self._loops.values():
            loop.max_tick_tokens = tokens

    def load(self, address: str) -> int:
        """Sessions this pool has placed on the replica (its load, as this gateway sees it)."""
        replica = self._replicas.get(address)
        return replica.sessions if replica is not None else 0

    def release(self, session_id: str) -> None:
        """The session is over: forget its placement."""
        addr = self._affinity.pop(session_id, None)
        if addr in self._replicas:
            self._replicas[addr].sessions -= 1

    def assigned(self, session_id: str) -> str | None:
        return self._affinity.get(session_id)

    def _assign(self, session_id: str, address: str) -> None:
        self.release(session_id)
        self._affinity[session_id] = address
        self._replicas[address].sessions += 1
        while len(self._affinity) > MAX_AFFINITIES:  # a caller that never releases cannot grow this forever
            self.release(next(iter(self._affinity)))

    def _no_replica_message(self, excluded: set[str]) -> str:
        if not self._replicas:
            names = ", ".join(t.address for t in self.targets)
            return f"no {self.name} replica: {names} resolved to no address"
        states = "; ".join(
            f"{r.address}: {'excluded' if r.address in excluded else r.last_error}"
            for r in self._replicas.values()
        )
        return f"no healthy {self.name} replica ({states})"


def _rendezvous(session_id: str, address: str) -> bytes:
    return hashlib.blake2b(f"{session_id}|{address}".encode(), digest_size=8).digest()
