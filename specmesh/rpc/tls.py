"""TLS for every gRPC hop: the credentials of a server and of a client, from PEM files.

    ServerTls(cert, key)                 # the server listens with TLS only
    ServerTls(cert, key, client_ca=CA)   # mutual TLS: a client certificate signed by CA is required
    ClientTls(ca=CA)                     # trust the server's certificate if CA signed it
    ClientTls(ca=CA, cert=C, key=K)      # ... and show this certificate (mutual TLS)

Paths only: these know nothing of flags (specmesh.rpc.server and the gateway build them from
theirs). Every channel a client of specmesh opens goes through `aio_channel` / `sync_channel`,
insecure when it is given no ClientTls.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import grpc

__all__ = ["ClientTls", "ServerTls", "TlsError", "aio_channel", "client_tls", "server_tls", "sync_channel"]

ChannelOptions = Sequence[tuple[str, Any]]


class TlsError(ValueError):
    """A TLS setting that cannot work (a missing file, a certificate without its key)."""


def read_pem(path: str, what: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as exc:
        raise TlsError(f"{what}: cannot read {path}: {exc.strerror}") from None


@dataclass(frozen=True)
class ServerTls:
    cert: str  # PEM: the server's certificate (chain)
    key: str  # PEM: its private key
    client_ca: str = ""  # PEM: when set, clients must show a certificate this CA signed

    def credentials(self) -> grpc.ServerCredentials:
        pair = (read_pem(self.key, "TLS key"), read_pem(self.cert, "TLS certificate"))
        return grpc.ssl_server_credentials(
            [pair],
            root_certificates=read_pem(self.client_ca, "client CA") if self.client_ca else None,
            require_client_auth=bool(self.client_ca),
        )


@dataclass(frozen=True)
class ClientTls:
    ca: str = ""  # PEM: the CA that signed the server's certificate ("" = the system's CAs)
    cert: str = ""  # PEM: this client's certificate, for mutual TLS ("" = none)
    key: str = ""  # PEM: its private key

    def __post_init__(self) -> None:
        if bool(self.cert) != bool(self.key):
            raise TlsError("a client certificate needs its key, and a key its certificate")

    def credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(
            root_certificates=read_pem(self.ca, "CA") if self.ca else None,
            private_key=read_pem(self.key, "client key") if self.key else None,
            certificate_chain=read_pem(self.cert, "client certificate") if self.cert else None,
        )


def server_tls(cert: str, key: str, client_ca: str = "") -> ServerTls | None:
    """ServerTls from optional settings; None (plaintext) when none is set."""
    if not (cert or key or client_ca):
        return None
    if not (cert and key):
        hint = " (a client CA alone is not TLS)" if client_ca else ""
        raise TlsError(f"TLS needs both a certificate and its key{hint}")
    return ServerTls(cert, key, client_ca)


def client_tls(ca: str, cert: str, key: str) -> ClientTls | None:
    """ClientTls from optional settings; None (plaintext) when none is set."""
    if not (ca or cert or key):
        return None
    return ClientTls(ca, cert, key)


def _options(options: ChannelOptions, server_name: str) -> list[tuple[str, Any]]:
    # A dns:/// target is dialled by IP address: the certificate is checked against its name.
    return [*options, ("grpc.ssl_target_name_override", server_name)] if server_name else list(options)


def aio_channel(
    address: str,
    tls: ClientTls | None,
    *,
    options: ChannelOptions = (),
    interceptors: Sequence[Any] | None = None,
    server_name: str = "",
) -> grpc.aio.Channel:
    """An asyncio channel: TLS with `tls` (its certificate checked for `server_name`, else for
    the address's host), insecure without."""
    if tls is None:
        return grpc.aio.insecure_channel(address, options=list(options), interceptors=interceptors)
    return grpc.aio.secure_channel(
        address, tls.credentials(), options=_options(options, server_name), interceptors=interceptors
    )


def sync_channel(
    address: str, tls: ClientTls | None, *, options: ChannelOptions = (), server_name: str = ""
) -> grpc.Channel:
    """The same, as a blocking channel (health probes, the CLI)."""
    if tls is None:
        return grpc.insecure_channel(address, options=list(options))
    return grpc.secure_channel(address, tls.credentials(), options=_options(options, server_name))
