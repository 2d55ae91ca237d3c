"""cancel_and_wait ends a task even when its first cancellation is swallowed, as Python 3.11's
wait_for can do (CPython gh-86296)."""

from __future__ import annotations

import asyncio

from services.runtime.process.tasks import cancel_and_wait


async def test_a_task_that_swallows_a_cancellation_is_cancelled_again_until_it_ends():
    cancellations = 0

    async def stubborn() -> None:
        nonlocal cancellations
        while True:
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                cancellations += 1
                if cancellations == 2:
                    raise
                # the first one is lost, as a wait_for racing a completed call loses it

    task = asyncio.get_running_loop().create_task(stubborn())
    await asyncio.sleep(0)
    await cancel_and_wait([task, None])
    assert task.cancelled() and cancellations == 2


async def test_a_task_that_failed_is_reported_not_raised(caplog):
    async def fails() -> None:
        raise RuntimeError("boom")

    task = asyncio.get_running_loop().create_task(fails(), name="failing")
    await asyncio.sleep(0)
    await cancel_and_wait([task])
    assert "task failing ended with RuntimeError('boom')" in caplog.text
