"""The OpenAI request bodies the HTTP front accepts (pydantic models; vLLM's `protocol.py`).

Unknown fields are refused, as OpenAI does; fields OpenAI has but specmesh does not implement are
accepted only at their neutral value (`NEUTRAL`, checked in gateway.http.translate).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

# choices per request (`n`): each is a session, counted against --max-concurrent-requests
MAX_CHOICES = 16


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(_Strict):
    include_usage: bool = False


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True)
    name: str
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None
    description: str | None = None


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class Body(_Strict):
    """Fields both endpoints take."""

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
    cache_salt: str | None = None  # vLLM's: the prefix cache's namespace within the API key's
    private: bool = False  # specmesh.v1.GenerateRequest.private (extra_body): teaches no drafts
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None


class CompletionBody(Body):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = None
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class FunctionCall(_Strict):
    name: Annotated[str, Field(min_length=1)]
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(_Strict):
    """A call in an earlier assistant message."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class Message(_Strict):
    role: str
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool's answer to one


class FunctionDef(_Strict):
    name: Annotated[str, Field(min_length=1, max_length=64)]
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(_Strict):
    type: Literal["function"]
    function: FunctionDef


class FunctionName(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: FunctionName


class ChatBody(Body):
    messages: Annotated[list[Message], Field(min_length=1)]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None


# Fields accepted only at these values (what OpenAI means by leaving them out).
NEUTRAL: dict[str, Any] = {
    "frequency_penalty": 0.0, "presence_penalty": 0.0, "logit_bias": None,
    "echo": False, "best_of": (None, 1), "suffix": None,
}  # fmt: skip
