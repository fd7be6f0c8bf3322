"""OpenTelemetry tracing across gateway -> drafter -> verifier (docs/gateway.md, "Tracing").

Every server installs the maintained gRPC instrumentation (`server_interceptors`, and
`client_interceptors` on the gateway's channels, which carry the W3C trace context in the call
metadata), so one request is one trace: the gateway's span, a span per round, and under it the
Draft and Verify calls and the Redis commit; the replicas' own spans join the same trace.

Export is off unless configured the standard way: `configure_tracing` installs an SDK provider
with an OTLP exporter only when OTEL_EXPORTER_OTLP_ENDPOINT / OTEL_EXPORTER_OTLP_TRACES_ENDPOINT
is set or OTEL_TRACES_EXPORTER=otlp (and OTEL_SDK_DISABLED is not true). Otherwise the API's
no-op tracer is used and a span costs next to nothing. Health checks are never traced.
"""

from __future__ import annotations

import os
from typing import Any

from opentelemetry import trace
from opentelemetry.instrumentation.grpc import aio_client_interceptors, aio_server_interceptor

_HEALTH = "grpc.health.v1.Health"


def otlp_configured() -> bool:
    env = os.environ
    if env.get("OTEL_SDK_DISABLED", "").lower() == "true":
        return False
    exporters = {e.strip() for e in env.get("OTEL_TRACES_EXPORTER", "").split(",")}
    return "otlp" in exporters or any(
        env.get(k) for k in ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
    )


def configure_tracing(service_name: str) -> bool:
    """Export this process's spans over OTLP if the environment asks for it; -> whether it does."""
    if not otlp_configured():
        return False
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import SERVICE_NAME, Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    name = os.environ.get("OTEL_SERVICE_NAME") or service_name
    provider = TracerProvider(resource=Resource.create({SERVICE_NAME: name}))
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    trace.set_tracer_provider(provider)
    return True


def _not_health(details: Any) -> bool:
    """Every call but health checks and tick streams: a tick stream lives as long as its caller
    and carries many requests' work (each request's trace has its items as spans instead).
    Read from `details.method` directly: the instrumentation's own filters isinstance-check a
    typing Protocol per call (about 20 us, once per request at 32 sessions' start)."""
    method = details.method
    if isinstance(method, bytes):  # grpc.aio's client call details carry bytes (grpc issue 31092)
        method = method.decode()
    service, _, name = method.lstrip("/").rpartition("/")
    return service != _HEALTH and name != "Ticks"


def server_interceptors() -> list[Any]:
    """For grpc.aio.server(interceptors=...): a span per call, joined to the caller's trace."""
    return [aio_server_interceptor(filter_=_not_health)]


def client_interceptors() -> list[Any]:
    """For grpc.aio channels: a span per call, the trace context sent in the metadata."""
    return aio_client_interceptors(filter_=_not_health)


def tracing_on() -> bool:
    """Whether spans are recorded (a provider was set: OTLP export, or a test's): a hot path skips
    making its spans otherwise."""
    return not isinstance(trace.get_tracer_provider(), trace.ProxyTracerProvider | trace.NoOpTracerProvider)


def tracer(name: str) -> trace.Tracer:
    """The current provider's tracer (a proxy: a provider set later, as tests do, still applies)."""
    return trace.get_tracer(name)
