"""A small process supervisor for `specmesh up`: the whole stack as local subprocesses.

    run_stack(plan_stack("default-draft", "default-target", drafters=2, port=50051))  # until Ctrl-C

Children start stage by stage (redis, the drafters, the verifiers, then the gateway); within a stage
they start together and all must be ready (TCP port accepting, gRPC health SERVING, Redis PING)
before the next stage starts. Their stdout and stderr are copied line by line with a `name |`
prefix. A child that crashes after it was ready is restarted; its budget is `max_restarts` restarts
within `restart_window` seconds (a crash now and then never adds up). Past it, an `expendable`
child (a replica with a sibling of its role) is given up alone and the rest keeps serving; any
other child stops the whole stack with exit status 1. A child that fails before it was ever ready
stops the stack at once, because a bad flag or model path will not get better by retrying.

Children run in their own process groups, so a terminal's Ctrl-C reaches only the supervisor,
which forwards it (SIGINT or SIGTERM, whichever it got) child by child in reverse start order,
waits `grace` seconds for each and then kills its group. A second signal kills what is left at
once. A supervisor killed with SIGKILL cannot clean up; on Linux each child is then sent SIGTERM
by the kernel (the parent-death signal), so none is left running.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import dataclasses
import itertools
import os
import shutil
import signal
import socket
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TextIO

from specmesh.rpc.tls import ClientTls
from specmesh.stack.certs import CertFiles
from specmesh.stack.ports import free_port
from specmesh.stack.redis_server import (
    find_redis_server,
    new_password,
    redis_command,
    redis_config,
    redis_ping,
    write_redis_config,
)

__all__ = [
    "ChildFailed",
    "ChildSpec",
    "StackPlan",
    "Supervisor",
    "grpc_ready",
    "plan_stack",
    "redis_ready",
    "run_stack",
    "tcp_ready",
]

ReadyCheck = Callable[[], Awaitable[bool]]


class ChildFailed(RuntimeError):
    """A child exited or did not become ready; the message says which and how."""


# ---- readiness checks ----------------------------------------------------------------------------


def _tcp_accepts(host: str, port: int, timeout: float = 0.5) -> bool:
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


def tcp_ready(host: str, port: int) -> ReadyCheck:
    async def check() -> bool:
        return await asyncio.to_thread(_tcp_accepts, host, port)

    return check


def grpc_ready(address: str, service: str = "", tls: ClientTls | None = None) -> ReadyCheck:
    """The port accepts and the grpc.health.v1 service answers SERVING (asked over TLS with `tls`)."""
    host, _, port = address.rpartition(":")

    async def check() -> bool:
        from specmesh.rpc.health import check as health_check

        if not await asyncio.to_thread(_tcp_accepts, host.strip("[]"), int(port)):
            return False
        return await asyncio.to_thread(health_check, address, service, 1.0, tls) is None

    return check


def redis_ready(host: str, port: int, password: str | None = None) -> ReadyCheck:
    async def check() -> bool:
        return await asyncio.to_thread(redis_ping, host, port, 0.5, password)

    return check


# ---- children ------------------------------------------------------------------------------------


@dataclass
class ChildSpec:
    name: str
    argv: Sequence[str]
    ready: ReadyCheck | None = None  # None: ready as soon as it runs
    stage: int = 0  # lower stages start (and are ready) first, and stop last
    env: Mapping[str, str] | None = None  # added to the supervisor's environment
    cwd: str | None = None
    ready_timeout: float = 60.0
    max_restarts: int = 3  # within restart_window seconds
    restart_window: float = 300.0
    restart_delay: float = 1.0
    expendable: bool = False  # past its budget, give up this child alone (the stack serves without it)


@dataclass
class _Child:
    spec: ChildSpec
    proc: asyncio.subprocess.Process | None = None
    recent: list[float] = field(default_factory=list)  # monotonic times of the restarts in the window
    pump: asyncio.Task[None] | None = None
    watcher: asyncio.Task[None] | None = None


@dataclass
class Supervisor:
    specs: Sequence[ChildSpec]
    grace: float = 10.0
    output: TextIO = field(default_factory=lambda: sys.stdout)
    poll_interval: float = 0.2
    on_ready: Callable[[], None] | None = None  # called once, when every child is ready

    def __post_init__(self) -> None:
        names = [s.name for s in self.specs]
        if len(set(names)) != len(names):
            raise ValueError(f"child names must be unique: {names}")
        self._children: list[_Child] = []  # in start order
        self._done = asyncio.Event()
        self._force = asyncio.Event()
        self._stopping = False
        self._requested = False
        self._failure: str | None = None
        self._signal = signal.SIGTERM
        self._width = max((len(n) for n in names), default=0)

    # ---- public ----------------------------------------------------------------------------------

    async def run(self, install_signal_handlers: bool = True) -> int:
        """Start everything, supervise until a signal or a failure, stop; 0 = stopped on request."""
        if install_signal_handlers:
            loop = asyncio.get_running_loop()
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.add_signal_handler(sig, self.request_stop, sig)
        try:
            await self.start()
            if self.on_ready is not None and not self._done.is_set():
                self.on_ready()
            await self.wait()
        except ChildFailed as exc:
            if not self._requested:  # a Ctrl-C while starting is a stop, not a failure
                self._failure = str(exc)
        finally:
            await self.stop()
            if install_signal_handlers:
                for sig in (signal.SIGINT, signal.SIGTERM):
                    asyncio.get_running_loop().remove_signal_handler(sig)
        if self._failure:
            self._say(f"failed: {self._failure}")
            return 1
        return 0

    async def start(self) -> None:
        """Start stage by stage; ChildFailed (with the children already started still running)."""
        for stage in sorted({s.stage for s in self.specs}):
            batch = [_Child(s) for s in self.specs if s.stage == stage]
            for child in batch:
                self._children.append(child)
                await self._launch(child)
            await self._wait_all_ready(batch)
            for child in batch:
                child.watcher = asyncio.create_task(self._watch(child), name=f"watch-{child.spec.name}")
            if self._done.is_set():  # a stop was requested while starting
                return

    async def _wait_all_ready(self, batch: list[_Child]) -> None:
        """All ready, or the first failure (without waiting out the others' ready timeouts)."""
        tasks = [asyncio.create_task(self._wait_ready(c)) for c in batch]
        done, pending = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        for task in done:
            if task.exception() is not None:
                raise task.exception()  # type: ignore[misc]

    async def wait(self) -> None:
        """Until stop is requested or a child fails for good (then ChildFailed)."""
        await self._done.wait()
        if self._failure:
            raise ChildFailed(self._failure)

    def request_stop(self, sig: int = signal.SIGTERM) -> None:
        """Signal-handler safe: begin shutdown; a second request kills the rest at once."""
        if self._done.is_set():
            self._force.set()
            return
        self._signal = signal.Signals(sig)
        self._requested = True
        self._done.set()

    async def stop(self) -> None:
        """Stop children one by one in reverse start order (idempotent)."""
        if self._stopping:
            return
        self._stopping = True
        self._done.set()
        watchers = [c.watcher for c in self._children if c.watcher is not None]
        for watcher in watchers:
            watcher.cancel()
        await asyncio.gather(*watchers, return_exceptions=True)  # no restart may race the stop
        for child in reversed(self._children):
            await self._terminate(child)

    def pid(self, name: str) -> int | None:
        for child in self._children:
            if child.spec.name == name and child.proc is not None:
                return child.proc.pid
        return None

    # ---- internals -------------------------------------------------------------------------------

    def _say(self, text: str, name: str = "supervisor") -> None:
        self.output.write(f"{name:<{self._width}} | {text}\n")
        self.output.flush()

    async def _launch(self, child: _Child) -> None:
        spec = child.spec
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **(spec.env or {})}
        self._say(f"starting: {' '.join(spec.argv)}", spec.name)
        # SIGTERM when the supervisor dies, even by SIGKILL (Linux's parent-death signal): set by
        # util-linux's setpriv, which then execs the command, where it is there. The fallback, a
        # preexec_fn, runs Python in the child between fork and exec; with threads in the parent and
        # at-fork hooks of libraries (filelock's), that child sometimes crashed before its exec.
        setpriv = shutil.which("setpriv") if sys.platform.startswith("linux") else None
        if setpriv and shutil.which(spec.argv[0]) is None:  # setpriv would start, then fail its exec
            raise ChildFailed(f"{spec.name}: cannot start {spec.argv[0]}: not found or not executable")
        argv = [setpriv, "--pdeathsig", "TERM", "--", *spec.argv] if setpriv else list(spec.argv)
        try:
            child.proc = await asyncio.create_subprocess_exec(
                *argv,
                stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.STDOUT,
                env=env,
                cwd=spec.cwd,
                start_new_session=True,  # own process group: signals reach it only through us
                preexec_fn=None if setpriv else _die_with_parent,
                limit=1 << 20,
            )
        except OSError as exc:
            raise ChildFailed(f"{spec.name}: cannot start {spec.argv[0]}: {exc}") from exc
        child.pump = asyncio.create_task(self._pump(child.proc, spec.name), name=f"log-{spec.name}")

    async def _pump(self, proc: asyncio.subprocess.Process, name: str) -> None:
        assert proc.stdout is not None
        while True:
            try:
                line = await proc.stdout.readline()
            except ValueError:  # a line over the limit: pass it on in pieces
                line = await proc.stdout.read(1 << 16)
            if not line:
                return
            self._say(line.decode(errors="replace").rstrip("\n"), name)

    async def _wait_ready(self, child: _Child) -> None:
        spec, proc = child.spec, child.proc
        assert proc is not None
        started = time.monotonic()
        deadline = started + spec.ready_timeout
        while True:
            if proc.returncode is not None:
                await self._drain(child)
                raise ChildFailed(f"{spec.name} exited with status {proc.returncode} before it was ready")
            if spec.ready is None or await spec.ready():
                self._say(f"ready after {time.monotonic() - started:.1f}s (pid {proc.pid})", spec.name)
                return
            if time.monotonic() > deadline:
                raise ChildFailed(f"{spec.name} was not ready after {spec.ready_timeout:.0f}s")
            if self._done.is_set():
                raise ChildFailed(f"stopped while waiting for {spec.name}")
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.poll_interval):
                    await proc.wait()

    async def _watch(self, child: _Child) -> None:
        """Restart a child that exits on its own, within its budget (module docstring)."""
        spec = child.spec
        while True:
            assert child.proc is not None
            status = await child.proc.wait()
            await self._drain(child)
            if self._stopping:
                return
            now = time.monotonic()
            child.recent = [t for t in child.recent if now - t < spec.restart_window]
            if len(child.recent) >= spec.max_restarts:
                given_up = (
                    f"exited with status {status}; gave up after {len(child.recent)} restarts "
                    f"in {spec.restart_window:g}s"
                )
                if spec.expendable:
                    self._say(f"{given_up}; the rest of the stack goes on without it", spec.name)
                    return
                self._failure = f"{spec.name} {given_up}"
                self._done.set()
                return
            child.recent.append(now)
            self._say(
                f"exited with status {status}; restart {len(child.recent)}/{spec.max_restarts} "
                f"in {spec.restart_window:g}s, in {spec.restart_delay:g}s",
                spec.name,
            )
            await asyncio.sleep(spec.restart_delay)
            await self._launch(child)
            try:
                await self._wait_ready(child)
            except ChildFailed as exc:  # counts as another crash: the loop decides
                self._say(str(exc), spec.name)
                await self._kill_group(child.proc, signal.SIGKILL)

    async def _drain(self, child: _Child) -> None:
        """Let the log pump copy what the child wrote before it exited."""
        if child.pump is not None:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(2.0):
                    await asyncio.shield(child.pump)

    async def _terminate(self, child: _Child) -> None:
        proc = child.proc
        if proc is None:
            return
        if proc.returncode is None:
            polite = signal.SIGKILL if self._force.is_set() else self._signal
            self._say(f"stopping ({polite.name})", child.spec.name)
            await self._kill_group(proc, polite)
            grace = asyncio.create_task(proc.wait())
            force = asyncio.create_task(self._force.wait())
            await asyncio.wait({grace, force}, timeout=self.grace, return_when=asyncio.FIRST_COMPLETED)
            force.cancel()
            if proc.returncode is None:
                self._say("did not stop in time; killing it", child.spec.name)
                await self._kill_group(proc, signal.SIGKILL)
            await grace
            self._say(f"stopped (status {proc.returncode})", child.spec.name)
        await self._drain(child)

    @staticmethod
    async def _kill_group(proc: asyncio.subprocess.Process, sig: int) -> None:
        """Signal the child's process group, only while the child is not yet reaped (so its pid,
        which is the group id, cannot have been reused by an unrelated process)."""
        if proc.returncode is not None:
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, sig)


