"""The OpenAI-compatible HTTP API of the gateway (docs/http_api.md), served next to its gRPC port.

    POST /v1/completions, POST /v1/chat/completions   (stream: true -> server-sent events)
    GET  /v1/models, /health, /metrics

A request becomes the same specmesh.v1.GenerateRequest a gRPC client would send and runs through
the same `GatewayService.generate`, so validation, sessions, failover, metrics and the output are
those of the gRPC API: the joined streamed text equals `Generate`'s for the same request.
Differences from the gRPC API, as OpenAI defines them: an unset `temperature` is 1.0 (gRPC: 0,
greedy); `stop` may be one string; `top_k: -1` means no filter (vLLM's convention).

Errors take OpenAI's shape, `{"error": {"message", "type", "param", "code"}}`, with the status of
the gateway's gRPC code (`HTTP_STATUS`); `param` names the request's own field (`max_tokens`, not
the gRPC `max_new_tokens`). A client that disconnects cancels its session on every replica, as a
cancelled gRPC call does.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from typing import Annotated, Any, Literal, Protocol, TypeVar

import grpc
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from google.protobuf import json_format
from opentelemetry.instrumentation.asgi import OpenTelemetryMiddleware
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from pydantic import BaseModel, ConfigDict, Field
from starlette.exceptions import HTTPException as StarletteHTTPException

from gateway.api import gateway_pb2

T = TypeVar("T")
INT32 = 2**31 - 1
RETRY_AFTER_SECONDS = "1"

HTTP_STATUS: dict[grpc.StatusCode, int] = {
    grpc.StatusCode.INVALID_ARGUMENT: 400,
    grpc.StatusCode.FAILED_PRECONDITION: 400,
    grpc.StatusCode.OUT_OF_RANGE: 400,
    grpc.StatusCode.UNAUTHENTICATED: 401,
    grpc.StatusCode.PERMISSION_DENIED: 403,
    grpc.StatusCode.NOT_FOUND: 404,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
    grpc.StatusCode.UNAVAILABLE: 503,
    grpc.StatusCode.ABORTED: 503,  # the session store lost the session: retryable
    grpc.StatusCode.DEADLINE_EXCEEDED: 504,
}
_ERROR_TYPE = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "invalid_request_error",
    429: "rate_limit_error",
}
# The error's `code` as OpenAI writes it, where the status alone decides it; 5xx and a plain 400
# from the gateway get theirs in `error_code`.
_STATUS_CODE = {
    401: "invalid_api_key", 404: "unknown_url", 405: "method_not_allowed", 429: "rate_limit_exceeded",
}  # fmt: skip
# pydantic's error type -> OpenAI's code for a body that does not parse
_VALIDATION_CODE = {"extra_forbidden": "unknown_parameter", "missing": "missing_required_parameter"}


class Gateway(Protocol):
    """What the HTTP API needs of gateway.server.GatewayService."""

    metrics: Any

    def authorize(self, authorization: str | None) -> None: ...
    def served_model(self) -> Any: ...
    def model_name(self) -> str: ...
    def generate(self, request: Any, deadline: float | None) -> AsyncIterator[Any]: ...
    def status(self, method: str, session: str, exc: Exception) -> tuple[grpc.StatusCode, str, tuple]: ...
    def answered(
        self, method: str, session: str, code: grpc.StatusCode, start: float, details: str = ""
    ) -> None: ...


# ---- request bodies ----------------------------------------------------------------------------


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    include_usage: bool = False


class _Body(BaseModel):
    """Fields both endpoints take. Unknown fields are refused (as OpenAI does); fields OpenAI has
    but specmesh does not implement are accepted only at their neutral value."""

    model_config = ConfigDict(extra="forbid", strict=True)

    model: str
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None  # vLLM's extension; -1 or 0 = no filter
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = 1
    user: str | None = None
    speculation: dict[str, Any] | None = None  # specmesh.v1.Speculation as JSON (extra_body)
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None


class CompletionBody(_Body):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = None
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    type: Literal["text"]
    text: str


class Message(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    role: str
    content: str | list[TextPart] | None = None
    name: str | None = None


class ChatBody(_Body):
    messages: Annotated[list[Message], Field(min_length=1)]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None


# Fields accepted only at these values (what OpenAI means by leaving them out).
_NEUTRAL: dict[str, Any] = {
    "n": 1, "frequency_penalty": 0.0, "presence_penalty": 0.0, "logit_bias": None, "logprobs": (None, False),
    "echo": False, "best_of": (None, 1), "suffix": None, "top_logprobs": None,
}  # fmt: skip


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.param, self.code = status, param, code


def _unsupported(body: _Body) -> None:
    for name, neutral in _NEUTRAL.items():
        if name not in type(body).model_fields:
            continue
        value = getattr(body, name)
        allowed = neutral if isinstance(neutral, tuple) else (neutral,)
        if value not in allowed:
            what = "only n = 1 is supported" if name == "n" else "is not supported by specmesh"
            raise ApiError(400, f"{name}: {what} (got {value!r})", name, "unsupported_parameter")
    if body.stream_options is not None and not body.stream:
        raise ApiError(400, "stream_options: only allowed when stream is true", "stream_options")


# ---- body -> GenerateRequest -------------------------------------------------------------------


def generate_request(body: _Body) -> Any:
    """-> the specmesh.v1.GenerateRequest of `body`."""
    _unsupported(body)
    request = gateway_pb2.GenerateRequest()
    if isinstance(body, ChatBody):
        _set_chat(request, body.messages)
    else:
        _set_prompt(request, body.prompt)  # type: ignore[attr-defined]
    _set_max_tokens(request, body)
    s = request.sampling
    s.temperature = 1.0 if body.temperature is None else body.temperature
    if body.top_p is not None:
        s.top_p = body.top_p
    if body.top_k is not None:
        s.top_k = _int32(0 if body.top_k == -1 else body.top_k, "top_k")
    if body.seed is not None:
        if body.seed < 0 or body.seed >= 2**64:
            raise ApiError(400, f"seed: must be in [0, 2^64), got {body.seed}", "seed")
        s.seed = body.seed
    if body.stop is not None:
        request.stop.extend([body.stop] if isinstance(body.stop, str) else body.stop)
    if body.speculation is not None:
        try:
            json_format.ParseDict(body.speculation, request.speculation)
        except json_format.ParseError as exc:
            raise ApiError(400, f"speculation: {exc}", "speculation") from None
    return request


def _set_prompt(request: Any, prompt: Any) -> None:
    if isinstance(prompt, str):
        request.prompt = prompt
        return
    if prompt and all(isinstance(t, int) for t in prompt):
        if any(not 0 <= t < 2**32 for t in prompt):  # the vocabulary is checked by the gateway
            raise ApiError(400, "prompt: token ids must be in [0, 2^32)", "prompt")
        request.prompt_token_ids.ids.extend(prompt)
        return
    if len(prompt) != 1:
        raise ApiError(400, f"prompt: one prompt per request (got a batch of {len(prompt)})", "prompt")
    _set_prompt(request, prompt[0])


def _set_chat(request: Any, messages: list[Message]) -> None:
    for i, m in enumerate(messages):
        content = m.content if isinstance(m.content, str) else "".join(p.text for p in m.content or [])
        if m.content is None:
            raise ApiError(400, f"messages[{i}].content: must be set", f"messages[{i}].content")
        request.chat.messages.add(role=m.role, content=content)


def _length_param(body: Any) -> str:
    """The body's name for the length limit: max_completion_tokens if that is what a chat sent."""
    only_new = getattr(body, "max_completion_tokens", None) is not None and body.max_tokens is None
    return "max_completion_tokens" if only_new else "max_tokens"


