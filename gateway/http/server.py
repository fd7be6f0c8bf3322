"""uvicorn embedded in the gateway's event loop, beside the gRPC server: started and drained by
the gateway's lifecycle (specmesh.rpc.server.serve owns the signals, not uvicorn)."""

from __future__ import annotations

import logging
import ssl
import time
from email.utils import formatdate
from typing import Any

import uvicorn

from specmesh.rpc.tls import ServerTls

log = logging.getLogger("specmesh.gateway.http")


class HttpServer:
    def __init__(self, app: object, host: str, port: int, tls: ServerTls | None = None) -> None:
        self.config = uvicorn.Config(
            _DateHeader(app), host=host, port=port, lifespan="off", access_log=False, log_config=None,
            server_header=False, date_header=False, timeout_keep_alive=30, **_https(tls),
        )  # fmt: skip
        self.server = uvicorn.Server(self.config)

    async def start(self) -> None:
        """Listening once this returns; exits the process if the port cannot be bound."""
        try:
            self.config.load()  # what uvicorn.Server.serve does before startup (minus its signals)
        except OSError as exc:  # ssl.SSLError included: a certificate or key that does not load
            raise SystemExit(f"cannot serve HTTPS: {exc}") from None
        self.server.lifespan = self.config.lifespan_class(self.config)
        await self.server.startup()
        if self.server.should_exit:  # uvicorn logged why (e.g. the port is taken)
            raise SystemExit(f"cannot serve HTTP on {self.config.host}:{self.config.port}")
        # uvicorn's main loop is not run: it woke ten times a second to see whether it should exit
        # (the gateway's `stop` shuts uvicorn down itself) and to refresh its Date header
        # (`_DateHeader` adds it per response instead). On a small shared host each wake-up of an
        # idle process cost ~2.5 ms of CPU (its caches had gone cold), taken from the forwards.
        await self.server.on_tick(0)  # tick 0 sets the headers every response starts with
        log.info(
            "serving http",
            extra={"host": self.config.host, "http_port": self.config.port, "https": self.config.is_ssl},
        )

    async def stop(self, grace_seconds: float) -> None:
        """Stop accepting; requests in flight get `grace_seconds`, then are cancelled."""
        self.config.timeout_graceful_shutdown = max(1, round(grace_seconds))
        self.server.should_exit = True
        await self.server.shutdown()


class _DateHeader:
    """ASGI middleware: the Date header an origin server with a clock sends on every response
    (RFC 9110), formatted once a second at most, when a response needs it: no timer wakes an
    idle gateway for it."""

    def __init__(self, app: Any) -> None:
        self.app = app
        self._second, self._date = -1, b""

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

        async def dated(message: dict) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", ()), (b"date", self._now())]}
            await send(message)

        return await self.app(scope, receive, dated)

    def _now(self) -> bytes:
        second = int(time.time())
        if second != self._second:
            self._second, self._date = second, formatdate(second, usegmt=True).encode()
        return self._date


def _https(tls: ServerTls | None) -> dict[str, Any]:
    """uvicorn's settings for the gRPC port's TLS: the same certificate, and the same client
    certificate requirement (--tls-client-ca)."""
    if tls is None:
        return {}
    https: dict[str, Any] = {"ssl_certfile": tls.cert, "ssl_keyfile": tls.key}
    if tls.client_ca:
        https.update(ssl_ca_certs=tls.client_ca, ssl_cert_reqs=ssl.CERT_REQUIRED)
    return https