def _die_with_parent() -> None:
    """In the child, before exec: SIGTERM when the supervisor dies, even by SIGKILL (Linux)."""
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


_PR_SET_PDEATHSIG = 1


# ---- the specmesh stack --------------------------------------------------------------------------


@dataclass
class StackPlan:
    specs: list[ChildSpec]
    gateway: str
    drafters: list[str]
    verifiers: list[str]
    redis_url: str
    http: str = ""  # the gateway's OpenAI-compatible HTTP API, host:port ("" = off)
    metrics: dict[str, str] = field(default_factory=dict)  # child name -> its /metrics host:port
    # every gateway (the first is `gateway`, `http`): gRPC and HTTP host:port each
    gateways: list[tuple[str, str]] = field(default_factory=list)
    certs: CertFiles | None = None  # TLS on every hop (None: plaintext on loopback)
    redis_dir: str = ""  # the private Redis's config and AOF, for the stack's lifetime ("" = none)

    @property
    def scheme(self) -> str:
        """Of the HTTP API and /metrics."""
        return "https" if self.certs else "http"

    def cleanup(self) -> None:
        """Remove the private Redis's directory (after the stack stopped)."""
        if self.redis_dir:
            shutil.rmtree(self.redis_dir, ignore_errors=True)


def plan_stack(
    draft: str = "default-draft",
    target: str = "default-target",
    drafters: int = 1,
    port: int = 50051,
    dtype: str | None = None,
    redis_url: str | None = None,
    *,
    backend: str | None = None,
    verifiers: int = 1,
    ngram_drafters: int = 0,
    http_port: int = 8000,
    host: str = "127.0.0.1",
    python: str = sys.executable,
    ready_timeout: float = 900.0,
    drafter_args: Sequence[str] = (),
    verifier_args: Sequence[str] = (),
    gateway_args: Sequence[str] = (),
    gateway_env: Mapping[str, str] | None = None,
    certs: CertFiles | None = None,
    gateways: int = 1,
) -> StackPlan:
    """The command lines of the whole stack on loopback: redis (unless redis_url is given),
    `drafters` drafters, `ngram_drafters` model-free n-gram drafters (their --model names the
    draft's vocabulary), `verifiers` verifiers, and the gateway on `port` (gRPC) and `http_port`
    (its HTTP API and /metrics; 0 = off). Each replica serves /metrics on a free port. With
    `certs` every server listens with TLS, the replicas require the gateway's client certificate
    (mutual TLS), and readiness is asked with the user's client certificate. gateways: that many
    gateways on the same replicas and Redis, gateway i on port + i and http_port + i."""
    if drafters < 0 or ngram_drafters < 0 or verifiers < 1 or gateways < 1:
        raise ValueError("need drafters >= 0, ngram_drafters >= 0, verifiers >= 1 and gateways >= 1")
    specs: list[ChildSpec] = []
    redis_dir = ""
    if redis_url is None:
        redis, redis_url, redis_dir = _private_redis(host)
        specs.append(redis)
    model_flags = ["--dtype", dtype] if dtype else []
    model_flags += ["--backend", backend] if backend else []
    tls_flags, replica_tls_flags, gateway_tls_flags, probe_tls = _tls_plan(certs)

    common = [*model_flags, *tls_flags, *replica_tls_flags]
    placed = _model_replicas(
        python, host, (draft, drafters, drafter_args), (target, verifiers, verifier_args), ngram_drafters,
        common, probe_tls, ready_timeout, redis_url,
    )  # fmt: skip
    specs += placed.specs
    metrics = placed.metrics
    drafter_addrs, ngram_addrs, verifier_addrs = placed.drafters, placed.ngram, placed.verifiers
    replicas = ["--drafters", ",".join(drafter_addrs)] if drafter_addrs else []
    replicas += ["--ngram-drafters", ",".join(ngram_addrs)] if ngram_addrs else []
    replicas += ["--verifiers", ",".join(verifier_addrs)]
    env = {**(gateway_env or {}), "SPECMESH_REDIS_URL": redis_url}  # --redis-url: may hold a password
    last = placed.last_stage + 1  # the gateways, once every replica is ready
    served = []
    flags = [*replicas, *tls_flags, *gateway_tls_flags, *gateway_args]
    for i in range(gateways):
        spec, address, http = _gateway(
            python, host, i, port + i, http_port + i if http_port else 0, flags, probe_tls
        )
        specs.append(dataclasses.replace(spec, stage=last, env=env))
        if http:
            metrics[spec.name] = http
        served.append((address, http))
    gateway, http = served[0]
    return StackPlan(
        specs,
        gateway,
        drafter_addrs,
        verifier_addrs,
        redis_url,
        http,
        metrics,
        gateways=served,
        certs=certs,
        redis_dir=redis_dir,
    )


