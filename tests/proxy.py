"""nginx (Debian's package) in front of the test's gateways, from deploy/proxy/nginx.conf.template:
gRPC over h2c on one port, the HTTP API on another. Skips the test where nginx is not installed."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from specmesh.stack.ports import free_port

ROOT = Path(__file__).resolve().parent.parent
TEMPLATE = ROOT / "deploy" / "proxy" / "nginx.conf.template"


@dataclass
class Nginx:
    dir: Path
    grpc_port: int
    http_port: int
    proc: subprocess.Popen | None = None

    @property
    def grpc_address(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    @classmethod
    def start(cls, directory: Path, grpc_backends: list[str], http_backends: list[str]) -> Nginx:
        binary = shutil.which("nginx") or ("/usr/sbin/nginx" if Path("/usr/sbin/nginx").exists() else None)
        if binary is None:
            pytest.skip("no nginx (Debian's nginx-light; .ci/run installs it)")
        proxy = cls(directory, free_port(), free_port())

        def servers(addresses: list[str]) -> str:
            return "\n".join(f"        server {a} max_fails=0;" for a in addresses)

        config = (
            TEMPLATE.read_text()
            .replace("@DIR@", str(directory))
            .replace("@HOST@", "127.0.0.1")
            .replace("@GRPC_PORT@", str(proxy.grpc_port))
            .replace("@HTTP_PORT@", str(proxy.http_port))
            .replace("@GRPC_SERVERS@", servers(grpc_backends))
            .replace("@HTTP_SERVERS@", servers(http_backends))
        )
        (directory / "nginx.conf").write_text(config)
        log = open(directory / "stdout.log", "ab")  # noqa: SIM115 (kept open with the process)
        proxy.proc = subprocess.Popen(
            [binary, "-p", str(directory), "-c", str(directory / "nginx.conf")], stdout=log, stderr=log
        )
        for port in (proxy.grpc_port, proxy.http_port):
            _wait_listening(port, proxy.proc, directory)
        return proxy

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(timeout=10)


def _wait_listening(port: int, proc: subprocess.Popen, directory: Path, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            log = (directory / "error.log").read_text() if (directory / "error.log").exists() else ""
            pytest.fail(f"nginx exited with {proc.returncode}: {log[-2000:]}")
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.05)
    pytest.fail(f"nginx not listening on {port} after {timeout}s")
