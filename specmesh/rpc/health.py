"""grpc.health.v1 probe: `python -m specmesh.rpc.health HOST:PORT [--service S] [--timeout T]`,
over TLS with `--ca CA` (and `--cert C --key K` for a server that requires mutual TLS).

Exit status 0 when the server answers SERVING, 1 otherwise (the reason goes to stderr). Used by
the docker compose healthchecks (the image has no grpc_health_probe binary) and by the
supervisor of `specmesh up` to tell when a service is ready.
"""

from __future__ import annotations

import argparse
import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from specmesh.rpc.tls import ClientTls, TlsError, client_tls, sync_channel


def check(address: str, service: str = "", timeout: float = 2.0, tls: ClientTls | None = None) -> str | None:
    """None if `address` answers SERVING for `service` ("" = the whole server), else why not."""
    try:
        channel = sync_channel(address, tls)
    except TlsError as exc:
        return str(exc)
    with channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=timeout
            )
        except grpc.RpcError as exc:
            return f"{exc.code().name}: {exc.details()}"  # type: ignore[attr-defined]
    if reply.status != health_pb2.HealthCheckResponse.SERVING:
        return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m specmesh.rpc.health", description=__doc__)
    parser.add_argument("address", help="HOST:PORT of a gRPC server")
    parser.add_argument("--service", default="", help="service name to ask about ('' = the server)")
    parser.add_argument("--timeout", type=float, default=2.0, help="seconds")
    parser.add_argument("--ca", default="", help="PEM CA of the server's certificate: TLS")
    parser.add_argument("--cert", default="", help="PEM client certificate, for mutual TLS")
    parser.add_argument("--key", default="", help="PEM private key of --cert")
    args = parser.parse_args(argv)
    try:
        tls = client_tls(args.ca, args.cert, args.key)
    except TlsError as exc:
        parser.error(str(exc))
    problem = check(args.address, args.service, args.timeout, tls)
    if problem is not None:
        print(f"{args.address} not serving: {problem}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
