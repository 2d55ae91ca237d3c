"""The clock a benchmark replay runs on: the wall clock in benchmarks, a deterministic one in tests.

A replay reads the time to decide when requests arrive, when the window closes and what to
record. On the wall clock the answer depends on how fast the machine is; tests that check what
happens at the window (who finished, who was cut off) use :class:`TickClock`, whose time moves
only when it is read or slept on, so the same code path always sees the same times.
"""

from __future__ import annotations

import time
from typing import Protocol


class Clock(Protocol):
    """Monotonic seconds and a way to wait for them."""

    def now(self) -> float:
        """Seconds since an arbitrary origin; never decreases."""
        ...

    def sleep(self, seconds: float) -> None:
        """Block until ``now()`` has advanced by at least ``seconds`` (no-op when ≤ 0)."""
        ...


class WallClock:
    """Real time: ``time.monotonic`` and ``time.sleep``."""

    def now(self) -> float:
        return time.monotonic()

    def sleep(self, seconds: float) -> None:
        if seconds > 0:
            time.sleep(seconds)


class TickClock:
    """Virtual time that advances by ``tick_s`` at every read and by the requested amount at every
    sleep. The times a replay records are then a function of its code path, not of the machine:
    e.g. a decode loop that reads the clock once per step produces at most ``window_s / tick_s``
    steps inside the window."""

    def __init__(self, tick_s: float):
        if tick_s <= 0:
            raise ValueError(f"tick_s must be positive, got {tick_s}")
        self.tick_s = tick_s
        self._now = 0.0

    def now(self) -> float:
        self._now += self.tick_s
        return self._now

    def sleep(self, seconds: float) -> None:
        if seconds > 0:
            self._now += seconds


def time_left(deadline: float, now: float) -> float | None:
    """Seconds from ``now`` to ``deadline`` as an asyncio timeout: never negative, and None (wait
    for ever) when the deadline is infinite, i.e. the run has no window."""
    if deadline == float("inf"):
        return None
    return max(0.0, deadline - now)
