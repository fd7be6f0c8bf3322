"""uvicorn embedded in the gateway's event loop, beside the gRPC server: started and drained by
the gateway's lifecycle (specmesh.rpc.server.serve owns the signals, not uvicorn)."""

from __future__ import annotations

import asyncio
import logging
import ssl
from typing import Any

import uvicorn

from specmesh.rpc.tls import ServerTls

log = logging.getLogger("specmesh.gateway.http")


class HttpServer:
    def __init__(self, app: object, host: str, port: int, tls: ServerTls | None = None) -> None:
        self.config = uvicorn.Config(
            app, host=host, port=port, lifespan="off", access_log=False, log_config=None,
            server_header=False, timeout_keep_alive=30, **_https(tls),
        )  # fmt: skip
        self.server = uvicorn.Server(self.config)
        self._loop_task: asyncio.Task | None = None

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
        self._loop_task = asyncio.create_task(self.server.main_loop(), name="http")
        log.info(
            "serving http",
            extra={"host": self.config.host, "http_port": self.config.port, "https": self.config.is_ssl},
        )

    async def stop(self, grace_seconds: float) -> None:
        """Stop accepting; requests in flight get `grace_seconds`, then are cancelled."""
        self.config.timeout_graceful_shutdown = max(1, round(grace_seconds))
        self.server.should_exit = True
        if self._loop_task is not None:
            await self._loop_task
        await self.server.shutdown()


def _https(tls: ServerTls | None) -> dict[str, Any]:
    """uvicorn's settings for the gRPC port's TLS: the same certificate, and the same client
    certificate requirement (--tls-client-ca)."""
    if tls is None:
        return {}
    https: dict[str, Any] = {"ssl_certfile": tls.cert, "ssl_keyfile": tls.key}
    if tls.client_ca:
        https.update(ssl_ca_certs=tls.client_ca, ssl_cert_reqs=ssl.CERT_REQUIRED)
    return https