def _set_max_tokens(request: Any, body: _Body) -> None:
    given = {body.max_tokens, getattr(body, "max_completion_tokens", None)} - {None}
    if len(given) > 1:
        message = "max_completion_tokens: differs from max_tokens; send one"
        raise ApiError(400, message, "max_completion_tokens")
    if given:
        name = _length_param(body)
        request.max_new_tokens = _int32(given.pop(), name)


def _int32(value: int, param: str) -> int:
    if not -INT32 - 1 <= value <= INT32:
        raise ApiError(400, f"{param}: {value} is out of range", param)
    return value


_FIELD = re.compile(r"^[a-z_][a-z0-9_]*(\[\d+\])?(\.[a-z_][a-z0-9_]*(\[\d+\])?)*$")


def api_param(details: str, body: Any) -> str | None:
    """The body's name of the GenerateRequest field an INVALID_ARGUMENT names ("field: problem")."""
    field = details.partition(":")[0]
    if not _FIELD.match(field):
        return None
    head, _, rest = field.partition(".")
    base = head.split("[", 1)[0]
    if base == "max_new_tokens":
        return _length_param(body)
    if base == "sampling":
        return rest
    if base in ("prompt_token_ids", "prompt"):
        return "prompt"
    if base == "chat":
        return "messages" + rest.removeprefix("messages")
    return field


