"""A TCP proxy that delays every byte by a one-way delay, precise below a millisecond: the
latency of a link between nodes at 0.2 or 1 ms, which ``delay_proxy.py`` cannot model (asyncio
sleeps in whole milliseconds, so it adds ~2.4 ms of round trip at any delay under 1 ms;
docs/benchmarks.md, "Delaying proxy").

Why threads and not a delay inside the lending transport: the proxy delays the real bytes of the
real connection (gRPC's HTTP/2 frames, its pings and window updates too), with no hook in the
product, and the same proxy fronts any service. Each direction of a connection has a reader
thread, which stamps every chunk with its arrival time, and a writer thread, which sleeps until
that time + the delay with ``clock_nanosleep`` and a timer slack of 1 ns (``prctl``; Linux lets
a sleep end up to 50 µs late by default), then spins the last :attr:`ProxyConfig.spin_s` on the
clock. Chunks are released in order, so a stream keeps its throughput: the delay is a pipeline,
never paid once per chunk. Both threads block in system calls with the GIL released, and the
process's GIL switch interval is short (:func:`main`), so one direction rarely waits on another.

Same interface as ``delay_proxy.py``: ``python -m bench.cluster.thread_delay_proxy --route
LISTEN=TARGET ... --delay-ms D``; each line ``delay_ms D`` on its stdin sets every route's delay
and is acknowledged on stdout. ``bench.cluster.thread_delay_proxy_bench`` measures what it adds.
"""

from __future__ import annotations

import argparse
import ctypes
import logging
import os
import socket
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Self

from bench.cluster.delay_proxy import DelayProxy, parse_address

log = logging.getLogger("loramesh.bench.thread_delay_proxy")

_PR_SET_TIMERSLACK = 29


@dataclass(frozen=True)
class ProxyConfig:
    """How a proxy moves bytes."""

    max_buffered_bytes: int = 16 << 20
    """Most bytes one direction of one connection holds while delaying them; past that its reader
    stops reading (TCP pushes back on the sender)."""
    read_bytes: int = 256 << 10
    """Most bytes read at once (one chunk)."""
    spin_s: float = 50e-6
    """The last part of each wait spent polling the clock instead of asleep: a woken thread can
    be late by the kernel's wake-up latency, a spin is not."""
    realtime_priority: int = 1
    """``SCHED_FIFO`` priority of the threads that move bytes (0: the normal scheduler). A kernel
    delivers packets ahead of every process; a proxy thread of the normal scheduler woken on a
    loaded machine waits its turn behind them (at a load average of 13 on 2 cores its added
    round trip at 0.2 ms was 1–2 ms at the median). Needs root or CAP_SYS_NICE, else the
    normal scheduler is kept."""


