"""OpenTelemetry: one trace per request, gateway -> round -> draft, verify, commit. The gateway runs
in this process (in a thread with its own event loop) so that an in-memory span exporter sees its
spans; Redis, the drafter and the verifier are real processes on tiny models."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator

import grpc
import httpx2 as httpx
import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from gateway.server import _serve, parse_config
from specmesh.rpc.proto import load
from specmesh.stack.ports import free_port
from specmesh.stack.redis_server import RedisServer
from tests.servers import replica, start_all, stop_all, wait_until
from tests.test_engine import PROMPT

pytestmark = pytest.mark.xdist_group("tracing")

gateway_pb2, gateway_grpc = load("gateway")
DRAFT, VERIFY = "draft", "verify"  # the session's items of the replicas' ticks
GENERATE = "/specmesh.v1.Gateway/Generate"


@pytest.fixture(scope="module")
def spans() -> InMemorySpanExporter:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    trace.set_tracer_provider(provider)  # once per process: this worker's other tests trace nothing
    return exporter


@pytest.fixture(scope="module")
def gateway(models, spans, tmp_path_factory) -> Iterator[tuple[str, str]]:
    """(gRPC address, HTTP base URL) of an in-process gateway."""
    logs = tmp_path_factory.mktemp("tracing")
    with RedisServer() as redis_server:
        drafter = replica("drafter_service", models["draft"], logs / "drafter.log")
        verifier = replica("verifier_service", models["target"], logs / "verifier.log")
        start_all(drafter, verifier)
        port, http_port = free_port(), free_port()
        config = parse_config(
            [
                *("--drafters", drafter.address, "--verifiers", verifier.address),
                *("--redis-url", redis_server.url, "--port", str(port), "--http-port", str(http_port)),
                *("--served-model-name", "tiny", "--grace-seconds", "1"),
            ]
        )
        loop, stop = asyncio.new_event_loop(), asyncio.Event()
        thread = threading.Thread(target=loop.run_until_complete, args=(_serve(config, stop),), daemon=True)
        thread.start()
        url = f"http://127.0.0.1:{http_port}"
        try:
            wait_until(lambda: _healthy(url), timeout=60, what="the in-process gateway")
            yield f"127.0.0.1:{port}", url
        finally:
            loop.call_soon_threadsafe(stop.set)
            thread.join(30)
            stop_all(drafter, verifier)


def _healthy(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


def one_trace(spans: list[ReadableSpan], root: ReadableSpan) -> list[ReadableSpan]:
    """The spans of root's trace, each checked to descend from root."""
    by_id = {s.context.span_id: s for s in spans}
    mine = [s for s in spans if s.context.trace_id == root.context.trace_id]
    for span in mine:
        node = span
        while node.parent is not None:
            node = by_id[node.parent.span_id]
        assert node is root, f"{span.name} is not under {root.name}"
    return mine


def assert_round_structure(mine: list[ReadableSpan]) -> None:
    by_id = {s.context.span_id: s for s in mine}
    names = [s.name for s in mine]
    assert DRAFT in names and VERIFY in names and "commit" in names and "round" in names, names
    for span in mine:
        if span.name in (DRAFT, VERIFY, "commit"):
            assert by_id[span.parent.span_id].name == "round", span.name


def test_an_http_request_is_one_trace_with_draft_verify_and_commit_under_it(gateway, spans) -> None:
    _, url = gateway
    spans.clear()
    body = {
        "model": "tiny",
        "prompt": " ".join(f"w{t - 4}" for t in PROMPT),
        "max_tokens": 8,
        "temperature": 0,
    }
    body["speculation"] = {"method": "chain", "depth": 3}
    assert httpx.post(f"{url}/v1/completions", json=body, timeout=60).status_code == 200
    # the server span ends just after the client has the answer
    wait_until(lambda: any(s.parent is None for s in spans.get_finished_spans()), what="the request's span")
    finished = spans.get_finished_spans()
    roots = [s for s in finished if s.parent is None]
    assert len(roots) == 1, [s.name for s in roots]
    assert roots[0].name == "POST /v1/completions"
    mine = one_trace(finished, roots[0])
    assert len(mine) == len(finished)  # nothing outside the request's trace (health checks untraced)
    assert_round_structure(mine)


def test_a_grpc_request_is_one_trace_too(gateway, spans) -> None:
    address, _ = gateway
    spans.clear()
    request = gateway_pb2.GenerateRequest(prompt_token_ids=gateway_pb2.TokenIds(ids=PROMPT), max_new_tokens=8)
    request.speculation.method, request.speculation.depth = "chain", 3
    with grpc.insecure_channel(address) as channel:
        assert gateway_grpc.GatewayStub(channel).Generate(request, timeout=60).token_ids
    wait_until(lambda: any(s.name == GENERATE for s in spans.get_finished_spans()), what="the request's span")
    finished = spans.get_finished_spans()
    (root,) = [s for s in finished if s.name == GENERATE]
    assert root.parent is None
    assert_round_structure(one_trace(finished, root))
