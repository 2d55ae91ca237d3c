"""Stopping background tasks so that a stop always ends.

Python 3.11's ``asyncio.wait_for`` can swallow a cancellation that arrives just as the awaited
call completes (CPython gh-86296, fixed in 3.12): a ``while True`` loop of bounded etcd calls
then carries on after ``task.cancel()``, and awaiting it hangs forever. :func:`cancel_and_wait`
cancels again until the task has really ended.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable

log = logging.getLogger("loramesh.tasks")

RECANCEL_PERIOD_S = 1.0
"""How long to wait for a cancelled task before cancelling it again (not a deadline: the wait
ends only when the task does)."""


async def cancel_and_wait(tasks: Iterable[asyncio.Task | None]) -> None:
    """Cancel ``tasks`` (None entries are skipped) and return once every one has ended; an
    error a task ended with is logged, not raised."""
    tasks = [task for task in tasks if task is not None]
    pending = {task for task in tasks if not task.done()}
    for task in pending:
        task.cancel()
    while pending:
        _, pending = await asyncio.wait(pending, timeout=RECANCEL_PERIOD_S)
        for task in pending:  # a cancellation swallowed by wait_for: ask again
            task.cancel()
    for task in tasks:
        if not task.cancelled() and task.exception() is not None:
            log.warning("task %s ended with %r", task.get_name(), task.exception())
