"""A mapping that keeps only its most recently used keys: the least recently used leaves first
when a new one would pass its size. For the small caches of values rebuilt at will (a step's LoRA
segments, drafting indexes); caches with pins and a choice of order use :mod:`.eviction`."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


class RecentlyUsed(Generic[K, V]):
    """At most ``size`` values, by key."""

    def __init__(self, size: int):
        if size < 1:
            raise ValueError(f"size must be at least 1, got {size}")
        self._size = size
        self._values: OrderedDict[K, V] = OrderedDict()

    def get(self, key: K) -> V | None:
        """The value of ``key`` if it is kept (marked recently used)."""
        value = self._values.get(key)
        if value is not None:
            self._values.move_to_end(key)
        return value

    def put(self, key: K, value: V) -> V:
        """Keep ``value`` under ``key`` as the most recently used; returns it."""
        self._values[key] = value
        self._values.move_to_end(key)
        while len(self._values) > self._size:
            self._values.popitem(last=False)
        return value

    def drop(self, leaves: Callable[[K], bool]) -> None:
        """Drop every key ``leaves`` says goes."""
        for key in [key for key in self._values if leaves(key)]:
            del self._values[key]

    def keys(self) -> list[K]:
        """Every kept key, the least recently used first."""
        return list(self._values)
