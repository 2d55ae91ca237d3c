"""Which cached item goes first when a cache needs room: one interface for every cache of the mesh.

The shape is SGLang's ``eviction_policy.py``: the cache tells its policy when an item is used
(:meth:`EvictionPolicy.touch`) and when it leaves (:meth:`EvictionPolicy.remove`), and asks it for
victims in eviction order among the items it may drop now (:meth:`EvictionPolicy.victims`).
The cache keeps the items and decides which may go (an adapter with running requests may not);
the policy only orders them. Pure: no torch, no gRPC, no clock (order of use is enough).

Pins are the policy's too, the same for every order: a pinned key is never a victim, whether or
not the cache holds it now (an adapter may be pinned before it is loaded, and stays pinned when
it leaves). The store's RAM tier, the worker's host cache and its device residency all take a
policy by name (``--eviction-policy``) and pin the adapters the API pinned through it.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterable, Iterator
from typing import Protocol

from services.runtime.choices import choose


class EvictionPolicy(Protocol):
    """The eviction order of a cache's items (keys), and the keys that never go."""

    name: str

    def touch(self, key: Hashable) -> None:
        """``key`` was used (or added): the policy's order changes as it defines use."""

    def remove(self, key: Hashable) -> None:
        """``key`` left the cache (evicted or dropped); unknown keys are ignored. Its pin stays."""

    def victims(self, candidates: Iterable[Hashable]) -> Iterator[Hashable]:
        """The ``candidates`` (keys the cache may drop now) in eviction order, first victim
        first, pinned keys left out; lazily, so the cache stops asking once it has room."""

    def order(self) -> list[Hashable]:
        """Every tracked key, first victim first (pinned ones in their place too)."""

    def pin(self, key: Hashable) -> None:
        """Never offer ``key`` as a victim until :meth:`unpin`, tracked now or not."""

    def unpin(self, key: Hashable) -> None:
        """``key`` may be a victim again (in its place in the order); unknown keys are ignored."""

    def pinned(self) -> frozenset[Hashable]:
        """The keys pinned now."""


class _Pinning:
    """What every policy shares: the pinned keys, left out of :meth:`victims` whatever the order."""

    name = ""

    def __init__(self) -> None:
        self._pinned: set[Hashable] = set()

    def pin(self, key: Hashable) -> None:
        self._pinned.add(key)

    def unpin(self, key: Hashable) -> None:
        self._pinned.discard(key)

    def pinned(self) -> frozenset[Hashable]:
        return frozenset(self._pinned)

    def victims(self, candidates: Iterable[Hashable]) -> Iterator[Hashable]:
        return self._walk({key for key in candidates if key not in self._pinned})

    def _walk(self, allowed: set[Hashable]) -> Iterator[Hashable]:
        """The ``allowed`` keys in eviction order (the cache may remove keys during the walk)."""
        raise NotImplementedError


def set_pins(policy: EvictionPolicy, keys: Iterable[Hashable]) -> None:
    """Make ``keys`` exactly the keys ``policy`` keeps pinned (a cache told the whole pinned set)."""
    wanted = frozenset(keys)
    current = policy.pinned()
    for key in current - wanted:
        policy.unpin(key)
    for key in wanted - current:
        policy.pin(key)


class _OrderedEviction(_Pinning):
    """Keys in one order, the first victim first; subclasses say what a touch does to it."""

    def __init__(self) -> None:
        super().__init__()
        self._order: OrderedDict[Hashable, None] = OrderedDict()

    def touch(self, key: Hashable) -> None:
        raise NotImplementedError

    def remove(self, key: Hashable) -> None:
        self._order.pop(key, None)

    def _walk(self, allowed: set[Hashable]) -> Iterator[Hashable]:
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


class _Bucket:
    """The keys touched ``count`` times, least recently touched first: a link of the ring of
    buckets in ascending count."""

    __slots__ = ("count", "keys", "next", "prev")

    def __init__(self, count: int) -> None:
        self.count = count
        self.keys: OrderedDict[Hashable, None] = OrderedDict()
        self.prev: _Bucket = self
        self.next: _Bucket = self


class LFUEviction(_Pinning):
    """Least frequently used first, ties broken least recently used first.

    A key's count is its touches since it was last added; it starts again at 1 when the key
    leaves and comes back (no aging otherwise). Keys sit in buckets by count, kept in a ring in
    ascending count (the O(1) LFU of Shah, Mitra and Matani, 2010): a touch moves a key to the
    end of the next bucket, so within a bucket keys are in order of their last touch.

    Costs, for n tracked keys: :meth:`touch` and :meth:`remove` O(1); :meth:`victims` O(c) to
    read its c candidates, then lazy: the walk to the k-th victim visits only the buckets up to
    it (each copied as it is reached, so the cache may remove keys while it walks), O(n) at worst
    and no sort; :meth:`order` O(n).
    """

    name = "lfu"

    def __init__(self) -> None:
        super().__init__()
        self._ring = _Bucket(0)
        """Sentinel: before the lowest count and after the highest; holds no key."""
        self._bucket_of: dict[Hashable, _Bucket] = {}

    def touch(self, key: Hashable) -> None:
        bucket = self._bucket_of.get(key, self._ring)
        following = bucket.next
        if following.count != bucket.count + 1:
            following = self._link_after(bucket, bucket.count + 1)
        following.keys[key] = None
        self._bucket_of[key] = following
        if bucket is not self._ring:
            self._drop(bucket, key)

    def remove(self, key: Hashable) -> None:
        bucket = self._bucket_of.pop(key, None)
        if bucket is not None:
            self._drop(bucket, key)

    def _walk(self, allowed: set[Hashable]) -> Iterator[Hashable]:
        bucket = self._ring.next
        while bucket is not self._ring:
            for key in list(bucket.keys):
                # Skips keys removed (or touched on) since the bucket was copied, and never
                # yields a key twice.
                if key in allowed and self._bucket_of.get(key) is bucket:
                    allowed.discard(key)
                    yield key
            # An emptied bucket is unlinked but keeps its ``next``: the walk goes on from it.
            bucket = bucket.next

    def order(self) -> list[Hashable]:
        keys: list[Hashable] = []
        bucket = self._ring.next
        while bucket is not self._ring:
            keys.extend(bucket.keys)
            bucket = bucket.next
        return keys

    @staticmethod
    def _link_after(bucket: _Bucket, count: int) -> _Bucket:
        new = _Bucket(count)
        new.prev, new.next = bucket, bucket.next
        bucket.next.prev = new
        bucket.next = new
        return new

    @staticmethod
    def _drop(bucket: _Bucket, key: Hashable) -> None:
        del bucket.keys[key]
        if not bucket.keys:
            bucket.prev.next = bucket.next
            bucket.next.prev = bucket.prev


EVICTION_POLICIES: dict[str, Callable[[], EvictionPolicy]] = {
    LRUEviction.name: LRUEviction,
    LFUEviction.name: LFUEviction,
    FIFOEviction.name: FIFOEviction,
}
"""Eviction policy name -> a fresh policy."""


def make_eviction_policy(name: str) -> EvictionPolicy:
    """A fresh eviction policy by name; ValueError naming the known ones otherwise."""
    return choose(EVICTION_POLICIES, name, "eviction policy")()
