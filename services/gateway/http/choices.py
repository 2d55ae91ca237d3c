"""The choices of one OpenAI request (``n`` per prompt), each one generation of the core.

:func:`start_choices` starts them all and waits for each one's first delta, so every refusal
(limits, adapter access, placement) surfaces before the HTTP response begins and gets its own
status. :func:`merged` then interleaves the rest as they come. Closing either cancels every
generation, which cancels the worker requests and frees their pages.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass

from mesh_api.v1 import gateway_pb2

Reply = gateway_pb2.GenerateTextResponse


@dataclass
class StartedChoice:
    """A generation whose first delta has arrived."""

    index: int
    first: Reply
    rest: AsyncIterator[Reply]

    async def replies(self) -> AsyncIterator[Reply]:
        yield self.first
        if not self.first.finish_reason:
            async for reply in self.rest:
                yield reply


async def _close_all(generations: list[AsyncIterator[Reply]]) -> None:
    for generation in generations:
        with contextlib.suppress(Exception):
            await generation.aclose()  # type: ignore[attr-defined]


async def close_choices(choices: list[StartedChoice]) -> None:
    """Cancel every choice's generation (a no-op for those that ended)."""
    await _close_all([c.rest for c in choices])


async def start_choices(generations: list[AsyncIterator[Reply]]) -> list[StartedChoice]:
    """Each generation's first delta; the first refusal is raised after closing all of them."""
    firsts = [asyncio.ensure_future(anext(g)) for g in generations]
    started = False
    try:
        await asyncio.wait(firsts, return_when=asyncio.FIRST_EXCEPTION)
        for task in firsts:
            if task.done() and task.exception() is not None:
                raise task.exception()  # type: ignore[misc]
        started = True
        return [
            StartedChoice(i, task.result(), generation)
            for i, (task, generation) in enumerate(zip(firsts, generations))
        ]
    finally:
        if not started:  # refused, or the client left: stop the others too
            for task in firsts:
                task.cancel()
            await asyncio.gather(*firsts, return_exceptions=True)
            await _close_all(generations)


async def merged(choices: list[StartedChoice]) -> AsyncIterator[tuple[int, Reply]]:
    """``(choice index, delta)`` from every choice as they come, each choice in order."""
    if len(choices) == 1:  # the common case: no queue hop per token
        try:
            async for reply in choices[0].replies():
                yield 0, reply
        finally:
            await close_choices(choices)
        return
    queue: asyncio.Queue[tuple[int, Reply | None, BaseException | None]] = asyncio.Queue()

    async def pump(choice: StartedChoice) -> None:
        try:
            async for reply in choice.replies():
                await queue.put((choice.index, reply, None))
        except Exception as error:  # noqa: BLE001 - handed to the reader, which raises it
            await queue.put((choice.index, None, error))
            return
        await queue.put((choice.index, None, None))

    tasks = [asyncio.create_task(pump(c)) for c in choices]
    try:
        running = len(tasks)
        while running:
            index, reply, error = await queue.get()
            if error is not None:
                raise error
            if reply is None:
                running -= 1
            else:
                yield index, reply
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await close_choices(choices)
