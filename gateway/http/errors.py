"""Errors in OpenAI's shape, `{"error": {"message", "type", "param", "code"}}`, with the HTTP
status of the gateway's gRPC code (`HTTP_STATUS`)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import grpc
from fastapi.responses import JSONResponse, Response

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
_UNION_MEMBERS = {"str", "int", "float", "bool", "list", "dict", "none"}


class ApiError(Exception):
    """A request the HTTP front refuses itself; `param` is the body's field, as data."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.param, self.code = status, param, code


def error_code(status: int, message: str) -> str | None:
    """OpenAI's `code` for an error the gateway raised: a prompt or length that does not fit the
    context is `context_length_exceeded` (clients trim and retry on it), another bad value
    `invalid_value`; server errors have none."""
    if status == 400:
        return "context_length_exceeded" if "the model's context" in message else "invalid_value"
    return _STATUS_CODE.get(status)


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    kind = _ERROR_TYPE.get(status, "server_error" if status >= 500 else "invalid_request_error")
    return {
        "error": {
            "message": message,
            "type": kind,
            "param": param,
            "code": code or error_code(status, message),
        }
    }


def error_response(
    status: int,
    message: str,
    param: str | None = None,
    code: str | None = None,
    headers: Mapping[str, str] | None = None,
) -> Response:
    headers = dict(headers or {})
    if status == 429:  # the concurrency limit: a slot frees when a generation ends (TGI and vLLM send it)
        headers.setdefault("Retry-After", RETRY_AFTER_SECONDS)
    return JSONResponse(error_body(status, message, param, code), status_code=status, headers=headers)


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


def validation_code(error_type: str) -> str:
    if error_type in _VALIDATION_CODE:
        return _VALIDATION_CODE[error_type]
    return "invalid_type" if error_type.endswith(("_type", "_parsing")) else "invalid_value"
