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
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
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
# choices per request (`n`): each is a session, counted against --max-concurrent-requests
MAX_CHOICES = 16
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
    def token_text(self, token_id: int) -> str: ...
    def generate(self, request: Any, deadline: float | None) -> AsyncIterator[Any]: ...
    def status(self, method: str, session: str, exc: Exception) -> tuple[grpc.StatusCode, str, tuple]: ...
    def answered(
        self, method: str, session: str, code: grpc.StatusCode, start: float, details: str = ""
    ) -> None: ...


# ---- request bodies ----------------------------------------------------------------------------


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    include_usage: bool = False


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True)
    name: str
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None
    description: str | None = None


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


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
    response_format: ResponseFormat | None = None
    constraint: dict[str, Any] | None = None  # specmesh.v1.Constraint as JSON (extra_body): regex, lark
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
    tool_calls: list[dict[str, Any]] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool's answer to one


class FunctionDef(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    name: Annotated[str, Field(min_length=1, max_length=64)]
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    type: Literal["function"]
    function: FunctionDef


class FunctionName(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    name: str


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    type: Literal["function"]
    function: FunctionName


class ChatBody(_Body):
    messages: Annotated[list[Message], Field(min_length=1)]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None


# Fields accepted only at these values (what OpenAI means by leaving them out).
_NEUTRAL: dict[str, Any] = {
    "frequency_penalty": 0.0, "presence_penalty": 0.0, "logit_bias": None,
    "echo": False, "best_of": (None, 1), "suffix": None,
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
            raise ApiError(
                400, f"{name}: is not supported by specmesh (got {value!r})", name, "unsupported_parameter"
            )
    if not 1 <= body.n <= MAX_CHOICES:
        raise ApiError(400, f"n: must be in [1, {MAX_CHOICES}], got {body.n}", "n")
    if body.stream_options is not None and not body.stream:
        raise ApiError(400, "stream_options: only allowed when stream is true", "stream_options")


# ---- body -> GenerateRequest -------------------------------------------------------------------


def generate_request(body: _Body) -> Any:
    """-> the specmesh.v1.GenerateRequest of `body`."""
    _unsupported(body)
    request = gateway_pb2.GenerateRequest()
    if isinstance(body, ChatBody):
        _set_chat(request, body)
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
    _set_logprobs(request, body)
    _set_constraint(request, body)
    return request


def _set_constraint(request: Any, body: _Body) -> None:
    """`response_format` (OpenAI's) or `constraint` (specmesh's, for a regex or a Lark grammar)."""
    fmt = body.response_format
    if fmt is not None and body.constraint is not None and fmt.type != "text":
        raise ApiError(400, "constraint: send response_format or constraint, not both", "constraint")
    calls = forced_tools(body)
    if calls:
        if body.constraint is not None or (fmt is not None and fmt.type != "text"):
            message = "tool_choice: a forced call fixes the output; drop response_format / constraint"
            raise ApiError(400, message, "tool_choice")
        request.constraint.json_schema = json.dumps(call_schema(calls))
        return
    if body.constraint is not None:
        try:
            json_format.ParseDict(body.constraint, request.constraint)
        except json_format.ParseError as exc:
            raise ApiError(400, f"constraint: {exc}", "constraint") from None
    if fmt is None or fmt.type == "text":
        return
    if fmt.type == "json_object":
        request.constraint.json_object = True
        return
    if fmt.json_schema is None:
        raise ApiError(400, "response_format.json_schema: required when type is json_schema",
                       "response_format.json_schema", "missing_required_parameter")  # fmt: skip
    request.constraint.json_schema = json.dumps(fmt.json_schema.schema_ or {})


def _set_logprobs(request: Any, body: _Body) -> None:
    """Chat: `logprobs: true` and `top_logprobs` alternatives; completions: `logprobs` = alternatives.
    The gateway checks the upper limit (`api_param` maps its field to the body's)."""
    if isinstance(body, ChatBody):
        top, param = body.top_logprobs, "top_logprobs"
        if top is not None and not body.logprobs:
            raise ApiError(400, "top_logprobs: needs logprobs set to true", param)
        if not body.logprobs:
            return
        top = top or 0
    else:
        top, param = body.logprobs, "logprobs"  # type: ignore[attr-defined]
        if top is None:
            return
    if not 0 <= top < 2**32:
        raise ApiError(400, f"{param}: must be >= 0, got {top}", param)
    request.logprobs = top


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


def _set_chat(request: Any, body: ChatBody) -> None:
    for i, m in enumerate(body.messages):
        content = m.content if isinstance(m.content, str) else "".join(p.text for p in m.content or [])
        if m.content is None and not m.tool_calls:
            raise ApiError(400, f"messages[{i}].content: must be set", f"messages[{i}].content")
        message = request.chat.messages.add(role=m.role, content=content, tool_call_id=m.tool_call_id or "")
        if m.tool_calls:
            message.tool_calls_json = json.dumps(m.tool_calls)
    if body.tools:
        request.chat.tools_json = json.dumps([t.model_dump(exclude_none=True) for t in body.tools])


# ---- tools ---------------------------------------------------------------------------------------


def forced_tools(body: _Body) -> list[Tool]:
    """The tools one of which the answer must call (tool_choice "required": any; a named function:
    that one); [] when the model answers in text. tool_choice "auto" (the default with tools) would
    need the model's own tool-call syntax parsed out of free text; it is refused (docs/http_api.md)."""
    if not isinstance(body, ChatBody):
        return []
    tools, choice = body.tools or [], body.tool_choice
    if not tools:
        if choice not in (None, "none"):
            raise ApiError(400, "tool_choice: needs tools", "tool_choice")
        return []
    names = [t.function.name for t in tools]
    if len(set(names)) != len(names):
        raise ApiError(400, "tools: function names must be unique", "tools")
    if choice in (None, "auto"):
        raise ApiError(
            400, "tool_choice: 'auto' is not supported (specmesh does not parse a model's own tool-call "
            "syntax); send 'required' or a named function to force a call, or 'none'", "tool_choice",
            "unsupported_value",
        )  # fmt: skip
    if choice == "none":
        return []
    if choice == "required":
        return list(tools)
    assert isinstance(choice, NamedToolChoice)
    if choice.function.name not in names:
        message = f"tool_choice.function.name: {choice.function.name!r} is not among the tools"
        raise ApiError(400, message, "tool_choice.function.name")
    return [t for t in tools if t.function.name == choice.function.name]


def call_schema(tools: Sequence[Tool]) -> dict[str, Any]:
    """The JSON the output must be: {"name": <one of the tools>, "arguments": <its parameters>},
    written compactly (no whitespace between JSON tokens): the call is parsed, never shown, and a
    model cannot spend its tokens on layout."""
    calls = [
        {
            "type": "object",
            "properties": {
                "name": {"const": t.function.name},
                "arguments": t.function.parameters or {"type": "object"},
            },
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        for t in tools
    ]
    schema = calls[0] if len(calls) == 1 else {"anyOf": calls}
    return {**schema, "x-guidance": {"whitespace_flexible": False}}


def tool_call(text: str) -> dict[str, Any] | None:
    """The generated call as OpenAI's `tool_calls[i]`; None if it did not finish (max_tokens)."""
    try:
        call = json.loads(text)
    except ValueError:
        return None
    arguments = json.dumps(call["arguments"], ensure_ascii=False)
    function = {"name": call["name"], "arguments": arguments}
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function", "function": function}


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
    if base == "logprobs" and isinstance(body, ChatBody):
        return "top_logprobs"
    if base == "constraint" and forced_tools(body):
        return "tools"
    if base == "constraint" and getattr(body, "response_format", None) is not None:
        return "response_format.json_schema.schema" if rest == "json_schema" else "response_format"
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


def _usage(stats: Sequence[Any]) -> dict[str, int]:
    """The choices' stats -> `usage`: the prompt counted once (the choices share it, as OpenAI
    counts it), the completions summed."""
    prompt, completion = stats[0].prompt_tokens, sum(s.generated_tokens for s in stats)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def _stats(stats: Any) -> dict[str, Any]:
    return json_format.MessageToDict(
        stats, preserving_proto_field_name=True, always_print_fields_with_no_presence=True
    )


class _Shape:
    """How one endpoint writes its objects: choices of a whole response and of a stream chunk.
    token_text: a token's text (logprobs asked for), None (not asked for). calls: the output is a
    forced tool call (`forced_tools`), answered as `tool_calls`, not `content`."""

    def __init__(
        self,
        chat: bool,
        session_id: str,
        model: str,
        token_text: Callable[[int], str] | None = None,
        calls: bool = False,
    ) -> None:
        self.chat, self.token_text, self.calls = chat, token_text, calls
        prefix = "chatcmpl" if chat else "cmpl"
        self.id, self.model, self.created = f"{prefix}-{session_id}", model, int(time.time())
        self._offset: dict[int, int] = {}  # completions, per choice: where its next token's text starts
        self._call_text: dict[int, str] = {}  # forced calls, per choice: the text so far (streamed)

    def _message(self, text: str, finish: str | None) -> tuple[dict[str, Any], str | None]:
        """A chat choice's message (or final delta) and finish_reason: a forced call that finished
        becomes `tool_calls` with finish_reason "tool_calls" (OpenAI's); text stays text."""
        call = tool_call(text) if self.calls and finish == "stop" else None
        if call is None:
            return {"role": "assistant", "content": text}, finish
        return {"role": "assistant", "content": None, "tool_calls": [call]}, "tool_calls"

    def logprobs(self, entries: Sequence[Any], index: int = 0) -> dict[str, Any] | None:
        """specmesh.v1.TokenLogprob messages -> the choice's `logprobs`, in the endpoint's form:
        chat `{"content": [{token, logprob, bytes, top_logprobs}]}`, completions the legacy
        `{tokens, token_logprobs, top_logprobs, text_offset}`."""
        if self.token_text is None:
            return None
        text = self.token_text
        if self.chat:

            def item(token_id: int, logprob: float) -> dict[str, Any]:
                s = text(token_id)
                return {"token": s, "logprob": logprob, "bytes": list(s.encode())}

            content = [
                {**item(e.token_id, e.logprob), "top_logprobs": [item(t.token_id, t.logprob) for t in e.top]}
                for e in entries
            ]
            return {"content": content, "refusal": None}
        tokens = [text(e.token_id) for e in entries]
        offsets, at = [], self._offset.get(index, 0)
        for s in tokens:
            offsets.append(at)
            at += len(s)
        self._offset[index] = at
        return {
            "tokens": tokens,
            "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": [{text(t.token_id): t.logprob for t in e.top} for e in entries],
            "text_offset": offsets,
        }

    def _object(self, kind: str, choices: list[dict], **more: Any) -> dict[str, Any]:
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model,
                "choices": choices, **more}  # fmt: skip

    def whole(self, choices: Sequence[list[Any]]) -> dict[str, Any]:
        """choices: each choice's GenerateChunks, in order."""
        out, lasts = [], [chunks[-1] for chunks in choices]
        for index, chunks in enumerate(choices):
            text = "".join(c.text for c in chunks)
            logprobs = self.logprobs([e for c in chunks for e in c.logprobs], index)
            choice: dict[str, Any] = {
                "index": index,
                "logprobs": logprobs,
                "finish_reason": lasts[index].finish_reason,
            }
            if self.chat:
                choice["message"], choice["finish_reason"] = self._message(text, choice["finish_reason"])
            else:
                choice["text"] = text
            out.append(choice)
        kind = "chat.completion" if self.chat else "text_completion"
        return self._object(kind, out, usage=_usage([c.stats for c in lasts]), **self._stats(lasts, out))

    def chunk(self, index: int, chunk: Any, first: bool = False) -> dict[str, Any]:
        """One GenerateChunk of choice `index` as a stream event; the last has `stats`."""
        finish, text = chunk.finish_reason or None, chunk.text
        choice: dict[str, Any] = {
            "index": index,
            "logprobs": self.logprobs(chunk.logprobs, index),
            "finish_reason": finish,
        }
        if self.chat and self.calls:  # the call is sent whole, once it is complete
            so_far = self._call_text[index] = self._call_text.get(index, "") + text
            delta = {"role": "assistant", "content": None} if first else {}
            if finish:
                message, choice["finish_reason"] = self._message(so_far, finish)
                calls = message.get("tool_calls")
                delta |= {"tool_calls": [{"index": 0, **calls[0]}]} if calls else {"content": so_far}
            choice["delta"] = delta
        elif self.chat:
            delta = {"role": "assistant", "content": text} if first else {"content": text}
            choice["delta"] = delta if (text or first or not finish) else {}
        else:
            choice["text"] = text
        event = self._object("chat.completion.chunk" if self.chat else "text_completion", [choice])
        if finish:
            event["stats"] = _stats(chunk.stats)
        return event

    def usage_chunk(self, lasts: Sequence[Any]) -> dict[str, Any]:
        """The usage chunk; with several choices their stats were in each one's last chunk."""
        kind = "chat.completion.chunk" if self.chat else "text_completion"
        more = {"stats": _stats(lasts[0].stats)} if len(lasts) == 1 else {}
        return self._object(kind, [], usage=_usage([c.stats for c in lasts]), **more)

    @staticmethod
    def _stats(lasts: Sequence[Any], choices: list[dict]) -> dict[str, Any]:
        """One choice: the response's `stats`; several: each choice's own (`choices[i].stats`)."""
        if len(lasts) == 1:
            return {"stats": _stats(lasts[0].stats)}
        for choice, last in zip(choices, lasts, strict=True):
            choice["stats"] = _stats(last.stats)
        return {}


def _sse(obj: Any, event_id: str = "") -> bytes:
    head = f"id: {event_id}\n".encode() if event_id else b""
    return head + b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


def resume_point(last_event_id: str, n: int) -> Any:
    """`Last-Event-ID: <session>:<tokens received>` (the id of the last event a client got) ->
    specmesh.v1.Resume: a stream cut by a gateway's death or shutdown goes on on another gateway."""
    session, _, index = last_event_id.rpartition(":")
    if n != 1:
        raise ApiError(400, "Last-Event-ID: a stream of several choices (n > 1) cannot be resumed", "n")
    if not session or not index.isdigit() or int(index) >= 2**32:
        raise ApiError(400, f"Last-Event-ID: expected <session>:<token count>, got {last_event_id!r}",
                       "Last-Event-ID")  # fmt: skip
    return gateway_pb2.Resume(session_id=session, token_index=int(index))


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
    token_text = gateway.token_text if grpc_request.HasField("logprobs") else None
    last_event_id = request.headers.get("last-event-id", "") if body.stream else ""
    resume = resume_point(last_event_id, body.n) if last_event_id else None
    if resume is not None:  # the body says how to answer; the session in Redis what to generate
        grpc_request = gateway_pb2.GenerateRequest(resume=resume)
    streams = [gateway.generate(r, None) for r in choice_requests(grpc_request, body.n)]
    chat = isinstance(body, ChatBody)
    calls = bool(forced_tools(body))
    if not body.stream:
        got = await until_disconnect(request, _collect(streams))
        shape = _Shape(chat, got[0][-1].session_id, name, token_text, calls)
        return JSONResponse(shape.whole(got))
    # Every choice's first chunk before the response starts: a bad request still gets its status.
    firsts = await until_disconnect(request, _firsts(streams))
    include_usage = body.stream_options is not None and body.stream_options.include_usage
    shape = _Shape(chat, firsts[0].session_id, name, token_text, calls)
    return StreamingResponse(
        _events(shape, firsts, streams, include_usage, gateway, resume.token_index if resume else 0),
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
    )


def choice_requests(request: Any, n: int) -> list[Any]:
    """`n` choices are `n` sessions of one request, run side by side (the verifier batches them).
    With a seed, choice i draws with seed + i, so each is reproducible and they differ; without
    one, each session draws its own."""
    if n == 1:
        return [request]
    out = []
    for i in range(n):
        choice = gateway_pb2.GenerateRequest()
        choice.CopyFrom(request)
        if request.sampling.HasField("seed"):
            choice.sampling.seed = (request.sampling.seed + i) % 2**64
        out.append(choice)
    return out


async def _all(work: Sequence[Awaitable[T]]) -> list[T]:
    """Every result, or the first failure once the others are cancelled (a failed choice or a
    client that left ends every choice's session)."""
    tasks = [asyncio.ensure_future(w) for w in work]
    try:
        return list(await asyncio.gather(*tasks))
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _collect(streams: Sequence[AsyncIterator[Any]]) -> list[list[Any]]:
    async def one(chunks: AsyncIterator[Any]) -> list[Any]:
        async with contextlib.aclosing(chunks):
            return [c async for c in chunks]

    return await _all([one(s) for s in streams])


async def _firsts(streams: Sequence[AsyncIterator[Any]]) -> list[Any]:
    """Each choice's first chunk; on any failure every stream is closed."""
    try:
        return await _all([anext(s) for s in streams])
    except BaseException:
        await asyncio.gather(*(s.aclose() for s in streams), return_exceptions=True)
        raise


async def _merged(streams: Sequence[AsyncIterator[Any]]) -> AsyncIterator[tuple[int, Any]]:
    """(choice index, chunk) as each choice's chunks come; a choice's failure ends them all."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(index: int, chunks: AsyncIterator[Any]) -> None:
        async with contextlib.aclosing(chunks):
            try:
                async for chunk in chunks:
                    await queue.put((index, chunk, None))
            except Exception as exc:
                await queue.put((index, None, exc))
                return
        await queue.put((index, None, None))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        for _ in range(len(streams)):
            while True:
                index, chunk, exc = await queue.get()
                if exc is not None:
                    raise exc
                if chunk is None:
                    break
                yield index, chunk
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _events(
    shape: _Shape,
    firsts: Sequence[Any],
    streams: Sequence[AsyncIterator[Any]],
    include_usage: bool,
    gateway: Gateway,
    start: int = 0,
) -> AsyncIterator[bytes]:
    """Server-sent events: a chunk per round of each choice, each choice's last with its
    finish_reason and `stats`, the usage chunk if asked for, then `data: [DONE]`. A failure after
    the first chunk is an error event. A single choice's events carry `id: <session>:<tokens so
    far>` (from `start`, a resume's index), what a client sends back as Last-Event-ID to resume."""
    lasts: list[Any] = list(firsts)
    received = start

    def event_id(chunk: Any) -> str:
        nonlocal received
        received += len(chunk.token_ids)
        return f"{chunk.session_id}:{received}" if len(firsts) == 1 else ""

    for index, first in enumerate(firsts):
        yield _sse(shape.chunk(index, first, first=True), event_id(first))
    going = [i for i, c in enumerate(firsts) if not c.finish_reason]
    rest = _merged([streams[i] for i in going])
    async with contextlib.aclosing(rest):
        try:
            async for k, chunk in rest:
                index = going[k]
                lasts[index] = chunk
                yield _sse(shape.chunk(index, chunk), event_id(chunk))
        except Exception as exc:
            code, details, _ = gateway.status("stream", firsts[0].session_id, exc)
            status = HTTP_STATUS.get(code, 500)
            kind = _ERROR_TYPE.get(status, "server_error")
            error = {"message": details, "type": kind, "param": None, "code": error_code(status, details)}
            yield _sse({"error": error})
            yield b"data: [DONE]\n\n"
            return
        finally:
            for i, stream in enumerate(streams):  # the finished ones: their generators' cleanup
                if i not in going:
                    await stream.aclose()
    if include_usage:
        yield _sse(shape.usage_chunk(lasts))
    yield b"data: [DONE]\n\n"