_UNION_MEMBERS = {"str", "int", "float", "bool", "list", "dict", "none"}


def validation_param(loc: Any) -> str | None:
    """pydantic's error location -> `messages[0].content`: a union adds its member's type to the
    path ("str", "list[int]", "TextPart"), which is not the body's field."""
    param = ""
    for part in loc:
        if part == "body":
            continue
        if isinstance(part, int):
            param += f"[{part}]"
        elif part.lower() not in _UNION_MEMBERS and "[" not in part and not part[:1].isupper():
            param += f".{part}" if param else part
    return param or None


# ---- responses ---------------------------------------------------------------------------------


def error_code(status: int, message: str) -> str | None:
    """OpenAI's `code` for an error the gateway raised: a prompt or length that does not fit the
    context is `context_length_exceeded` (clients trim and retry on it), another bad value
    `invalid_value`; server errors have none."""
    if status == 400:
        return "context_length_exceeded" if "the model's context" in message else "invalid_value"
    return _STATUS_CODE.get(status)


def validation_code(error_type: str) -> str:
    if error_type in _VALIDATION_CODE:
        return _VALIDATION_CODE[error_type]
    return "invalid_type" if error_type.endswith(("_type", "_parsing")) else "invalid_value"


def error_response(
    status: int,
    message: str,
    param: str | None = None,
    code: str | None = None,
    headers: Mapping[str, str] | None = None,
) -> Response:
    kind = _ERROR_TYPE.get(status, "server_error" if status >= 500 else "invalid_request_error")
    error = {"message": message, "type": kind, "param": param, "code": code or error_code(status, message)}
    headers = dict(headers or {})
    if status == 429:  # the concurrency limit: a slot frees when a generation ends (TGI and vLLM send it)
        headers.setdefault("Retry-After", RETRY_AFTER_SECONDS)
    return JSONResponse({"error": error}, status_code=status, headers=headers)


def _usage(stats: Any) -> dict[str, int]:
    return {
        "prompt_tokens": stats.prompt_tokens,
        "completion_tokens": stats.generated_tokens,
        "total_tokens": stats.prompt_tokens + stats.generated_tokens,
    }


def _stats(stats: Any) -> dict[str, Any]:
    return json_format.MessageToDict(
        stats, preserving_proto_field_name=True, always_print_fields_with_no_presence=True
    )


