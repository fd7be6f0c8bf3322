"""The OpenAI-compatible HTTP front of the gateway (docs/http_api.md), served next to its gRPC port
from the same process, split as vLLM splits its OpenAI entrypoints:

    protocol.py   the request bodies (pydantic)
    translate.py  a body -> the GenerateRequest a gRPC client would send; field names back
    tools.py      tool_choice, and a model's own tool-call syntax parsed out of its text
    serving.py    running the request through `Gateway.generate`; whole answers and SSE streams
    errors.py     OpenAI's error shape and the HTTP status of each gRPC code
    app.py        the FastAPI app: routes, authorization, errors
    server.py     uvicorn on the gateway's event loop

A request runs through the same `GatewayService.generate` as a gRPC call, so validation, sessions,
failover, metrics and the output are those of the gRPC API.
"""
