"""Server scaffolding shared by drafter_service, verifier_service and the gateway.

Every server: flags with SPECMESH_* environment defaults (specmesh.rpc.flags; the flags every
server has are `ServerConfig`'s), JSON logs, Prometheus metrics (`RpcMetrics`), the error mapping and
request logging of `RpcService` (`rpc`), grpc.health.v1, reflection (--reflection), TLS and mutual
TLS (--tls-cert, --tls-key, --tls-client-ca; specmesh.rpc.tls), OpenTelemetry tracing
(specmesh.rpc.tracing) and a graceful SIGTERM (`serve`). Nothing here knows a model: the model
services' machinery is specmesh.services.

Errors: WireError -> INVALID_ARGUMENT (the message names the field); a service maps its own
exceptions by overriding `RpcService.status`; anything else -> INTERNAL with a short message and an
error id, the traceback only in the log. Oversized requests never reach a handler: gRPC answers
RESOURCE_EXHAUSTED. Request bytes that are not the method's message (corrupt, invalid UTF-8, an
unknown field or a wrong wire type, two members of a oneof: specmesh.rpc.decoding) -> INVALID_ARGUMENT
naming the field, counted and logged like any other answer.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import functools
import gc
import inspect
import json
import logging
import os
import signal
import sys
import threading
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Mapping
from datetime import UTC, datetime
from pathlib import Path
from types import ModuleType
from typing import Any, ClassVar

import grpc
from google.protobuf import message_factory
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from specmesh.rpc import decoding, wire
from specmesh.rpc.flags import ServerConfig
from specmesh.rpc.metrics import MetricsServer, RpcMetrics
from specmesh.rpc.proto import pb2, pb2_grpc
from specmesh.rpc.tls import ServerTls, TlsError
from specmesh.rpc.tracing import configure_tracing, server_interceptors

log = logging.getLogger("specmesh.rpc.server")


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
        """The generated registration, with each method's request_deserializer replaced by
        specmesh.rpc.decoding's: strict, and never raising (bad bytes reach the handler as an
        Undecodable, answered INVALID_ARGUMENT by `rpc` / `rpc_stream` and counted)."""
        registrar = _Registrar()
        getattr(self.grpc_module, f"add_{self.service_name}Servicer_to_server")(self, registrar)
        methods = self.pb2_module.DESCRIPTOR.services_by_name[self.service_name].methods_by_name
        for service, handlers in registrar.services.items():
            strict = {
                name: handler._replace(
                    request_deserializer=decoding.decoder(
                        message_factory.GetMessageClass(methods[name].input_type)
                    )
                )
                for name, handler in handlers.items()
            }
            server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service, strict),))
            server.add_registered_method_handlers(service, strict)

    def undecodable(self, request: decoding.Undecodable, context: grpc.aio.ServicerContext) -> Exception:
        """What answers request bytes that could not be decoded (a service that checks the caller
        first, like the gateway's API keys, overrides this)."""
        return request.error

    async def started(self, health_servicer: health.aio.HealthServicer) -> None:
        """The server is listening; say SERVING (a service that is not ready yet overrides this)."""
        await health_servicer.set(self.full_name, health_pb2.HealthCheckResponse.SERVING)

    async def serve_more(self, config: ServerConfig) -> None:
        """Before the gRPC server starts: anything else this service serves (the gateway's HTTP)."""

    async def drain(self, grace_seconds: float) -> None:
        """On SIGTERM, beside the gRPC server's drain: let what `serve_more` started finish."""

    async def close(self) -> None:
        """After the server stopped (its grace period is over)."""

    def status(self, method: str, session: str, exc: Exception) -> tuple[grpc.StatusCode, str, tuple]:
        """The status code, details and trailing metadata that answer a failed RPC."""
        return _status(method, session, exc)

    def answered(
        self, method: str, session: str, code: grpc.StatusCode, start: float, details: str = ""
    ) -> None:
        self.metrics.requests.labels(method, code.name).inc()
        seconds = time.perf_counter() - start
        self.metrics.handler_time.labels(method).observe(seconds)
        extra = {"method": method, "session": session, "code": code.name, "ms": seconds * 1e3}
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
    except (asyncio.CancelledError, GeneratorExit):  # a stream's caller left at a `yield` of it
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
            if isinstance(request, decoding.Undecodable):
                raise self.undecodable(request, context)
            return await fn(self, request, context)

    return handler


StreamHandler = Callable[[Any, Any, grpc.aio.ServicerContext], AsyncIterator[Any]]


def rpc_stream(fn: StreamHandler) -> StreamHandler:
    """A server-streaming handler (an async generator), answered through `_answering`; closed
    (its `async with` blocks exited) however the call ends."""

    @functools.wraps(fn)
    async def handler(
        self: RpcService, request: Any, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[Any]:
        if isinstance(request, decoding.Undecodable):
            async with _answering(self, fn.__name__, request, context):
                raise self.undecodable(request, context)
        items = fn(self, request, context)
        async with _answering(self, fn.__name__, request, context), contextlib.aclosing(items):
            async for item in items:
                yield item

    return handler


class _Registrar:
    """Stands in for the server in a generated add_*Servicer_to_server: keeps its handlers."""

    def __init__(self) -> None:
        self.services: dict[str, dict[str, grpc.RpcMethodHandler]] = {}

    def add_generic_rpc_handlers(self, handlers: Any) -> None:
        """The same handlers come again through add_registered_method_handlers."""

    def add_registered_method_handlers(self, service: str, handlers: dict[str, Any]) -> None:
        self.services[service] = dict(handlers)


def _status(method: str, session: str, exc: Exception) -> tuple[grpc.StatusCode, str, tuple]:
    if isinstance(exc, wire.WireError):
        return grpc.StatusCode.INVALID_ARGUMENT, str(exc), ()
    error_id = uuid.uuid4().hex[:12]
    log.error(
        "internal error", exc_info=exc, extra={"method": method, "session": session, "error_id": error_id}
    )
    return (
        grpc.StatusCode.INTERNAL,
        f"internal error {error_id} in {method}; the server that answered logged the details",
        (),
    )


# ---- running a server --------------------------------------------------------------------------


def interceptors() -> list[grpc.aio.ServerInterceptor]:
    """Every server's interceptors, outermost first: tracing's between the two halves of
    `_StreamsClosedInTheirCall`."""
    return [_StreamsClosedInTheirCall(outermost=True), *server_interceptors(), _StreamsClosedInTheirCall()]


GC_YOUNG = 20_000  # allocations between young collections in a serving process (`serve`)


class _StreamsClosedInTheirCall(grpc.aio.ServerInterceptor):
    """gRPC drives a streaming handler's async generator with a plain `async for`, and the tracing
    interceptor drives the handler's generator the same way: a call that ends while a message is
    being sent (a client that cancels, or leaves after its last chunk) leaves both parked at their
    `yield`, and the event loop's finalizer closes them later, each in a task of its own. Their
    `finally` blocks then run outside the call: the tracing span resets its context token in a
    foreign Context (opentelemetry logs "Failed to detach context" as an error) and `_answering`
    never counts the call. The innermost half keeps the handler's generator; the outermost makes
    the whole chain a coroutine that writes the messages itself and closes both generators, the
    handler's first, in the call's own task."""

    def __init__(self, outermost: bool = False) -> None:
        self.wrap = _written_and_closed if outermost else _kept

    async def intercept_service(self, continuation: Callable, details: grpc.HandlerCallDetails) -> Any:
        handler = await continuation(details)
        if handler is None or not handler.response_streaming:
            return handler
        name = "stream_stream" if handler.request_streaming else "unary_stream"
        return handler._replace(**{name: self.wrap(getattr(handler, name))})


_OPENED: contextvars.ContextVar[list[AsyncGenerator]] = contextvars.ContextVar("opened_streams")


def _kept(behavior: Callable) -> Callable:
    """The handler, its generator kept in the call's `_OPENED` for the outermost half to close.
    A coroutine handler (health's Watch) writes its messages and ends in its call already."""
    if not inspect.isasyncgenfunction(behavior):
        return behavior

    def keep(request: Any, context: grpc.aio.ServicerContext) -> AsyncGenerator:
        messages = behavior(request, context)
        _OPENED.get().append(messages)
        return messages

    keep.kept = True  # type: ignore[attr-defined]
    return keep


def _written_and_closed(behavior: Callable) -> Callable:
    """The chain as a coroutine handler (gRPC's `context.write` API) that closes what it opened."""
    if not (inspect.isasyncgenfunction(behavior) or getattr(behavior, "kept", False)):
        return behavior

    async def write_all(request: Any, context: grpc.aio.ServicerContext) -> None:
        opened: list[AsyncGenerator] = []
        _OPENED.set(opened)  # in the call's own task, whose Context no other call shares
        messages = behavior(request, context)
        try:
            async for message in messages:
                await context.write(message)
        finally:
            for kept in opened:
                await kept.aclose()
            await messages.aclose()

    return write_all


async def serve(
    service: RpcService,
    config: ServerConfig,
    max_message_bytes: int,
    details: Mapping[str, Any],
    stop: asyncio.Event | None = None,
) -> None:
    """Serve `service` with health, tracing (and reflection with --reflection) until SIGTERM /
    SIGINT (or `stop` is set, for a server run inside a test), then stop gracefully: health
    NOT_SERVING, new RPCs refused, in-flight ones get config.grace_seconds. With --tls-cert the
    port speaks TLS only (and /metrics is HTTPS)."""
    configure_tracing(service.service_name.lower())
    server = grpc.aio.server(
        options=[
            ("grpc.max_receive_message_length", max_message_bytes),
            ("grpc.max_send_message_length", max_message_bytes),
            # gRPC shares a port among processes by default: a second replica started on a taken
            # port would silently get half the first one's connections. Fail to start instead.
            ("grpc.so_reuseport", 0),
        ],
        interceptors=interceptors(),
    )
    service.add_to_server(server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    if config.reflection:  # off by default: it hands the whole API to anyone who can connect
        reflection.enable_server_reflection(
            (service.full_name, health.SERVICE_NAME, reflection.SERVICE_NAME), server
        )
    tls = config.server_tls()
    http = _start_metrics(config, service.metrics, tls)
    port = _listen(server, f"{config.host}:{config.port}", tls)
    await service.serve_more(config)
    await server.start()
    await service.started(health_servicer)
    if stop is None:
        # A process of its own: what start-up made (modules, a model, torch) lives until exit.
        # Frozen, it is left out of every later collection: a full one walked all of it, a 50 ms
        # pause in the gateway's event loop. Not in an embedder's process (a test's): its heap
        # is not ours to freeze.
        gc.collect()
        gc.freeze()
        # A young collection every GC_YOUNG allocations, not 700: each one scans every young
        # object still alive (a tick's sessions' rounds in flight), and at 700 a tick of 32
        # sessions ran several. By py-spy a tenth of the gateway's main thread at 32 sessions.
        gc.set_threshold(GC_YOUNG, *gc.get_threshold()[1:])
        stop = asyncio.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            asyncio.get_running_loop().add_signal_handler(sig, stop.set)
        # the process's own signals: an embedder that passes `stop` (its loop perhaps off the main
        # thread, where Python takes no signal handler) keeps its own
        asyncio.get_running_loop().add_signal_handler(signal.SIGUSR1, dump_tasks)
    log.info(
        "serving",
        extra={
            "service": service.full_name,
            "host": config.host,
            "port": port,
            "metrics_port": config.metrics_port,
            "tls": "mutual" if tls and tls.client_ca else bool(tls),
            "reflection": config.reflection,
            **details,
            "pid": os.getpid(),
        },
    )
    await stop.wait()
    log.info("stopping", extra={"grace_seconds": config.grace_seconds})
    await health_servicer.enter_graceful_shutdown()
    await asyncio.gather(server.stop(config.grace_seconds), service.drain(config.grace_seconds))
    await service.close()
    if http is not None:
        http.close()
    log.info("stopped", extra={"threads": threading.active_count()})


def dump_tasks() -> None:
    """SIGUSR1: log every asyncio task and where it waits, innermost last (a request that hangs
    shows which await it is stuck in; the process goes on serving)."""
    for task in asyncio.all_tasks():
        log.warning("task", extra={"task": task.get_name(), "stack": " > ".join(_awaits(task.get_coro()))})


def _awaits(coro: Any) -> list[str]:
    """file:line function of each coroutine (or generator) in the chain `coro` awaits, outermost
    first, then what the innermost awaits (a future, a lock)."""
    chain = []
    while coro is not None:
        frame = (
            getattr(coro, "cr_frame", None)
            or getattr(coro, "gi_frame", None)
            or getattr(coro, "ag_frame", None)
        )
        if frame is None:
            chain.append(repr(coro)[:120])
            break
        chain.append(f"{Path(frame.f_code.co_filename).name}:{frame.f_lineno} {frame.f_code.co_name}")
        coro = (
            getattr(coro, "cr_await", None)
            or getattr(coro, "gi_yieldfrom", None)
            or getattr(coro, "ag_await", None)
        )
    return chain


def _start_metrics(config: ServerConfig, metrics: RpcMetrics, tls: ServerTls | None) -> MetricsServer | None:
    """/metrics over HTTPS with the server's certificate when it has one; no client certificate
    is asked for (a scraper rarely has one, and the counters are not the data path)."""
    if not config.metrics_port:
        return None
    certs = {"cert": tls.cert, "key": tls.key} if tls else {}
    try:
        return MetricsServer(config.host, config.metrics_port, metrics.registry, **certs)
    except OSError as exc:
        raise SystemExit(f"cannot serve metrics on {config.host}:{config.metrics_port}: {exc}") from None


def _listen(server: grpc.aio.Server, address: str, tls: ServerTls | None) -> int:
    try:
        if tls is None:
            return server.add_insecure_port(address)
        return server.add_secure_port(address, tls.credentials())
    except TlsError as exc:
        raise SystemExit(str(exc)) from None
    except RuntimeError as exc:
        raise SystemExit(f"cannot listen on {address}: {exc}") from None
