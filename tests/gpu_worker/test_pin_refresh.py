"""The worker's pin refresh: the store's whole pinned set becomes the loader's, and a store out of
reach leaves the last set in force (a fake source and loader; the loop is stepped by events)."""

from __future__ import annotations

import asyncio

import pytest

from services.gpu_worker.pin_refresh import refresh_pins
from services.runtime.errors import Unavailable


class Source:
    """Answers each ``pinned_ids`` call with the next of ``answers`` (an exception is raised)."""

    def __init__(self, *answers):
        self.answers = list(answers)
        self.done = asyncio.Event()

    async def pinned_ids(self) -> frozenset[str]:
        answer = self.answers.pop(0)
        if not self.answers:
            self.done.set()
            await asyncio.Event().wait()  # the last answer is never given: the test stops here
        if isinstance(answer, Exception):
            raise answer
        return answer


class Loader:
    def __init__(self):
        self.sets: list[frozenset[str]] = []

    def set_pinned(self, adapter_ids) -> None:
        self.sets.append(frozenset(adapter_ids))


async def test_each_read_set_is_applied_and_a_failed_read_changes_nothing(caplog):
    source = Source(frozenset({"a"}), Unavailable("adapter store: UNAVAILABLE"), frozenset({"b"}), None)
    loader = Loader()
    task = asyncio.create_task(refresh_pins(source, loader, interval_s=0))
    await source.done.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert loader.sets == [{"a"}, {"b"}]
    assert "the last set stays in force" in caplog.text
