"""Waiting for a condition in tests: poll until it holds, bounded only by a hang guard."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import TypeVar

T = TypeVar("T")

HANG_GUARD_S = 120.0
"""Not a timing claim: only turns a broken build into a named failure instead of a hang. Large,
so that a slow start on a busy machine never reaches it (docs/testing.md)."""


async def poll_until(
    fetch: Callable[[], Awaitable[T]],
    predicate: Callable[[T], bool],
    what: str,
    guard_s: float = HANG_GUARD_S,
    interval_s: float = 0.05,
) -> T:
    """Call ``fetch`` until ``predicate`` holds of its value and return that value; after
    ``guard_s`` fail with ``what`` and the last value."""
    value: T | None = None
    try:
        async with asyncio.timeout(guard_s):
            while not predicate(value := await fetch()):
                await asyncio.sleep(interval_s)
    except TimeoutError:
        raise AssertionError(f"{what}: not true after {guard_s:.0f} s; last value {value!r}") from None
    return value