class _Shape:
    """How one endpoint writes its objects: choices of a whole response and of a stream chunk."""

    def __init__(self, chat: bool, session_id: str, model: str) -> None:
        self.chat = chat
        prefix = "chatcmpl" if chat else "cmpl"
        self.id, self.model, self.created = f"{prefix}-{session_id}", model, int(time.time())

    def _object(self, kind: str, choices: list[dict], **more: Any) -> dict[str, Any]:
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model,
                "choices": choices, **more}  # fmt: skip

    def whole(self, text: str, last: Any) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": 0, "logprobs": None, "finish_reason": last.finish_reason}
        if self.chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        kind = "chat.completion" if self.chat else "text_completion"
        return self._object(kind, [choice], usage=_usage(last.stats), stats=_stats(last.stats))

    def chunk(self, text: str, finish_reason: str | None, first: bool = False) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": 0, "logprobs": None, "finish_reason": finish_reason}
        if self.chat:
            delta = {"role": "assistant", "content": text} if first else {"content": text}
            choice["delta"] = delta if (text or first or not finish_reason) else {}
        else:
            choice["text"] = text
        return self._object("chat.completion.chunk" if self.chat else "text_completion", [choice])

    def usage_chunk(self, stats: Any) -> dict[str, Any]:
        kind = "chat.completion.chunk" if self.chat else "text_completion"
        return self._object(kind, [], usage=_usage(stats), stats=_stats(stats))


def _sse(obj: Any) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


# ---- disconnects -------------------------------------------------------------------------------


class ClientGone(Exception):
    """The HTTP client disconnected before the answer was ready."""


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def until_disconnect(request: Request, work: Awaitable[T]) -> T:
    """`work`, cancelled (which ends its session everywhere) if the client disconnects first."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not task.done():
            task.cancel()
        watcher.cancel()
        await asyncio.gather(watcher, return_exceptions=True)
    if task.cancelled() and watcher.done():
        await asyncio.gather(task, return_exceptions=True)
        raise ClientGone
    return task.result()


# ---- the app -----------------------------------------------------------------------------------


def create_app(gateway: Gateway) -> Any:
    """The FastAPI app, wrapped in OpenTelemetry's ASGI middleware (a span per request)."""
    app = _fastapi()
    registry: CollectorRegistry = gateway.metrics.registry

    @app.exception_handler(StarletteHTTPException)
    async def routing(request: Request, exc: StarletteHTTPException) -> Response:
        """Unknown routes (404) and methods (405) in OpenAI's error shape, not FastAPI's `detail`."""
        where = f"{request.method} {request.url.path}"
        message = f"Invalid URL ({where})" if exc.status_code == 404 else f"{where}: {exc.detail}"
        return error_response(exc.status_code, message, headers=exc.headers)

    @app.exception_handler(RequestValidationError)
    async def invalid(_: Request, exc: RequestValidationError) -> Response:
        error = exc.errors()[0]
        if error.get("type") == "json_invalid":
            message = f"the body is not valid JSON: {error.get('ctx', {}).get('error')}"
            return error_response(400, message, code="invalid_json")
        param = validation_param(error.get("loc", ()))
        message = f"{param}: {error.get('msg')}" if param else f"request body: {error.get('msg')}"
        return error_response(400, message, param, validation_code(error.get("type", "")))

    @app.get("/health")
    async def health() -> Response:
        try:
            gateway.served_model()
        except Exception as exc:
            return error_response(503, str(exc))
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        return await _answer(gateway, request, "GET /v1/models", _models)

    @app.post("/v1/completions")
    async def completions(body: CompletionBody, request: Request) -> Response:
        return await _answer(gateway, request, "POST /v1/completions", _completion, body)

    @app.post("/v1/chat/completions")
    async def chat(body: ChatBody, request: Request) -> Response:
        return await _answer(gateway, request, "POST /v1/chat/completions", _completion, body)

    # probes and scrapes are not traced, nor is every chunk sent
    return OpenTelemetryMiddleware(app, excluded_urls="/health,/metrics", exclude_spans=["receive", "send"])


def _fastapi() -> FastAPI:
    """A bare FastAPI app. Releases with their own OpenTelemetry spans and metrics have them off:
    the maintained ASGI instrumentation traces (once), Prometheus measures."""
    options: dict[str, Any] = {"title": "specmesh", "docs_url": None, "redoc_url": None, "openapi_url": None}
    try:
        return FastAPI(**options, telemetry={"tracing": False, "metrics": False, "logs": False})
    except TypeError:  # a FastAPI without native telemetry
        return FastAPI(**options)


