"""Server scaffolding shared by drafter_service, verifier_service and the gateway.

Every server: flags with SPECMESH_* environment defaults (`flag_parser`), JSON logs, Prometheus
metrics (`RpcMetrics`), the error mapping and request logging of `RpcService` (`rpc`,
`stream_rpc`), grpc.health.v1, reflection and a graceful SIGTERM (`serve`). The rest of this
module is the model services' machinery.

Threads: the asyncio loop (uvloop) answers RPCs and batches; ONE model thread runs every
ModelRunner call (forwards, commits, releases), so the runner never sees two calls at once and the
loop never blocks on the model. The drafter adds a pool of tree-builder threads (build_tree is
synchronous) that hand their level forwards to the same batcher.

Batching (`ForwardBatcher`): steps of concurrent requests queue up; when the model is idle a batch
is dispatched as soon as it is full (--max-batch-size sessions or --max-batch-tokens tokens),
every registered participant has a step queued (the drafter: all running tree builders have
asked for their next level), or the oldest step has waited --max-wait-ms. While a forward runs,
new steps accumulate, so under load batches form without any waiting. A step that does not fit
waits for the next batch, in arrival order.

Sessions: a replica serves at most one request per session at a time (a second gets ABORTED).
Positions are checked before anything changes; a replica that does not hold the session at the
caller's position answers FAILED_PRECONDITION with trailing metadata `specmesh-resync: 1`. A
request whose work fails after it may have changed the session makes the replica forget the
session, so the caller's next request resyncs instead of building on half a step.

Errors: WireError -> INVALID_ARGUMENT (the message names the field); resync -> FAILED_PRECONDITION;
busy -> ABORTED; anything else -> INTERNAL with a short message and an error id, the traceback
only in the log. Oversized requests never reach a handler: gRPC answers RESOURCE_EXHAUSTED.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import functools
import json
import logging
import os
import signal
import sys
import threading
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, fields
from datetime import UTC, datetime
from types import ModuleType
from typing import Any, ClassVar, Protocol

import grpc
import torch
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server
from transformers.utils import logging as hf_logging

from specmesh import wire
from specmesh.models import LoadedModel, load_model
from specmesh.proto import pb2, pb2_grpc
from specmesh.runtime import ModelRunner, Step, UnknownSessionError

log = logging.getLogger("specmesh.serving")


class ResyncError(Exception):
    """The replica does not hold the session at the caller's position."""


class SessionBusyError(Exception):
    """The session already has a request in flight on this replica."""


class RequestCancelled(Exception):
    """The caller went away while a tree was being built."""


# ---- configuration -----------------------------------------------------------------------------


@dataclass(frozen=True)
class ServiceConfig:
    model: str
    host: str
    port: int
    metrics_port: int
    dtype: str
    device: str
    max_batch_size: int
    max_batch_tokens: int
    max_wait_ms: float
    max_tree_nodes: int
    max_depth: int
    max_branching: int
    max_beam_width: int
    max_cache_tokens: int
    max_message_bytes: int
    grace_seconds: float
    torch_threads: int
    log_level: str

    @property
    def limits(self) -> wire.Limits:
        return wire.Limits(self.max_tree_nodes, self.max_depth, self.max_branching, self.max_beam_width)

    @property
    def batch_limits(self) -> BatchLimits:
        return BatchLimits(self.max_batch_size, self.max_batch_tokens, self.max_wait_ms / 1000.0)


