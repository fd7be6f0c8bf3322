"""An OpenAI body -> the specmesh.v1.GenerateRequest a gRPC client would send, and the gateway's
field names back to the body's (an error names `max_tokens`, not the gRPC `max_new_tokens`).

Differences from the gRPC API, as OpenAI defines them: an unset `temperature` is 1.0 (gRPC: 0,
greedy); `stop` may be one string; `top_k: -1` means no filter (vLLM's convention).
"""

from __future__ import annotations

import json
from typing import Any

from google.protobuf import json_format

from gateway.api import gateway_pb2
from gateway.http.errors import ApiError
from gateway.http.protocol import MAX_CHOICES, NEUTRAL, Body, ChatBody
from gateway.http.tools import ToolPlan, call_schema, forces_call

INT32 = 2**31 - 1


def generate_request(body: Body, tools: ToolPlan) -> Any:
    """-> the specmesh.v1.GenerateRequest of `body`; tools: its `tool_plan`."""
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
    _set_constraint(request, body, tools)
    if body.cache_salt is not None:
        request.cache_salt = body.cache_salt
    request.private = body.private
    return request


def _unsupported(body: Body) -> None:
    for name, neutral in NEUTRAL.items():
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


def _set_constraint(request: Any, body: Body, tools: ToolPlan) -> None:
    """`response_format` (OpenAI's) or `constraint` (specmesh's, for a regex or a Lark grammar);
    a forced tool call is a JSON schema of its own."""
    fmt = body.response_format
    if fmt is not None and body.constraint is not None and fmt.type != "text":
        raise ApiError(400, "constraint: send response_format or constraint, not both", "constraint")
    if tools.use.constrains:
        if body.constraint is not None or (fmt is not None and fmt.type != "text"):
            message = "tool_choice: a forced call fixes the output; drop response_format / constraint"
            raise ApiError(400, message, "tool_choice")
        request.constraint.json_schema = json.dumps(call_schema(tools.tools))
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


def _set_logprobs(request: Any, body: Body) -> None:
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
        if m.role == "tool" and not m.tool_call_id:
            message = f"messages[{i}].tool_call_id: a tool message answers a call: name it"
            raise ApiError(400, message, f"messages[{i}].tool_call_id", "missing_required_parameter")
        message = request.chat.messages.add(role=m.role, content=content, tool_call_id=m.tool_call_id or "")
        if m.tool_calls:
            message.tool_calls_json = json.dumps([c.model_dump() for c in m.tool_calls])
    if body.tools:
        request.chat.tools_json = json.dumps([t.model_dump(exclude_none=True) for t in body.tools])


def length_param(body: Any) -> str:
    """The body's name for the length limit: max_completion_tokens if that is what a chat sent."""
    only_new = getattr(body, "max_completion_tokens", None) is not None and body.max_tokens is None
    return "max_completion_tokens" if only_new else "max_tokens"


def _set_max_tokens(request: Any, body: Body) -> None:
    given = {body.max_tokens, getattr(body, "max_completion_tokens", None)} - {None}
    if len(given) > 1:
        message = "max_completion_tokens: differs from max_tokens; send one"
        raise ApiError(400, message, "max_completion_tokens")
    if given:
        name = length_param(body)
        request.max_new_tokens = _int32(given.pop(), name)


def _int32(value: int, param: str) -> int:
    if not -INT32 - 1 <= value <= INT32:
        raise ApiError(400, f"{param}: {value} is out of range", param)
    return value


def api_param(field: str, body: Any) -> str:
    """The body's name of a GenerateRequest field the gateway refused (WireError.field)."""
    head, _, rest = field.partition(".")
    base = head.split("[", 1)[0]
    if base == "max_new_tokens":
        return length_param(body)
    if base == "sampling":
        return rest
    if base in ("prompt_token_ids", "prompt"):
        return "prompt"
    if base == "chat":
        if rest.startswith("tools"):
            return "tools"
        if not rest.startswith("messages"):
            return "messages"
        return "messages" + rest.removeprefix("messages").replace(".tool_calls_json", ".tool_calls", 1)
    if base == "logprobs" and isinstance(body, ChatBody):
        return "top_logprobs"
    if base == "constraint" and forces_call(body):
        return "tools"
    form = getattr(body, "response_format", None)
    # beside a text format a constraint's error is the constraint's own; else it came from the format
    if base == "constraint" and form is not None and form.type != "text":
        return "response_format.json_schema.schema" if rest == "json_schema" else "response_format"
    return field


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


def resume_point(last_event_id: str, n: int) -> Any:
    """`Last-Event-ID: <session>:<tokens received>` (the id of the last event a client got) ->
    specmesh.v1.Resume: a stream cut by a gateway's death or shutdown goes on on another gateway."""
    session, _, index = last_event_id.rpartition(":")
    if n != 1:
        raise ApiError(400, "Last-Event-ID: a stream of several choices (n > 1) cannot be resumed", "n")
    if not session or not (index.isascii() and index.isdigit()) or int(index) >= 2**32:
        raise ApiError(400, f"Last-Event-ID: expected <session>:<token count>, got {last_event_id!r}",
                       "Last-Event-ID")  # fmt: skip
    return gateway_pb2.Resume(session_id=session, token_index=int(index))