@dataclass
class _Replicas:
    specs: list[ChildSpec]
    drafters: list[str]
    ngram: list[str]
    verifiers: list[str]
    metrics: dict[str, str]  # name -> its /metrics address
    last_stage: int


def _model_replicas(
    python: str, host: str, drafter: tuple[str, int, Sequence[str]], verifier: tuple[str, int, Sequence[str]],
    ngram_drafters: int, common: Sequence[str], probe_tls: ClientTls | None, ready_timeout: float,
    redis_url: str,
) -> _Replicas:  # fmt: skip
    """The drafters, n-gram drafters and verifiers ((model, count, extra flags) per model role).

    One model replica at a time, drafters first: each measures its forward cost at start-up
    (what the gateway's chunk, per-try timeouts and default decide from), and one measuring while
    another loads or measures on shared cores sees that load. Two verifiers starting together on
    2 cores measured a one-row forward at 370 ms (58 ms one at a time) and a 16-row one at 209
    ms: the gateway's chunk came out at 2048 tokens, 1.5k-token prompts went whole, and rounds ran
    out of the 60 s round timeout, taking both verifiers out as hung (docs/decisions.md, "Long
    prompts and conversations"). The n-gram drafters load no model: they start with the first
    model replica. They and the verifiers (suffix rides) learn from the gateways' outputs log in
    `redis_url` (in their environment: the URL may hold a password)."""
    out = _Replicas([], [], [], [], {}, 0)
    stages = itertools.count(1)

    def add(
        kind: str, index: int, model: str, extra: Sequence[str], stage: int, expendable: bool,
        name: str | None = None, env: Mapping[str, str] | None = None,
    ) -> str:  # fmt: skip
        spec, address, out.metrics[f"{kind}-{index}"] = _replica(
            python, host, kind, index, model, [*common, *extra], stage, probe_tls, ready_timeout
        )
        out.specs.append(dataclasses.replace(spec, name=name or spec.name, expendable=expendable, env=env))
        out.last_stage = max(out.last_stage, stage)
        return address

    (draft, drafters, drafter_args), (target, verifiers, verifier_args) = drafter, verifier
    learns = {"SPECMESH_REDIS_URL": redis_url}  # the outputs log's Redis
    for i in range(drafters):
        out.drafters.append(add("drafter", i, draft, drafter_args, next(stages), drafters > 1))
    for i in range(ngram_drafters):
        out.ngram.append(
            add("drafter", drafters + i, draft, ["--backend", "ngram"], 1, ngram_drafters > 1,
                name=f"ngram-drafter-{i}", env=learns)
        )  # fmt: skip
    for i in range(verifiers):
        out.verifiers.append(
            add("verifier", i, target, verifier_args, next(stages), verifiers > 1, env=learns)
        )
    return out