_HELP: dict[str, tuple[type, str]] = {
    "model": (str, "model for load_model: a folder, a .gguf file, a hub id, default-draft / default-target"),
    "host": (str, "address to listen on"),
    "port": (int, "gRPC port (0 = any free port; the log says which)"),
    "metrics_port": (int, "Prometheus /metrics port (0 = off)"),
    "dtype": (str, "model dtype: bf16, fp16, fp32, or int8 (int8 weights, CPU; for drafters)"),
    "device": (str, "torch device (empty = cuda when available, else cpu)"),
    "max_batch_size": (int, "sessions per model forward"),
    "max_batch_tokens": (int, "query tokens per model forward (a single larger step runs alone)"),
    "max_wait_ms": (float, "how long a queued step may wait for companions while the model is idle"),
    "max_tree_nodes": (int, "largest tree drafted or verified"),
    "max_depth": (int, "deepest tree drafted or verified"),
    "max_branching": (int, "largest per-level branching factor (mcsd, rsd_c)"),
    "max_beam_width": (int, "largest beam width (rsd_s, mtad)"),
    "max_cache_tokens": (int, "KV positions over all sessions before LRU eviction (0 = no limit)"),
    "max_message_bytes": (int, "largest request / response; larger requests get RESOURCE_EXHAUSTED"),
    "grace_seconds": (float, "on SIGTERM / SIGINT, how long in-flight requests may still finish"),
    "torch_threads": (int, "torch intra-op threads (0 = torch's default)"),
    "log_level": (str, "debug, info, warning or error"),
}

COMMON_DEFAULTS: dict[str, Any] = {
    "host": "127.0.0.1",
    "metrics_port": 0,
    "dtype": "bf16",
    "device": "",
    "max_batch_size": 16,
    "max_batch_tokens": 4096,
    "max_tree_nodes": 64,
    "max_depth": 16,
    "max_branching": 8,
    "max_beam_width": 8,
    "max_cache_tokens": 0,
    "max_message_bytes": 64 * 1024 * 1024,
    "grace_seconds": 10.0,
    "torch_threads": 0,
    "log_level": "info",
}

_AT_LEAST_ONE = (
    *("max_batch_size", "max_batch_tokens", "max_tree_nodes", "max_depth"),
    *("max_branching", "max_beam_width", "max_message_bytes"),
)


def flag_parser(
    prog: str, cls: type, help_texts: Mapping[str, tuple[type, str]], defaults: Mapping[str, Any]
) -> argparse.ArgumentParser:
    """One flag --foo-bar per field of the dataclass `cls`; each defaults to $SPECMESH_FOO_BAR,
    then to `defaults` (a field missing there is required)."""
    parser = argparse.ArgumentParser(
        prog=prog,
        epilog="Every flag --foo-bar may also be set as the environment variable SPECMESH_FOO_BAR.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    for f in fields(cls):
        kind, text = help_texts[f.name]
        env = f"SPECMESH_{f.name.upper()}"
        default = os.environ.get(env, defaults.get(f.name))
        parser.add_argument(
            f"--{f.name.replace('_', '-')}",
            type=kind,
            default=default,
            required=default is None,
            help=f"{text} [{env}]",
        )
    return parser


def parse_config(prog: str, argv: list[str] | None, defaults: Mapping[str, Any]) -> ServiceConfig:
    """Flags --foo-bar; each defaults to $SPECMESH_FOO_BAR, then to `defaults`."""
    parser = flag_parser(prog, ServiceConfig, _HELP, defaults)
    config = ServiceConfig(**vars(parser.parse_args(argv)))
    for name in _AT_LEAST_ONE:
        if getattr(config, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    if config.max_wait_ms < 0:
        parser.error("--max-wait-ms must be >= 0")
    return config


# ---- logging -----------------------------------------------------------------------------------

_RECORD_ATTRS = set(vars(logging.LogRecord("", 0, "", 0, "", (), None))) | {"message", "asctime"}


class JsonFormatter(logging.Formatter):
    """One JSON object per line: ts, level, logger, msg, the record's extra fields, exc."""

    def format(self, record: logging.LogRecord) -> str:
        out = {
            "ts": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        out.update((k, v) for k, v in vars(record).items() if k not in _RECORD_ATTRS)
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)


def configure_logging(level: str) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter())
    logging.basicConfig(level=level.upper(), handlers=[handler], force=True)
    logging.getLogger("grpc").setLevel(max(logging.getLogger().level, logging.INFO))  # its debug is noise


# ---- metrics -----------------------------------------------------------------------------------

TIME_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0)
SIZE_BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 128)
_TOKEN_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)