Handler = Callable[..., Awaitable[Response]]


async def _answer(gateway: Gateway, request: Request, method: str, handler: Handler, *args: Any) -> Response:
    """Authorize, run, and map every failure to OpenAI's error shape; count and log the call."""
    start = time.perf_counter()
    try:
        gateway.authorize(request.headers.get("authorization"))
        response = await handler(gateway, request, *args)
    except ClientGone:
        gateway.answered(method, "", grpc.StatusCode.CANCELLED, start)
        return Response(status_code=499)
    except ApiError as exc:
        gateway.answered(method, "", grpc.StatusCode.INVALID_ARGUMENT, start, str(exc))
        return error_response(exc.status, str(exc), exc.param, exc.code)
    except Exception as exc:
        code, details, _ = gateway.status(method, "", exc)
        gateway.answered(method, "", code, start, details)
        status, param = HTTP_STATUS.get(code, 500), None
        if status == 400 and args:
            param = api_param(details, args[0])
            if param is not None:
                details = f"{param}:{details.partition(':')[2]}"
        return error_response(status, details, param)
    gateway.answered(method, "", grpc.StatusCode.OK, start)
    return response


async def _models(gateway: Gateway, request: Request) -> Response:
    model = gateway.served_model()
    card = {"id": gateway.model_name(), "object": "model", "created": 0, "owned_by": "specmesh",
            "max_model_len": model.limits.max_context}  # fmt: skip
    return JSONResponse({"object": "list", "data": [card]})


async def _completion(gateway: Gateway, request: Request, body: _Body) -> Response:
    gateway.served_model()  # 503 before anything else while the gateway is not ready
    name = gateway.model_name()
    if body.model != name:
        raise ApiError(404, f"The model `{body.model}` does not exist (this gateway serves `{name}`)",
                       "model", "model_not_found")  # fmt: skip
    grpc_request = generate_request(body)
    chunks = gateway.generate(grpc_request, None)
    chat = isinstance(body, ChatBody)
    if not body.stream:
        async with contextlib.aclosing(chunks):
            got = await until_disconnect(request, _collect(chunks))
        shape = _Shape(chat, got[-1].session_id, name)
        return JSONResponse(shape.whole("".join(c.text for c in got), got[-1]))
    # The first chunk before the response starts: a bad request still gets its HTTP status.
    try:
        first = await until_disconnect(request, anext(chunks))
    except BaseException:
        await chunks.aclose()
        raise
    include_usage = body.stream_options is not None and body.stream_options.include_usage
    shape = _Shape(chat, first.session_id, name)
    return StreamingResponse(
        _events(shape, first, chunks, include_usage, gateway),
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
    )


async def _collect(chunks: AsyncIterator[Any]) -> list[Any]:
    return [c async for c in chunks]


async def _events(
    shape: _Shape, first: Any, chunks: AsyncIterator[Any], include_usage: bool, gateway: Gateway
) -> AsyncIterator[bytes]:
    """Server-sent events: a chunk per round, the last with finish_reason and `stats`, the usage
    chunk if asked for, then `data: [DONE]`. A failure after the first chunk is an error event."""
    async with contextlib.aclosing(chunks):
        chunk, is_first = first, True
        while True:
            finish = chunk.finish_reason or None
            event = shape.chunk(chunk.text, finish, first=is_first)
            if finish:
                event["stats"] = _stats(chunk.stats)
            yield _sse(event)
            if finish:
                if include_usage:
                    yield _sse(shape.usage_chunk(chunk.stats))
                break
            is_first = False
            try:
                chunk = await anext(chunks)
            except Exception as exc:
                code, details, _ = gateway.status("stream", first.session_id, exc)
                status = HTTP_STATUS.get(code, 500)
                kind = _ERROR_TYPE.get(status, "server_error")
                error = {"message": details, "type": kind, "param": None, "code": error_code(status, details)}
                yield _sse({"error": error})
                break
    yield b"data: [DONE]\n\n"
