"""Free TCP ports for the processes a stack, a benchmark or a test starts on this machine."""

from __future__ import annotations

import os
import random
import socket
from pathlib import Path

_LOWEST = 10_000  # below: ports that well-known services tend to use
_next: int | None = None  # where this process looks next


def free_port(host: str = "127.0.0.1") -> int:
    """A port that was free a moment ago, outside the kernel's ephemeral range: a port from that
    range (what binding port 0 returns) can become the local port of any outgoing connection before
    the process it was meant for binds it (CI saw a replica fail to start so). Where the range
    leaves no room below it, the kernel's pick.

    Each process walks the range from its own start (seeded by its pid), one port after the other:
    processes that pick ports at the same moment (pytest's workers) rarely meet, and a process
    never hands out a port twice before it has gone round the range."""
    global _next
    low = _ephemeral_low()
    if low - _LOWEST < 1_000:
        return _kernel_pick(host)
    span = low - _LOWEST
    if _next is None:
        _next = random.Random(os.getpid()).randrange(span)
    for _ in range(span):
        port, _next = _LOWEST + _next % span, (_next + 1) % span
        if _bindable(host, port):
            return port
    raise OSError(f"no free TCP port found on {host}")


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 49_152  # the IANA dynamic range, macOS's default


def _kernel_pick(host: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _bindable(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
        return True
