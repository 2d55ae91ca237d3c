"""A TCP link between a client and a server on loopback that behaves like a network: it delays
every byte by a fixed one-way latency, and it can be cut (a partition: nothing gets through, no
connection is refused or reset) and healed.

Loopback answers in microseconds and refuses a dead port at once, so settings that only work on
loopback pass every test there; put this link in front of the server to see them fail.
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass, field


@dataclass
class TcpLink:
    """Forwards ``127.0.0.1:<port>`` to ``upstream`` (``host:port``) in the running event loop."""

    upstream: str
    one_way_delay_s: float = 0.0
    """Every chunk is forwarded this long after it arrived, in order, both ways."""
    _server: asyncio.Server | None = field(default=None, init=False, repr=False)
    _pipes: set[asyncio.Task[None]] = field(default_factory=set, init=False, repr=False)
    _writers: set[asyncio.StreamWriter] = field(default_factory=set, init=False, repr=False)
    _cut: asyncio.Event = field(default_factory=asyncio.Event, init=False, repr=False)
    connections: int = 0
    """Connections accepted so far."""

    @property
    def address(self) -> str:
        """``host:port`` clients dial instead of ``upstream``."""
        assert self._server is not None, "start() the link first"
        host, port = self._server.sockets[0].getsockname()[:2]
        return f"{host}:{port}"

    async def start(self) -> TcpLink:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        return self

    def cut(self) -> None:
        """A partition: every connection open now stops forwarding and is dropped without a reset
        reaching either side in time to matter (the peers find out by their own timeouts), and new
        connections are accepted but never forwarded."""
        self._cut.set()

    def heal(self) -> None:
        """Forward new connections again (those open during the cut stay dead, as after a real
        partition their peers have given up on)."""
        self._cut = asyncio.Event()

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        for pipe in list(self._pipes):
            pipe.cancel()
        await asyncio.gather(*self._pipes, return_exceptions=True)
        for writer in list(self._writers):
            writer.close()

    async def _accept(self, client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        self._writers.add(client_writer)
        cut = self._cut
        if cut.is_set():
            return  # accepted, never forwarded: the client waits for an answer that never comes
        host, port = self.upstream.rsplit(":", 1)
        try:
            server_reader, server_writer = await asyncio.open_connection(host, int(port))
        except OSError:
            client_writer.close()
            return
        self._writers.add(server_writer)
        for reader, writer in ((client_reader, server_writer), (server_reader, client_writer)):
            pipe = asyncio.get_running_loop().create_task(self._pipe(reader, writer, cut))
            self._pipes.add(pipe)
            pipe.add_done_callback(self._pipes.discard)

    async def _pipe(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, cut: asyncio.Event
    ) -> None:
        """Forward one direction, each chunk ``one_way_delay_s`` after it arrived; a cut stops it
        silently (what was in flight is lost, as on a partitioned network)."""
        loop = asyncio.get_running_loop()
        chunks: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()

        async def read() -> None:
            while data := await reader.read(65536):
                chunks.put_nowait((loop.time() + self.one_way_delay_s, data))
            chunks.put_nowait((loop.time() + self.one_way_delay_s, b""))

        reading = loop.create_task(read())
        try:
            while True:
                due, data = await chunks.get()
                await asyncio.sleep(max(0.0, due - loop.time()))
                if cut.is_set():
                    await asyncio.Event().wait()  # silent until the link closes: a partition
                if not data:
                    if writer.can_write_eof():
                        writer.write_eof()
                    return
                writer.write(data)
                await writer.drain()
        except (ConnectionError, OSError):
            writer.close()
        finally:
            reading.cancel()
            with contextlib.suppress(asyncio.CancelledError, ConnectionError, OSError):
                await reading
