"""A client of the gateway that survives the gateway: a stream cut by a gateway's death or its
SIGTERM (a rollout) is resumed on another one, transparently, within a retry budget.

    for chunk in resumable_stream(lambda: GatewayStub(channel), request):   # gRPC
        print(chunk.text, end="")
    for event in resumable_sse(url, body):                                   # HTTP (OpenAI SSE)
        print(event["choices"][0]["text"], end="")

The session lives in Redis; any gateway can take it over once the old one's ownership lease is
gone (docs/gateway.md, "Resume"). The client only keeps the session id and how many tokens it
received, and asks for the rest with GenerateRequest.resume (HTTP: the `Last-Event-ID` header, the
id of the last server-sent event it got). Behind a proxy (a mesh ingress, HAProxy, nginx) the
same address reaches another gateway.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import grpc

from gateway.api import SESSION_ID_METADATA, gateway_pb2

# What a gateway's death or shutdown looks like from the client: the connection refused or reset
# (UNAVAILABLE, a proxy's reset stream as INTERNAL or UNKNOWN, CANCELLED by a stopping server),
# a handover (UNAVAILABLE), or a new gateway that found the dead one's lease still live
# (FAILED_PRECONDITION, retried after a pause). Anything else is the request's own answer.
RESUMABLE = {
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.INTERNAL,
    grpc.StatusCode.UNKNOWN,
    grpc.StatusCode.CANCELLED,
    grpc.StatusCode.FAILED_PRECONDITION,
}


@dataclass
class RetryBudget:
    """At most `attempts` reconnections in a row without a chunk between them, `backoff` seconds
    before the first, doubling up to `max_backoff`. A try that delivered chunks starts the count
    afresh: each fault gets the whole budget, and the pauses stay short (a session the client does
    not come back for expires after the gateway's --session-ttl)."""

    attempts: int = 8
    backoff: float = 0.1
    max_backoff: float = 2.0

    def pause(self, attempt: int) -> float:
        return min(self.backoff * 2**attempt, self.max_backoff)


def resume_request(session_id: str, token_index: int) -> Any:
    resume = gateway_pb2.Resume(session_id=session_id, token_index=token_index)
    return gateway_pb2.GenerateRequest(resume=resume)


def resumable_stream(
    stub: Callable[[], Any],
    request: Any,
    *,
    budget: RetryBudget | None = None,
    timeout: float | None = None,
    metadata: Any = None,
    on_retry: Callable[[grpc.RpcError, int], None] | None = None,
) -> Iterator[Any]:
    """GenerateStream(request), resumed after a failure in `RESUMABLE`: the chunks, each token once.

    stub: a new specmesh.v1.Gateway stub per try (a fresh channel finds another gateway behind a
    proxy; one channel with several addresses works too). A failure before the first chunk sends the
    request again (nothing was received; with a seed the output is the same). on_retry(error,
    attempt): told of each reconnection (logging, metrics)."""
    budget = budget or RetryBudget()
    session, received, attempt = "", 0, 0
    while True:
        ask = resume_request(session, received) if session else request
        call = stub().GenerateStream(ask, timeout=timeout, metadata=metadata)
        try:
            for chunk in call:
                session = chunk.session_id or session
                received += len(chunk.token_ids)
                attempt = 0
                yield chunk
                if chunk.finish_reason:
                    break
            with contextlib.suppress(grpc.RpcError):  # all received: only the call's status is left
                for _ in call:  # read to it, so the gateway counts an answered call, not a cancelled one
                    pass
            return
        except grpc.RpcError as exc:
            if exc.code() not in RESUMABLE or attempt >= budget.attempts:  # type: ignore[attr-defined]
                raise
            if not session:  # cut before the first chunk: the session may exist all the same
                session = dict(call.initial_metadata() or ()).get(SESSION_ID_METADATA, "")
            if on_retry is not None:
                on_retry(exc, attempt)
            time.sleep(budget.pause(attempt))
            attempt += 1


def resumable_sse(
    url: str | Callable[[], str],
    body: Mapping[str, Any],
    *,
    headers: Mapping[str, str] | None = None,
    budget: RetryBudget | None = None,
    timeout: float = 60.0,
) -> Iterator[dict[str, Any]]:
    """POST a streamed completion (`stream: true`) to the OpenAI-compatible `url` (or the URL a
    callable gives for each try); -> its events (parsed JSON, without `[DONE]`), resumed with
    `Last-Event-ID` after a cut connection or an error event. Needs the openai client's HTTP
    library (httpx2, or httpx before it)."""
    try:
        import httpx2 as httpx
    except ModuleNotFoundError:
        import httpx

    budget = budget or RetryBudget()
    last_id, attempt = "", 0
    while True:
        sent = {**(headers or {}), **({"Last-Event-ID": last_id} if last_id else {})}
        where = url() if callable(url) else url
        try:
            with httpx.stream("POST", where, json=dict(body), headers=sent, timeout=timeout) as response:
                if response.status_code >= 500 or (response.status_code == 400 and last_id):
                    raise _Retry(f"HTTP {response.status_code}: {response.read().decode()[:200]}")
                response.raise_for_status()
                event_id = ""
                for line in response.iter_lines():
                    if line.startswith("id:"):
                        event_id = line[3:].strip()
                    elif line.startswith("data:"):
                        data = line[5:].strip()
                        if data == "[DONE]":
                            return
                        event = json.loads(data)
                        if "error" in event:
                            raise _Retry(event["error"].get("message", "error event"))
                        last_id = event_id or last_id
                        attempt = 0
                        yield event
                raise _Retry("the stream ended without [DONE]")
        except (httpx.TransportError, _Retry):
            if attempt >= budget.attempts:
                raise
            time.sleep(budget.pause(attempt))
            attempt += 1


class _Retry(Exception):
    """The stream broke in a way a resume may mend."""
