"""Which cached item goes first when a cache needs room: one interface for every cache of the mesh.

The shape is SGLang's ``eviction_policy.py``: the cache tells its policy when an item is used
(:meth:`EvictionPolicy.touch`) and when it leaves (:meth:`EvictionPolicy.remove`), and asks it for
victims in eviction order among the items it may drop now (:meth:`EvictionPolicy.victims`).
The cache keeps the items and decides which may go (an adapter with running requests may not);
the policy only orders them. Pure: no torch, no gRPC, no clock (order of use is enough).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterable, Iterator
from typing import Protocol


class EvictionPolicy(Protocol):
    """The eviction order of a cache's items (keys)."""

    name: str

    def touch(self, key: Hashable) -> None:
        """``key`` was used (or added): the policy's order changes as it defines use."""

    def remove(self, key: Hashable) -> None:
        """``key`` left the cache (evicted or dropped); unknown keys are ignored."""

    def victims(self, candidates: Iterable[Hashable]) -> Iterator[Hashable]:
        """The ``candidates`` (keys the cache may drop now) in eviction order, first victim
        first; lazily, so the cache stops asking once it has room."""

    def order(self) -> list[Hashable]:
        """Every tracked key, first victim first."""


class _OrderedEviction:
    """Keys in one order, the first victim first; subclasses say what a touch does to it."""

    name = ""

    def __init__(self) -> None:
        self._order: OrderedDict[Hashable, None] = OrderedDict()

    def touch(self, key: Hashable) -> None:
        raise NotImplementedError

    def remove(self, key: Hashable) -> None:
        self._order.pop(key, None)

    def victims(self, candidates: Iterable[Hashable]) -> Iterator[Hashable]:
        allowed = set(candidates)
        # A snapshot: the cache evicts (removes) keys while it walks the victims.
        return (key for key in list(self._order) if key in allowed)

    def order(self) -> list[Hashable]:
        return list(self._order)


class LRUEviction(_OrderedEviction):
    """Least recently used first: every touch moves a key to the back."""

    name = "lru"

    def touch(self, key: Hashable) -> None:
        self._order[key] = None
        self._order.move_to_end(key)


class FIFOEviction(_OrderedEviction):
    """First added first: a key keeps the place of its first touch until it is removed."""

    name = "fifo"

    def touch(self, key: Hashable) -> None:
        self._order.setdefault(key, None)


EVICTION_POLICIES: dict[str, Callable[[], EvictionPolicy]] = {
    LRUEviction.name: LRUEviction,
    FIFOEviction.name: FIFOEviction,
}
"""Eviction policy name -> a fresh policy."""


def make_eviction_policy(name: str) -> EvictionPolicy:
    """A fresh eviction policy by name; ValueError naming the known ones otherwise."""
    try:
        return EVICTION_POLICIES[name]()
    except KeyError:
        known = ", ".join(sorted(EVICTION_POLICIES))
        raise ValueError(f"unknown eviction policy {name!r}; known: {known}") from None