def _replica(
    python: str, host: str, kind: str, index: int, model: str, flags: Sequence[str], stage: int,
    probe_tls: ClientTls | None, ready_timeout: float,
) -> tuple[ChildSpec, str, str]:  # fmt: skip
    """A drafter or verifier on free ports -> (its spec, its gRPC address, its /metrics address)."""
    address, metrics_port = f"{host}:{free_port(host)}", free_port(host)
    argv = [python, "-m", f"{kind}_service", "--model", model, "--host", host]
    argv += ["--port", address.rpartition(":")[2], "--metrics-port", str(metrics_port), *flags]
    ready = grpc_ready(address, tls=probe_tls)
    spec = ChildSpec(f"{kind}-{index}", argv, ready, stage=stage, ready_timeout=ready_timeout)
    return spec, address, f"{host}:{metrics_port}"


def _gateway(
    python: str, host: str, index: int, port: int, http_port: int, flags: Sequence[str],
    probe_tls: ClientTls | None,
) -> tuple[ChildSpec, str, str]:  # fmt: skip
    """Gateway `index` on `port` (and `http_port`; 0 = none) -> (its spec, its gRPC address, its
    HTTP address or "")."""
    address, http = f"{host}:{port}", f"{host}:{http_port}" if http_port else ""
    argv = [python, "-m", "gateway", "--port", str(port), "--http-port", str(http_port), *flags]
    name = "gateway" if index == 0 else f"gateway-{index}"
    return ChildSpec(name, argv, grpc_ready(address, tls=probe_tls), ready_timeout=120.0), address, http