def _precise_timers() -> None:
    """This thread's sleeps end when asked (the default timer slack lets them end 50 µs late)."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_TIMERSLACK, 1, 0, 0, 0)
    except (OSError, AttributeError):  # not Linux: sleeps are as precise as the platform's
        pass


def _realtime(priority: int) -> None:
    """This thread under ``SCHED_FIFO`` at ``priority`` where allowed (0: left as it is)."""
    if priority:
        try:
            os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(priority))
        except (OSError, AttributeError):  # not root, or not Linux
            pass


def _sleep_until(due: float, spin_s: float) -> None:
    while (wait := due - time.monotonic()) > 0:
        if wait > spin_s:
            time.sleep(wait - spin_s)


class _Direction:
    """One direction of a connection: bytes read from ``source`` written to ``sink``, each chunk
    at its arrival + the proxy's delay; the source's EOF forwarded the same way (half-close)."""

    def __init__(self, proxy: ThreadDelayProxy, source: socket.socket, sink: socket.socket, ended):
        self.proxy = proxy
        self.source = source
        self.sink = sink
        self._ended = ended
        self._held: deque[tuple[float, bytes]] = deque()
        self._buffered = 0
        self._change = threading.Condition()
        self._broken = False

    def start(self) -> None:
        threading.Thread(target=self._receive, name="delay-read", daemon=True).start()
        threading.Thread(target=self._send, name="delay-write", daemon=True).start()

    def break_off(self) -> None:
        with self._change:
            self._broken = True
            self._change.notify_all()

    def _receive(self) -> None:
        _realtime(self.proxy.config.realtime_priority)
        limit = self.proxy.config.max_buffered_bytes
        try:
            while True:
                with self._change:
                    while self._buffered >= limit and not self._broken:
                        self._change.wait()
                    if self._broken:
                        return
                data = self.source.recv(self.proxy.config.read_bytes)
                arrived = time.monotonic()
                with self._change:
                    self._held.append((arrived, data))
                    self._buffered += len(data)
                    self._change.notify_all()
                if not data:
                    return
        except OSError:
            self._ended(broken=True)

    def _send(self) -> None:
        _realtime(self.proxy.config.realtime_priority)
        _precise_timers()
        spin_s = self.proxy.config.spin_s
        try:
            while True:
                with self._change:
                    while not self._held and not self._broken:
                        self._change.wait()
                    if self._broken:
                        return
                    arrived, _ = self._held[0]
                # Re-read the delay after each sleep: it may change while a chunk waits.
                while (due := arrived + self.proxy.delay_s) > time.monotonic():
                    _sleep_until(due, spin_s)
                with self._change:
                    _, data = self._held.popleft()
                    self._buffered -= len(data)
                    self._change.notify_all()
                if not data:
                    self.sink.shutdown(socket.SHUT_WR)
                    self._ended(broken=False)
                    return
                self.sink.sendall(data)
        except OSError:
            self._ended(broken=True)


class _Connection:
    """A client and its target, both directions delayed; a reset on one side resets the other."""

    def __init__(self, proxy: ThreadDelayProxy, client: socket.socket, target: socket.socket):
        self.proxy = proxy
        self.sockets = (client, target)
        self._lock = threading.Lock()
        self._open_directions = 2
        self._closed = False
        self.directions = (
            _Direction(proxy, client, target, self._direction_ended),
            _Direction(proxy, target, client, self._direction_ended),
        )

    def start(self) -> None:
        for direction in self.directions:
            direction.start()

    def _direction_ended(self, broken: bool) -> None:
        with self._lock:
            self._open_directions -= 1
            done = broken or self._open_directions == 0
        if done:
            self.close(abort=broken)

    def close(self, abort: bool = True) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        for direction in self.directions:
            direction.break_off()
        for sock in self.sockets:
            if abort:  # a reset, as the peer would see a dead link's end
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            sock.close()
        self.proxy._forget(self)


class ThreadDelayProxy:
    """Accepts on ``listen``, connects each client to ``target`` and delays both directions."""

    def __init__(
        self,
        target: tuple[str, int],
        delay_s: float = 0.0,
        listen: tuple[str, int] = ("127.0.0.1", 0),
        config: ProxyConfig = ProxyConfig(),
    ):
        self.target = target
        self.listen = listen
        self.config = config
        self.delay_s = delay_s
        self._listener: socket.socket | None = None
        self._connections: set[_Connection] = set()
        self._lock = threading.Lock()

    delay_s = DelayProxy.delay_s
    """One-way delay added to each direction (seconds; settable at any time, 0 or more): the
    asyncio proxy's property, checked the same way."""

    @property
    def address(self) -> tuple[str, int]:
        """Where it listens (the port chosen when ``listen`` asked for 0)."""
        if self._listener is None:
            raise RuntimeError("the proxy is not started")
        return self._listener.getsockname()[:2]

    @property
    def connections(self) -> int:
        """Client connections open now."""
        return len(self._connections)

    def start(self) -> ThreadDelayProxy:
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(self.listen)
        listener.listen(128)
        self._listener = listener
        threading.Thread(target=self._accept, name="delay-accept", daemon=True).start()
        return self

    def close(self) -> None:
        """Stop listening and reset every connection."""
        if self._listener is not None:
            try:
                self._listener.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            self._listener.close()
        with self._lock:
            connections = list(self._connections)
        for connection in connections:
            connection.close()

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()

    async def __aenter__(self) -> Self:
        """As ``delay_proxy.DelayProxy`` is used (``async with``): the threads run on their own."""
        return self.start()

    async def __aexit__(self, *exc) -> None:
        self.close()

    def _forget(self, connection: _Connection) -> None:
        with self._lock:
            self._connections.discard(connection)

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return  # closed
            try:
                target = socket.create_connection(self.target)
            except OSError as error:
                log.debug("proxy connection to %s:%s failed: %r", *self.target, error)
                client.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
                client.close()
                continue
            for sock in (client, target):
                # Each chunk leaves when due, not when Nagle's algorithm lets it.
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            connection = _Connection(self, client, target)
            with self._lock:
                self._connections.add(connection)
            connection.start()


def _read_control(proxies: list[ThreadDelayProxy]) -> None:
    """Stdin lines ``delay_ms D``, each acknowledged once in force."""
    for line in sys.stdin:
        words = line.split()
        try:
            if len(words) != 2 or words[0] != "delay_ms":
                raise ValueError
            delay_s = float(words[1]) / 1000.0
            for proxy in proxies:
                proxy.delay_s = delay_s
        except ValueError:
            print(f"bad command {line.strip()!r}: expected delay_ms <milliseconds >= 0>", file=sys.stderr)
            continue
        print(f"delay_ms {delay_s * 1000.0:g}", flush=True)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--route", action="append", required=True, help="LISTEN=TARGET, each host:port (repeatable)"
    )
    parser.add_argument("--delay-ms", type=float, default=0.0, help="one-way delay of each direction")
    args = parser.parse_args(argv)
    if not args.delay_ms >= 0:
        parser.error(f"--delay-ms must be 0 or more, got {args.delay_ms}")
    # A thread woken to send waits at most this long for the GIL (5 ms by default).
    sys.setswitchinterval(50e-6)
    proxies = []
    for route in args.route:
        listen, sep, target = route.partition("=")
        if not sep:
            parser.error(f"--route wants LISTEN=TARGET (host:port=host:port), got {route!r}")
        proxy = ThreadDelayProxy(parse_address(target), args.delay_ms / 1000.0, parse_address(listen))
        proxies.append(proxy.start())
        print("listening {}:{} -> {}:{}".format(*proxy.address, *proxy.target), flush=True)
    _read_control(proxies)


if __name__ == "__main__":
    main()
