"""A client that disconnects cancels its work at once, not at the next token.

uvicorn's ``receive()`` answers ``http.disconnect`` as soon as the connection drops, so waiting
on it beside the work tells us; the work is then cancelled (which cancels the worker requests
and frees their pages), and a stream's body iterator is closed.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from typing import TypeVar

from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

T = TypeVar("T")


class ClientDisconnected(Exception):
    """The client went away before its answer was ready."""


async def _disconnected(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def unless_disconnected(receive: Receive, work: Awaitable[T]) -> T:
    """``work``'s result; cancelled, and :class:`ClientDisconnected` raised, if the client leaves first."""
    task = asyncio.ensure_future(work)
    watch = asyncio.create_task(_disconnected(receive))
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not task.done():
            task.cancel()
        await asyncio.gather(task, watch, return_exceptions=True)
    if task.cancelled():
        raise ClientDisconnected()
    return task.result()


class EventStreamResponse(StreamingResponse):
    """Server-sent events, stopped and closed the moment the client disconnects.

    ``on_close`` runs however the response ends, even if the stream never started: it releases
    what the events would have been read from.
    """

    media_type = "text/event-stream"

    def __init__(self, content, on_close: Callable[[], Awaitable[None]]) -> None:
        super().__init__(content, headers={"cache-control": "no-cache", "x-accel-buffering": "no"})
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        stream = asyncio.create_task(self.stream_response(send))
        watch = asyncio.create_task(_disconnected(receive))
        try:
            await asyncio.wait({stream, watch}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            stream.cancel()
            watch.cancel()
            await asyncio.gather(stream, watch, return_exceptions=True)
            with contextlib.suppress(Exception):
                await self.body_iterator.aclose()  # type: ignore[attr-defined]
            await self._on_close()
        if not stream.cancelled() and isinstance(stream.exception(), Exception):
            error = stream.exception()
            if not isinstance(error, OSError):  # OSError: the client went away mid-write
                raise error