class RpcMetrics:
    """The registry and the per-RPC counter every specmesh server exports."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = self.counter(
            "specmesh_requests", "RPCs answered, by method and status code", "method", "code"
        )

    def counter(self, name: str, doc: str, *labels: str) -> Counter:
        return Counter(name, doc, labels, registry=self.registry)

    def histogram(self, name: str, doc: str, buckets: tuple, *labels: str) -> Histogram:
        return Histogram(name, doc, labels, buckets=buckets, registry=self.registry)

    def gauge(self, name: str, doc: str) -> Gauge:
        return Gauge(name, doc, registry=self.registry)


class ServiceMetrics(RpcMetrics):
    """The Prometheus metrics both model services export; each adds its own to `registry`."""

    def __init__(self) -> None:
        super().__init__()
        self.batch_size = self.histogram("specmesh_batch_size", "sessions in one model forward", SIZE_BUCKETS)
        self.batch_tokens = self.histogram(
            "specmesh_batch_tokens", "query tokens in one model forward", _TOKEN_BUCKETS
        )
        self.queue_wait = self.histogram(
            "specmesh_queue_wait_seconds", "how long a step waited before its forward started", TIME_BUCKETS
        )
        self.forward_time = self.histogram(
            "specmesh_forward_seconds", "duration of one batched model forward", TIME_BUCKETS
        )
        self.sessions = self.gauge("specmesh_sessions", "sessions the model runner holds")
        self.cached_tokens = self.gauge("specmesh_cached_tokens", "KV positions held over all sessions")

    def observe_runner(self, runner: ModelRunner) -> None:
        """Call on the model thread (the only thread that changes the runner)."""
        self.sessions.set(len(runner.sessions()))
        self.cached_tokens.set(runner.cached_positions())


def count_labels(counter: Counter, values: Iterable[int]) -> None:
    """counter{label=v} += how often v occurs (e.g. tokens per depth)."""
    for value, n in collections.Counter(values).items():
        counter.labels(str(value)).inc(n)


# ---- batching ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class BatchLimits:
    max_batch_size: int
    max_batch_tokens: int
    max_wait_s: float


@dataclass(frozen=True)
class BatchInfo:
    """What one step's forward looked like (reported back to the caller)."""

    size: int
    tokens: int
    queue_seconds: float
    forward_seconds: float


@dataclass(eq=False)
class _Item:
    step: Step
    before: Callable[[], None] | None  # on the model thread, right before the forward
    finish: Callable[[torch.Tensor], Any] | None  # on the model thread, on this step's logits
    future: asyncio.Future
    queued_at: float

    @property
    def tokens(self) -> int:
        return len(self.step.new_tokens) + len(self.step.node_tokens)


