"""The hot set of adapter weights in host RAM, bounded by bytes, evicted in an eviction policy's
order (``--eviction-policy``: least recently used first by default), pinned adapters never.

S-LoRA keeps adapters in main memory; with thousands of them, RAM holds only the recently
used ones and the rest come from disk. The budget bounds resident memory whatever the count.

Each entry lives in its own anonymous memory mapping, not on the Python heap: an evicted
entry's pages go back to the OS at once. Held as heap ``bytes``, long-lived multi-MB entries
interleave with short-lived upload and fetch buffers, and the allocator's holes made resident
memory grow to twice the budget at 2,000 adapters.
"""

from __future__ import annotations

import mmap
import threading

from services.runtime.eviction import EvictionPolicy, LRUEviction
from services.runtime.process.mapped_memory import populated_mapping


def to_anonymous_mapping(data) -> memoryview:
    """Copy a bytes-like object into a fresh anonymous mapping (freed when unreferenced)."""
    mapping = populated_mapping(len(data))
    mapping.write(data)
    return memoryview(mapping)[: len(data)]


class RamTier:
    """Thread-safe map ``adapter id -> read-only buffer``, values within ``budget_bytes``.

    Eviction drops the tier's reference; a fetch still streaming an evicted entry keeps its own
    reference until it finishes, so the budget can be exceeded by fetches in flight only.
    Pinned entries count against the budget and are never evicted: a value that fits only by
    evicting one is not kept (it is read from disk when asked for).
    """

    def __init__(self, budget_bytes: int, eviction: EvictionPolicy | None = None):
        """``eviction``: the order entries go in (default least recently used first)."""
        self.budget_bytes = budget_bytes
        self._entries: dict[str, memoryview] = {}
        self._eviction = eviction or LRUEviction()
        self._bytes = 0
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0

    def get(self, key: str) -> memoryview | None:
        with self._lock:
            data = self._entries.get(key)
            if data is None:
                self.misses += 1
                return None
            self._eviction.touch(key)
            self.hits += 1
            return data

    def put(self, key: str, data) -> memoryview | None:
        """Keep a copy of ``data``, counted as a use, evicting in the policy's order to fit;
        returns the kept buffer (a ready mapping is kept as it is). A value that does not fit
        even after evicting every unpinned entry is not kept (returns None)."""
        if len(data) > self.budget_bytes:
            return None
        if not (isinstance(data, memoryview) and isinstance(data.obj, mmap.mmap)):
            data = to_anonymous_mapping(data)
        with self._lock:
            self._drop(key)
            if not self._make_room(len(data)):
                self._eviction.remove(key)
                return None
            self._entries[key] = data
            self._bytes += len(data)
            self._eviction.touch(key)
            return data

    def _make_room(self, size: int) -> bool:
        """Evict until ``size`` more bytes fit (under the lock); False, evicting nothing, when
        even evicting every unpinned entry would not do."""
        if self._bytes + size <= self.budget_bytes:
            return True
        pinned = self._eviction.pinned()
        kept = sum(len(data) for key, data in self._entries.items() if key in pinned)
        if kept + size > self.budget_bytes:
            return False
        for victim in self._eviction.victims(list(self._entries)):
            if self._bytes + size <= self.budget_bytes:
                break
            self._drop(victim)
            self._eviction.remove(victim)
        return True

    def _drop(self, key: str) -> None:
        old = self._entries.pop(key, None)
        if old is not None:
            self._bytes -= len(old)

    def discard(self, key: str) -> None:
        with self._lock:
            self._drop(key)
            self._eviction.remove(key)

    def pin(self, key: str) -> None:
        """Never evict ``key``'s entry (now or once put) until :meth:`unpin`."""
        with self._lock:
            self._eviction.pin(key)

    def unpin(self, key: str) -> None:
        with self._lock:
            self._eviction.unpin(key)

    def is_pinned(self, key: str) -> bool:
        with self._lock:
            return key in self._eviction.pinned()

    def __contains__(self, key: str) -> bool:
        """Whether ``key`` is held (not counted as a use, a hit or a miss)."""
        with self._lock:
            return key in self._entries

    @property
    def bytes_used(self) -> int:
        return self._bytes

    def __len__(self) -> int:
        return len(self._entries)
