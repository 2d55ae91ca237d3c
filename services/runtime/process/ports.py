"""Picking a TCP port for a server that will bind it later (a child process, a restart).

A port taken by binding to port 0 comes from the kernel's ephemeral range, the same range the
kernel hands out as the local port of every outgoing connection; between closing the probe and
the server's bind, any client on the machine (the mesh's own gRPC and etcd clients included) can
be given that port, and the server fails with "address already in use". Ports below the
ephemeral range are never handed out to connections, so a port picked there stays free unless
another server takes it.
"""

from __future__ import annotations

import random
import socket
import threading
from pathlib import Path

EPHEMERAL_RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")
LOWEST_PORT = 10_000
"""Ports below this are left to well-known and registered services."""
ATTEMPTS = 200

_handed_out: set[int] = set()
_lock = threading.Lock()
_random = random.Random()


def ephemeral_range() -> tuple[int, int]:
    """The kernel's range for connections' local ports (Linux's default where unreadable)."""
    try:
        low, high = EPHEMERAL_RANGE_FILE.read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999


def _bindable(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
        return True


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free now, below the ephemeral range, and not returned before by this process
    (two servers started from one process never get the same port). Falls back to a port from
    the kernel (binding port 0) when no such port is found."""
    low = ephemeral_range()[0]
    with _lock:
        if low - LOWEST_PORT > 1000:
            for _ in range(ATTEMPTS):
                port = _random.randrange(LOWEST_PORT, low)
                if port not in _handed_out and _bindable(host, port):
                    _handed_out.add(port)
                    return port
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind((host, 0))
            port = s.getsockname()[1]
        _handed_out.add(port)
        return port