class ForwardBatcher:
    """Merges steps of concurrent requests into one ModelRunner.forward on the model thread.

    Use from the event loop (`enqueue`, `withdraw`, `join`, `leave`) or from a worker thread
    (`run_threadsafe`). See the module docstring for when a batch is dispatched. With
    participants, the max-wait clock also restarts when the model becomes idle, so a builder that
    is still sampling its level gets the same grace after every forward.
    """

    def __init__(
        self,
        runner: ModelRunner,
        model_thread: ThreadPoolExecutor,
        limits: BatchLimits,
        metrics: ServiceMetrics,
    ) -> None:
        self._runner, self._model_thread, self._limits, self._metrics = runner, model_thread, limits, metrics
        self._loop = asyncio.get_running_loop()
        self._queue: collections.deque[_Item] = collections.deque()
        self._busy = False
        self._idle_since = 0.0
        self._participants = 0
        self._timer: asyncio.TimerHandle | None = None

    # ---- loop side -----------------------------------------------------------------------------

    def join(self) -> None:
        self._participants += 1

    def leave(self) -> None:
        self._participants -= 1
        self._poke()

    def enqueue(
        self,
        step: Step,
        *,
        before: Callable[[], None] | None = None,
        finish: Callable[[torch.Tensor], Any] | None = None,
    ) -> asyncio.Future:
        """-> a future of (finish(logits) or logits, BatchInfo)."""
        item = _Item(step, before, finish, self._loop.create_future(), self._loop.time())
        self._queue.append(item)
        self._poke()
        return item.future

    def withdraw(self, future: asyncio.Future) -> None:
        """Take a step back if its forward has not started (then nothing happened to its session)."""
        for item in self._queue:
            if item.future is future:
                self._queue.remove(item)
                future.cancel()
                self._poke()
                return

    def run_threadsafe(self, step: Step, before: Callable[[], None] | None = None) -> torch.Tensor:
        """From a worker thread: queue the step and block until its logits are back."""

        async def queued() -> tuple[torch.Tensor, BatchInfo]:
            return await self.enqueue(step, before=before)

        return asyncio.run_coroutine_threadsafe(queued(), self._loop).result()[0]

    def _poke(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._busy or not self._queue:
            return
        deadline = self._deadline()
        if not self._ready() and self._loop.time() < deadline:
            self._timer = self._loop.call_at(deadline, self._poke)
            return
        batch = self._take()
        if batch:
            self._dispatch(batch)

    def _ready(self) -> bool:
        queued = len(self._queue)
        if queued >= self._limits.max_batch_size:
            return True
        if sum(item.tokens for item in self._queue) >= self._limits.max_batch_tokens:
            return True
        return 0 < self._participants <= queued

    def _deadline(self) -> float:
        oldest = self._queue[0].queued_at
        start = max(oldest, self._idle_since) if self._participants else oldest
        return start + self._limits.max_wait_s

    def _take(self) -> list[_Item]:
        batch: list[_Item] = []
        tokens = 0
        while self._queue and len(batch) < self._limits.max_batch_size:
            item = self._queue[0]
            if item.future.done():  # cancelled, withdrawal pending
                self._queue.popleft()
                continue
            if batch and tokens + item.tokens > self._limits.max_batch_tokens:
                break
            batch.append(self._queue.popleft())
            tokens += item.tokens
        return batch

    def _dispatch(self, batch: list[_Item]) -> None:
        self._busy = True
        dispatched = self._loop.time()
        job = self._loop.run_in_executor(self._model_thread, self._execute, batch)
        job.add_done_callback(functools.partial(self._finished, batch, dispatched))

    def _finished(self, batch: list[_Item], dispatched: float, job: asyncio.Future) -> None:
        self._busy = False
        self._idle_since = self._loop.time()
        try:
            outcomes, forward_s = job.result()
        except BaseException:  # the model thread was shut down
            outcomes, forward_s = [RuntimeError("the model thread stopped")] * len(batch), 0.0
        tokens = sum(item.tokens for item in batch)
        self._metrics.batch_size.observe(len(batch))
        self._metrics.batch_tokens.observe(tokens)
        self._metrics.forward_time.observe(forward_s)
        for item, outcome in zip(batch, outcomes, strict=True):
            waited = dispatched - item.queued_at
            self._metrics.queue_wait.observe(waited)
            if item.future.done():
                continue
            if isinstance(outcome, BaseException):
                item.future.set_exception(outcome)
            else:
                item.future.set_result((outcome, BatchInfo(len(batch), tokens, waited, forward_s)))
        self._poke()

    # ---- model thread --------------------------------------------------------------------------

    def _execute(self, batch: list[_Item]) -> tuple[list[Any], float]:
        outcomes: list[Any] = [None] * len(batch)
        ready = []
        for i, item in enumerate(batch):
            try:
                if item.before is not None:
                    item.before()
            except Exception as exc:  # this step fails alone and stays out of the forward
                outcomes[i] = exc
            else:
                ready.append(i)
        start = time.perf_counter()
        logits = self._forward([batch[i].step for i in ready])
        forward_s = time.perf_counter() - start
        for i, out in zip(ready, logits, strict=True):
            outcomes[i] = _finish(batch[i], out)
        self._metrics.observe_runner(self._runner)
        return outcomes, forward_s

    def _forward(self, steps: list[Step]) -> list[torch.Tensor | Exception]:
        """One forward for all steps; if it fails, each step alone, so that a step that cannot run
        fails only its own request (the runner validates a whole call before changing anything)."""
        if not steps:
            return []
        try:
            return self._runner.forward(steps)
        except Exception as exc:
            if len(steps) == 1:
                return [exc]
            log.warning("batched forward failed; running its steps one by one", extra={"error": repr(exc)})
            return [self._forward([step])[0] for step in steps]


def _finish(item: _Item, logits: torch.Tensor | Exception) -> Any:
    if isinstance(logits, Exception) or item.finish is None:
        return logits
    try:
        return item.finish(logits)
    except Exception as exc:
        return exc


# ---- sessions ----------------------------------------------------------------------------------


class SessionSlots:
    """At most one request per session at a time; Release of a busy session waits for it to end.

    Loop thread only."""

    def __init__(self, forget: Callable[[str], None]) -> None:
        self._forget = forget
        self._busy: set[str] = set()
        self._doomed: set[str] = set()

    def acquire(self, session_id: str) -> None:
        if session_id in self._busy:
            raise SessionBusyError(
                f"session_id: session {session_id!r} already has a request in flight on this replica"
            )
        self._busy.add(session_id)

    def free(self, session_id: str) -> None:
        self._busy.discard(session_id)
        if session_id in self._doomed:
            self._doomed.discard(session_id)
            self._forget(session_id)

    def release(self, session_id: str) -> None:
        if session_id in self._busy:
            self._doomed.add(session_id)
        else:
            self._forget(session_id)


# ---- the RPC base ------------------------------------------------------------------------------

Handler = Callable[[Any, Any, grpc.aio.ServicerContext], Awaitable[Any]]


class RpcService:
    """What every specmesh servicer shares: status mapping, request metrics and logs, health.
    Subclasses set `service_name` (and the generated modules, if not specmesh.proto's)."""

    service_name: ClassVar[str]
    pb2_module: ClassVar[ModuleType] = pb2
    grpc_module: ClassVar[ModuleType] = pb2_grpc
    metrics: RpcMetrics

    @property
    def full_name(self) -> str:
        return self.pb2_module.DESCRIPTOR.services_by_name[self.service_name].full_name

    def add_to_server(self, server: grpc.aio.Server) -> None:
        getattr(self.grpc_module, f"add_{self.service_name}Servicer_to_server")(self, server)

    async def started(self, health_servicer: health.aio.HealthServicer) -> None:
        """The server is listening; say SERVING (a service that is not ready yet overrides this)."""
        await health_servicer.set(self.full_name, health_pb2.HealthCheckResponse.SERVING)

    async def close(self) -> None:
        """After the server stopped (its grace period is over)."""

    def status(self, method: str, session: str, exc: Exception) -> tuple[grpc.StatusCode, str, tuple]:
        """The status code, details and trailing metadata that answer a failed RPC."""
        return _status(method, session, exc)

    def answered(
        self, method: str, session: str, code: grpc.StatusCode, start: float, details: str = ""
    ) -> None:
        self.metrics.requests.labels(method, code.name).inc()
        extra = {
            "method": method,
            "session": session,
            "code": code.name,
            "ms": (time.perf_counter() - start) * 1e3,
        }
        if details:
            extra["details"] = details
        log.log(logging.INFO if details else logging.DEBUG, "rpc", extra=extra)


@contextlib.asynccontextmanager
async def _answering(
    service: RpcService, method: str, request: Any, context: grpc.aio.ServicerContext
) -> AsyncIterator[None]:
    """Maps the known failures to status codes (module docstring), counts and logs every call."""
    start = time.perf_counter()
    session = getattr(request, "session_id", "")
    try:
        yield
    except asyncio.CancelledError:
        service.answered(method, session, grpc.StatusCode.CANCELLED, start)
        raise
    except Exception as exc:
        code, details, trailers = service.status(method, session, exc)
        service.answered(method, session, code, start, details)
        await context.abort(code, details, trailing_metadata=trailers)  # raises
    else:
        service.answered(method, session, grpc.StatusCode.OK, start)


def rpc(fn: Handler) -> Handler:
    """A unary handler, answered through `_answering`."""

    @functools.wraps(fn)
    async def handler(self: RpcService, request: Any, context: grpc.aio.ServicerContext) -> Any:
        async with _answering(self, fn.__name__, request, context):
            return await fn(self, request, context)

    return handler


def _status(method: str, session: str, exc: Exception) -> tuple[grpc.StatusCode, str, tuple]:
    if isinstance(exc, wire.WireError):
        return grpc.StatusCode.INVALID_ARGUMENT, str(exc), ()
    if isinstance(exc, ResyncError | UnknownSessionError):
        details = str(exc) if isinstance(exc, ResyncError) else f"session_id: unknown session {session!r}"
        return grpc.StatusCode.FAILED_PRECONDITION, details, ((wire.RESYNC_KEY, "1"),)
    if isinstance(exc, SessionBusyError):
        return grpc.StatusCode.ABORTED, str(exc), ()
    error_id = uuid.uuid4().hex[:12]
    log.error(
        "internal error", exc_info=exc, extra={"method": method, "session": session, "error_id": error_id}
    )
    return (
        grpc.StatusCode.INTERNAL,
        f"internal error {error_id} in {method}; the replica logged the details",
        (),
    )


class ModelService(RpcService):
    """What both model services share: the runner and its thread, the batcher, session slots and
    positions, metrics, Release and Info. Subclasses set `service_name` and add their RPC."""

    def __init__(self, config: ServiceConfig, model: LoadedModel, metrics: ServiceMetrics) -> None:
        self.config, self.model, self.metrics = config, model, metrics
        self.runner = ModelRunner(model.model, max_cache_tokens=config.max_cache_tokens or None)
        self.vocab_size = self.runner.vocab_size
        self.limits = config.limits
        self.loop = asyncio.get_running_loop()
        self.model_thread = ThreadPoolExecutor(1, thread_name_prefix="model")
        self.batcher = ForwardBatcher(self.runner, self.model_thread, config.batch_limits, metrics)
        self.slots = SessionSlots(self.forget)
        self._releasing: collections.Counter[str] = collections.Counter()  # releases not yet run

    async def close(self) -> None:
        await asyncio.to_thread(self.model_thread.shutdown)

    # ---- sessions ------------------------------------------------------------------------------

    def begin(self, session_id: str, position: int) -> bool:
        """Reserve the session for one request and check the caller's position. -> True: continue
        the session; False: (re)start it from this request's tokens (position 0)."""
        self.slots.acquire(session_id)
        try:
            return self._check_position(session_id, position)
        except BaseException:
            self.slots.free(session_id)
            raise

    def _check_position(self, session_id: str, position: int) -> bool:
        # Reading the runner from the loop is safe: this session has no work in flight.
        held = None if session_id in self._releasing else self.runner.committed_tokens(session_id)
        if position == 0:
            return False
        if held is None:
            raise ResyncError(
                f"session_id: this replica does not hold session {session_id!r}; "
                "resend all its committed tokens with position 0"
            )
        if len(held) != position:
            raise ResyncError(
                f"position: {position}, but this replica holds {len(held)} committed tokens of session "
                f"{session_id!r}; resend all of them with position 0"
            )
        return True

    async def settle(self, session_id: str, work: asyncio.Future, withdraw: Callable[[], None]) -> Any:
        """Await the session's work. The session stays reserved until the work has really ended
        (a dispatched forward or a running tree builder still changes it after the caller left);
        work that fails makes the replica forget the session, so the caller resyncs."""
        work.add_done_callback(functools.partial(self._settled, session_id))
        try:
            return await asyncio.shield(work)
        except asyncio.CancelledError:
            if not work.done():
                withdraw()
            raise

    def _settled(self, session_id: str, work: asyncio.Future) -> None:
        if not work.cancelled() and work.exception() is not None:
            self.forget(session_id)
        self.slots.free(session_id)

    def forget(self, session_id: str) -> None:
        """Drop the session here; until the model thread has released it, it counts as unknown."""
        self.forget_local(session_id)
        self._releasing[session_id] += 1
        job = self.model_thread.submit(self._release, session_id)
        job.add_done_callback(lambda _: self.loop.call_soon_threadsafe(self._released, session_id))

    def forget_local(self, session_id: str) -> None:
        """Drop what the service itself keeps about the session (override)."""

    def _release(self, session_id: str) -> None:
        self.runner.release(session_id)
        self.metrics.observe_runner(self.runner)

    def _released(self, session_id: str) -> None:
        self._releasing[session_id] -= 1
        if self._releasing[session_id] <= 0:
            del self._releasing[session_id]

    # ---- RPCs ----------------------------------------------------------------------------------

    @rpc
    async def Release(
        self, request: pb2.ReleaseRequest, context: grpc.aio.ServicerContext
    ) -> pb2.ReleaseResponse:
        session_id = wire.session_id_from_proto(request.session_id)
        held = session_id not in self._releasing and self.runner.committed_tokens(session_id) is not None
        self.slots.release(session_id)
        return pb2.ReleaseResponse(released=held)

    @rpc
    async def Info(self, request: pb2.InfoRequest, context: grpc.aio.ServicerContext) -> pb2.InfoResponse:
        c = self.config
        return pb2.InfoResponse(
            model_id=self.model.source,
            vocab_size=self.vocab_size,
            tokenizer_fingerprint=self.model.tokenizer_fingerprint,
            dtype=self.model.weights or str(self.model.dtype).removeprefix("torch."),
            device=str(self.model.device),
            max_sessions=0,
            max_cache_tokens=c.max_cache_tokens,
            max_tree_nodes=c.max_tree_nodes,
            max_depth=c.max_depth,
            max_branching=c.max_branching,
            max_beam_width=c.max_beam_width,
            max_batch_size=c.max_batch_size,
            max_batch_tokens=c.max_batch_tokens,
            max_message_bytes=c.max_message_bytes,
        )


# ---- running a server --------------------------------------------------------------------------


class ServerConfig(Protocol):
    host: str
    port: int
    metrics_port: int
    grace_seconds: float


def main(
    service_cls: type[ModelService], prog: str, defaults: Mapping[str, Any], argv: list[str] | None = None
) -> None:
    """`python -m drafter_service` / `python -m verifier_service`."""
    import uvloop

    config = parse_config(prog, argv, {**COMMON_DEFAULTS, **defaults})
    configure_logging(config.log_level)
    uvloop.run(_serve_model(config, service_cls))


async def _serve_model(config: ServiceConfig, service_cls: type[ModelService]) -> None:
    if config.torch_threads > 0:
        torch.set_num_threads(config.torch_threads)
    hf_logging.disable_progress_bar()  # keep stderr to JSON lines
    model = load_model(config.model, dtype=config.dtype, device=config.device or None)
    service = service_cls(config, model, ServiceMetrics())
    details = {"model": config.model, "dtype": model.weights, "device": str(model.device)}
    await serve(service, config, config.max_message_bytes, details)


async def serve(
    service: RpcService, config: ServerConfig, max_message_bytes: int, details: Mapping[str, Any]
) -> None:
    """Serve `service` with health and reflection until SIGTERM / SIGINT, then stop gracefully:
    health NOT_SERVING, new RPCs refused, in-flight ones get config.grace_seconds."""
    server = grpc.aio.server(
        options=[
            ("grpc.max_receive_message_length", max_message_bytes),
            ("grpc.max_send_message_length", max_message_bytes),
        ]
    )
    service.add_to_server(server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(
        (service.full_name, health.SERVICE_NAME, reflection.SERVICE_NAME), server
    )
    http = _start_metrics(config, service.metrics)
    port = _listen(server, f"{config.host}:{config.port}")
    await server.start()
    await service.started(health_servicer)
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        asyncio.get_running_loop().add_signal_handler(sig, stop.set)
    log.info(
        "serving",
        extra={
            "service": service.full_name,
            "host": config.host,
            "port": port,
            "metrics_port": config.metrics_port,
            **details,
            "pid": os.getpid(),
        },
    )
    await stop.wait()
    log.info("stopping", extra={"grace_seconds": config.grace_seconds})
    await health_servicer.enter_graceful_shutdown()
    await server.stop(config.grace_seconds)
    await service.close()
    if http is not None:
        http[0].shutdown()
    log.info("stopped", extra={"threads": threading.active_count()})


def _start_metrics(config: ServerConfig, metrics: RpcMetrics) -> Any:
    if not config.metrics_port:
        return None
    try:
        return start_http_server(config.metrics_port, addr=config.host, registry=metrics.registry)
    except OSError as exc:
        raise SystemExit(f"cannot serve metrics on {config.host}:{config.metrics_port}: {exc}") from None


def _listen(server: grpc.aio.Server, address: str) -> int:
    try:
        return server.add_insecure_port(address)
    except RuntimeError as exc:
        raise SystemExit(f"cannot listen on {address}: {exc}") from None
