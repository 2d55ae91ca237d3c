"""A TCP proxy that delays every byte by a one-way delay, in each direction: the nemesis's
latency between nodes (this kernel has no netem qdisc; loss is nftables' job, not this one's).

Each chunk read at time t is written at t + delay, in order, so a stream keeps its throughput: the
delay is a pipeline, never paid once per chunk. A connection's two directions are independent,
so half-close (one side's EOF, forwarded after the delay) and long-lived HTTP/2 (gRPC) streams
pass as they are. The delay can change at any time (``proxy.delay_s = ...``); a chunk already
held leaves at its arrival plus the delay in force when it is due.

Backpressure: each direction holds at most ``max_buffered_bytes``; past that it stops reading
(TCP pushes back on the sender), so one connection moves at most that many bytes per delay.

Timers: asyncio sleeps in whole milliseconds (epoll's resolution), so a delay under 1 ms adds
up to about 1 ms per direction; docs/benchmarks.md "Delaying proxy" measures it.

``python -m bench.cluster.delay_proxy --route LISTEN=TARGET ... --delay-ms D`` runs proxies in
a process of their own (e.g. in a pod's network namespace); each line ``delay_ms D`` on its
stdin sets every route's delay.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import sys
import threading
from collections import deque
from dataclasses import dataclass
from typing import Self

log = logging.getLogger("loramesh.bench.delay_proxy")


@dataclass(frozen=True)
class ProxyConfig:
    """How a proxy moves bytes."""

    max_buffered_bytes: int = 16 << 20
    """Most bytes one direction of one connection holds while delaying them."""
    read_bytes: int = 64 << 10
    """Most bytes read at once (one chunk)."""


class DelayProxy:
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
        self._server: asyncio.Server | None = None
        self._closing = False
        self._connections: set[asyncio.Task] = set()

    @property
    def delay_s(self) -> float:
        """One-way delay added to each direction (seconds)."""
        return self._delay_s

    @delay_s.setter
    def delay_s(self, value: float) -> None:
        if not value >= 0.0:
            raise ValueError(f"a delay must be 0 or more seconds, got {value}")
        self._delay_s = float(value)

    @property
    def connections(self) -> int:
        """Client connections open now."""
        return len(self._connections)

    @property
    def address(self) -> tuple[str, int]:
        """Where it listens (the port chosen when ``listen`` asked for 0)."""
        if self._server is None:
            raise RuntimeError("the proxy is not started")
        return self._server.sockets[0].getsockname()[:2]

    async def start(self) -> DelayProxy:
        self._server = await asyncio.start_server(self._serve, *self.listen, limit=self.config.read_bytes)
        return self

    async def close(self) -> None:
        """Stop listening and drop every connection (both sides reset)."""
        self._closing = True
        if self._server is not None:
            self._server.close()
        for task in list(self._connections):
            task.cancel()
        await asyncio.gather(*self._connections, return_exceptions=True)
        if self._server is not None:
            await self._server.wait_closed()

    async def __aenter__(self) -> Self:
        return await self.start()

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def _serve(self, client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        self._connections.add(task)
        try:
            await self._relay(client_reader, client_writer)
        except asyncio.CancelledError:
            # close() cancels the connections; asyncio logs a handler that ends cancelled.
            if not self._closing:
                raise
        finally:
            self._connections.discard(task)

    async def _relay(self, client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter) -> None:
        target_writer = None
        ended = False
        try:
            target_reader, target_writer = await asyncio.open_connection(
                *self.target, limit=self.config.read_bytes
            )
            async with asyncio.TaskGroup() as both:
                both.create_task(self._pipe(client_reader, target_writer))
                both.create_task(self._pipe(target_reader, client_writer))
            ended = True
        except* OSError as errors:
            log.debug("proxy connection to %s:%s failed: %r", *self.target, errors.exceptions)
        finally:
            if not ended:
                # A reset (or a target refusing) on one side is a reset on the other.
                _abort(client_writer, target_writer)
            for writer in (client_writer, target_writer):
                if writer is not None:
                    writer.close()

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """Forward ``reader`` to ``writer``, each chunk at its arrival + the delay, then its EOF."""
        loop = asyncio.get_running_loop()
        held: deque[tuple[float, bytes]] = deque()
        arrived, room = asyncio.Event(), asyncio.Event()
        buffered = 0

        async def receive() -> None:
            nonlocal buffered
            while True:
                while buffered >= self.config.max_buffered_bytes:
                    room.clear()
                    await room.wait()
                data = await reader.read(self.config.read_bytes)
                held.append((loop.time(), data))
                buffered += len(data)
                arrived.set()
                if not data:
                    return

        async def send() -> None:
            nonlocal buffered
            while True:
                while not held:
                    arrived.clear()
                    await arrived.wait()
                at, data = held[0]
                # Sleep until due, re-reading the delay: it may change while a chunk waits.
                while (wait := at + self._delay_s - loop.time()) > 0:
                    await asyncio.sleep(wait)
                held.popleft()
                if not data:
                    if writer.can_write_eof():
                        writer.write_eof()
                    return
                writer.write(data)
                buffered -= len(data)
                room.set()
                await writer.drain()

        async with asyncio.TaskGroup() as pipe:
            pipe.create_task(receive())
            pipe.create_task(send())


def _abort(*writers: asyncio.StreamWriter | None) -> None:
    for writer in writers:
        if writer is not None:
            writer.transport.abort()


def parse_address(text: str) -> tuple[str, int]:
    """``host:port`` (``[v6]:port`` too) -> (host, port), with a clear error."""
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit() or not host:
        raise ValueError(f"expected host:port, got {text!r}")
    return host.strip("[]"), int(port)


def _read_control(proxies: list[DelayProxy], loop: asyncio.AbstractEventLoop) -> None:
    """Stdin lines ``delay_ms D`` (in a thread: stdin may be a file, a pipe or a terminal)."""
    for line in sys.stdin:
        words = line.split()
        if len(words) == 2 and words[0] == "delay_ms":
            try:
                delay_s = float(words[1]) / 1000.0
                if not delay_s >= 0.0:
                    raise ValueError
            except ValueError:
                print(
                    f"bad delay in {line.strip()!r}: expected delay_ms <milliseconds >= 0>", file=sys.stderr
                )
                continue
            loop.call_soon_threadsafe(_set_delay, proxies, delay_s)
        elif words:
            print(f"unknown command {line.strip()!r}: expected delay_ms <milliseconds>", file=sys.stderr)


def _set_delay(proxies: list[DelayProxy], delay_s: float) -> None:
    for proxy in proxies:
        proxy.delay_s = delay_s
    print(f"delay_ms {delay_s * 1000.0:g}", flush=True)


async def _main(args: argparse.Namespace) -> None:
    proxies = []
    for route in args.route:
        listen, sep, target = route.partition("=")
        if not sep:
            raise SystemExit(f"--route wants LISTEN=TARGET (host:port=host:port), got {route!r}")
        proxy = DelayProxy(parse_address(target), args.delay_ms / 1000.0, parse_address(listen))
        proxies.append(await proxy.start())
        print("listening {}:{} -> {}:{}".format(*proxy.address, *proxy.target), flush=True)
    loop = asyncio.get_running_loop()
    threading.Thread(target=_read_control, args=(proxies, loop), daemon=True).start()
    with contextlib.suppress(asyncio.CancelledError):
        await asyncio.Event().wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--route", action="append", required=True, help="LISTEN=TARGET, each host:port (repeatable)"
    )
    parser.add_argument("--delay-ms", type=float, default=0.0, help="one-way delay of each direction")
    args = parser.parse_args()
    if args.delay_ms < 0:
        parser.error(f"--delay-ms must be 0 or more, got {args.delay_ms}")
    asyncio.run(_main(args))


if __name__ == "__main__":
    main()
