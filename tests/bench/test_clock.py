"""The replay clocks: virtual time is a function of reads and sleeps only."""

from __future__ import annotations

import math

import pytest

from bench.systems.clock import TickClock, WallClock, time_left


def test_tick_clock_advances_per_read_and_by_each_sleep():
    clock = TickClock(0.25)
    assert [clock.now(), clock.now()] == [0.25, 0.5]
    clock.sleep(2.0)
    clock.sleep(-1.0)  # a deadline already past does not move time back
    assert clock.now() == 2.75


def test_tick_clock_needs_a_positive_tick():
    with pytest.raises(ValueError, match="tick_s"):
        TickClock(0)


def test_wall_clock_never_goes_back():
    clock = WallClock()
    first = clock.now()
    clock.sleep(0)
    assert clock.now() >= first


def test_time_left_is_an_asyncio_timeout():
    assert time_left(10.0, 4.0) == 6.0
    assert time_left(10.0, 12.0) == 0.0
    assert time_left(math.inf, 12.0) is None
