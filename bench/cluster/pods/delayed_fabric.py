"""Latency between nodes without netem: the fabric as a userspace switch over TAP devices.

Each node's uplink (and the host's link) is a TAP device whose file descriptor the switch
process (tap_switch.py) holds; it learns which MAC address is behind which port, and writes
every frame it reads to the port of its destination (every other port when it does not know it
yet) ``latency_ms`` later. Source addresses are kept, so the pods' NetworkPolicies see what
they would see across a cluster's nodes. A TAP device lives in the network namespace of the
thread that creates it: the node's are made from a thread inside the node's namespace.
"""

from __future__ import annotations

import fcntl
import os
import struct
import subprocess
import sys
import threading
from collections.abc import Callable

from bench.cluster.pods.probes import enter_netns

TUNSETIFF = 0x400454CA
IFF_TAP = 0x0002
IFF_NO_PI = 0x1000


def open_tap(name: str, netns: str = "") -> int:
    """A new TAP device ``name`` (in ``netns``, or this namespace); its file descriptor."""
    result: dict[str, int | OSError] = {}

    def make() -> None:
        try:
            if netns:
                enter_netns(netns)
            fd = os.open("/dev/net/tun", os.O_RDWR)
            fcntl.ioctl(fd, TUNSETIFF, struct.pack("16sH", name.encode(), IFF_TAP | IFF_NO_PI))
            result["fd"] = fd
        except OSError as error:  # handed to the caller's thread
            result["error"] = error

    thread = threading.Thread(target=make)
    thread.start()
    thread.join()
    if "error" in result:
        raise result["error"]  # type: ignore[misc]
    return result["fd"]  # type: ignore[return-value]


class DelayedFabric:
    """The fabric as tap_switch.py, holding frames ``latency_ms``."""

    def __init__(self, latency_ms: float):
        self.latency_ms = latency_ms
        self._fds: list[int] = []
        self._switch: subprocess.Popen | None = None

    def create(self, name_prefix: str, add_netns: Callable[[str], None]) -> str:
        host_link = f"{name_prefix}h"
        self._fds.append(open_tap(host_link))
        return host_link

    def attach(self, node: int, node_netns: str) -> str:
        self._fds.append(open_tap("uplink", node_netns))
        return "uplink"

    def finish(self) -> None:
        argv = [
            sys.executable,
            "-m",
            "bench.cluster.pods.tap_switch",
            str(self.latency_ms),
            *map(str, self._fds),
        ]
        # A session of its own: a Ctrl-C meant for the run does not reach it (the run stops it).
        self._switch = subprocess.Popen(
            argv, pass_fds=self._fds, stdin=subprocess.PIPE, text=True, start_new_session=True
        )

    def set_delay(self, node_a: int, node_b: int, latency_ms: float | None) -> None:
        """Frames between nodes ``node_a`` and ``node_b`` held ``latency_ms`` (both ways) instead
        of the fabric's latency; None: the fabric's again."""
        assert self._switch is not None and self._switch.stdin is not None, "finish() first"
        a, b = self._fds[node_a + 1], self._fds[node_b + 1]  # the host's link is the first port
        self._switch.stdin.write(f"{a} {b} {-1 if latency_ms is None else latency_ms}\n")
        self._switch.stdin.flush()

    def close(self) -> None:
        if self._switch is not None:
            self._switch.kill()
            if self._switch.stdin is not None:
                self._switch.stdin.close()
            self._switch.wait()
        for fd in self._fds:
            os.close(fd)
        self._fds.clear()
