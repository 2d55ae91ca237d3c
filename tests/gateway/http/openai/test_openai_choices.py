"""The choices of one request: refusals before the response starts, every generation closed
however the request ends (which is what cancels worker requests), deltas merged in order."""

from __future__ import annotations

import asyncio
import contextlib

import pytest

from mesh_api.v1 import gateway_pb2, types_pb2
from services.gateway.http.choices import close_choices, merged, start_choices
from services.runtime.errors import ResourceExhausted

Reply = gateway_pb2.GenerateTextResponse


class Generation:
    """A fake core generation: the given texts, then a finish; records whether it was closed."""

    def __init__(self, texts: list[str], fail: Exception | None = None, hold: asyncio.Event | None = None):
        self.texts, self.fail, self.hold = texts, fail, hold
        self.closed = False

    async def replies(self):
        try:
            if self.fail is not None:
                raise self.fail
            for i, text in enumerate(self.texts):
                if self.hold is not None and i > 0:
                    await self.hold.wait()
                last = i == len(self.texts) - 1
                yield Reply(text=text, finish_reason=types_pb2.FINISH_REASON_LENGTH if last else 0)
        finally:
            self.closed = True


async def test_a_refusal_is_raised_and_every_other_generation_is_closed():
    never = asyncio.Event()
    fakes = [Generation(["a"], hold=never), Generation([], fail=ResourceExhausted("every queue is full"))]
    slow = Generation(["x", "y"], hold=never)
    with pytest.raises(ResourceExhausted, match="queue"):
        await start_choices([f.replies() for f in [*fakes, slow]])
    assert all(f.closed for f in [*fakes, slow])


async def test_merged_keeps_each_choice_in_order_and_closes_all():
    fakes = [Generation(["a", "b", "c"]), Generation(["x", "y"])]
    choices = await start_choices([f.replies() for f in fakes])
    seen: dict[int, list[str]] = {0: [], 1: []}
    async with contextlib.aclosing(merged(choices)) as replies:
        async for index, reply in replies:
            seen[index].append(reply.text)
    assert seen == {0: ["a", "b", "c"], 1: ["x", "y"]}
    assert all(f.closed for f in fakes)


@pytest.mark.parametrize("count", [1, 3])
async def test_a_reader_that_stops_early_closes_every_generation(count):
    never = asyncio.Event()
    fakes = [Generation(["first", "never sent"], hold=never) for _ in range(count)]
    choices = await start_choices([f.replies() for f in fakes])
    async with contextlib.aclosing(merged(choices)) as replies:
        assert (await anext(replies))[1].text == "first"
    assert all(f.closed for f in fakes)


async def test_choices_never_read_are_closed_by_close_choices():
    never = asyncio.Event()
    fakes = [Generation(["first", "never sent"], hold=never) for _ in range(2)]
    choices = await start_choices([f.replies() for f in fakes])
    await close_choices(choices)
    assert all(f.closed for f in fakes)