def _private_redis(host: str) -> tuple[ChildSpec, str, str]:
    """A Redis of the stack's own -> (its spec, its URL, its data directory). Hardened and
    persistent (specmesh/stack/redis_server.py): a random password, AOF in a directory that
    outlives a restart of redis by the supervisor (same argv, same file). The password is only in
    that file (0600) and in the gateway's environment, never in an argv (which the supervisor
    logs, and `ps` shows)."""
    redis_port, password = free_port(host), new_password()
    redis_dir = tempfile.mkdtemp(prefix="specmesh-redis-")  # 0700
    text = redis_config(redis_port, host, data_dir=redis_dir, password=password)
    config = write_redis_config(os.path.join(redis_dir, "redis.conf"), text)
    argv = redis_command(find_redis_server(), redis_port, host, config_file=config)
    spec = ChildSpec("redis", argv, redis_ready(host, redis_port, password), stage=0, ready_timeout=30.0)
    return spec, f"redis://:{password}@{host}:{redis_port}/0", redis_dir


def _tls_plan(certs: CertFiles | None) -> tuple[list[str], list[str], list[str], ClientTls | None]:
    """The flags of every server, of the replicas alone and of the gateway alone, and the
    supervisor's own client credentials (for the readiness checks)."""
    if certs is None:
        return [], [], [], None
    every = ["--tls-cert", str(certs.server_cert), "--tls-key", str(certs.server_key)]
    replica = ["--tls-client-ca", str(certs.ca)]
    gateway = ["--replica-ca", str(certs.ca), "--replica-cert", str(certs.gateway_cert)]
    gateway += ["--replica-key", str(certs.gateway_key)]
    probe = ClientTls(str(certs.ca), str(certs.client_cert), str(certs.client_key))
    return every, replica, gateway, probe


def run_stack(
    plan: StackPlan, *, grace: float = 10.0, on_ready: Callable[[StackPlan], None] | None = None
) -> int:
    """Run a planned stack in the foreground until SIGINT / SIGTERM; the exit status for
    `specmesh up`. `on_ready` is called once every child is ready (e.g. to print the address)."""
    announce = (lambda: on_ready(plan)) if on_ready is not None else None
    try:
        return asyncio.run(Supervisor(plan.specs, grace=grace, on_ready=announce).run())
    finally:
        plan.cleanup()
