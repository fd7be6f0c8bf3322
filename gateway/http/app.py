"""The FastAPI app of the HTTP front (vLLM's `api_server.py`): routes, authorization, and every
failure mapped to OpenAI's error shape.

    POST /v1/completions, POST /v1/chat/completions   (stream: true -> server-sent events)
    GET  /v1/models, /health, /metrics
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from typing import Any

import grpc
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from opentelemetry.instrumentation.asgi import OpenTelemetryMiddleware
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from gateway.http.errors import HTTP_STATUS, ApiError, error_response, validation_code, validation_param
from gateway.http.protocol import ChatBody, CompletionBody
from gateway.http.serving import ClientGone, Gateway, completion, models
from gateway.http.translate import api_param


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
    async def list_models(request: Request) -> Response:
        return await _answer(gateway, request, "GET /v1/models", models)

    @app.post("/v1/completions")
    async def completions(body: CompletionBody, request: Request) -> Response:
        return await _answer(gateway, request, "POST /v1/completions", completion, body)

    @app.post("/v1/chat/completions")
    async def chat(body: ChatBody, request: Request) -> Response:
        return await _answer(gateway, request, "POST /v1/chat/completions", completion, body)

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
        request.state.tenant = gateway.authorize(request.headers.get("authorization"))
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
        field = getattr(exc, "field", None)  # WireError's and GatewayError's: the request's field
        if status == 400 and field and args:
            param = api_param(field, args[0])
            details = param + details.removeprefix(field)
        return error_response(status, details, param)
    gateway.answered(method, "", grpc.StatusCode.OK, start)
    return response
