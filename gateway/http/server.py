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
        self._loop_task = asyncio.create_task(self._date_loop(), name="http-date")
        log.info(
            "serving http",
            extra={"host": self.config.host, "http_port": self.config.port, "https": self.config.is_ssl},
        )

    async def _date_loop(self) -> None:
        """uvicorn's own main loop wakes ten times a second to see whether it should exit; here
        the gateway's `stop` shuts uvicorn down itself, so only the loop's once-a-second refresh of
        the Date header is kept. Each wake-up of an idle process cost ~2.5 ms of CPU on a small
        shared host (its caches had gone cold): 25 ms a second, taken from the forwards."""
        while True:
            try:
                await self.server.on_tick(0)  # tick 0: the Date header
            except Exception:  # a stale Date header, not a stopped loop
                log.exception("refreshing the Date header failed")
            await asyncio.sleep(1.0)

    async def stop(self, grace_seconds: float) -> None:
        """Stop accepting; requests in flight get `grace_seconds`, then are cancelled."""
        self.config.timeout_graceful_shutdown = max(1, round(grace_seconds))
        self.server.should_exit = True
        if self._loop_task is not None:
            self._loop_task.cancel()
            await asyncio.gather(self._loop_task, return_exceptions=True)
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
