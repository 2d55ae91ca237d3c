"""The hot set of adapter weights in host RAM, bounded by bytes and evicted LRU.

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
from collections import OrderedDict


def to_anonymous_mapping(data) -> memoryview:
    """Copy a bytes-like object into a fresh anonymous mapping (freed when unreferenced)."""
    mapping = mmap.mmap(-1, max(len(data), 1))
    mapping.write(data)
    return memoryview(mapping)[: len(data)]


class RamTier:
    """Thread-safe LRU map ``adapter id -> read-only buffer``, values within ``budget_bytes``.

    Eviction drops the tier's reference; a fetch still streaming an evicted entry keeps its own
    reference until it finishes, so the budget can be exceeded by fetches in flight only.
    """

    def __init__(self, budget_bytes: int):
        self.budget_bytes = budget_bytes
        self._entries: OrderedDict[str, memoryview] = OrderedDict()
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
            self._entries.move_to_end(key)
            self.hits += 1
            return data

    def put(self, key: str, data) -> memoryview | None:
        """Keep a copy of ``data`` as most recently used, evicting the least recently used to
        fit; returns the kept buffer (a ready mapping is kept as it is). A value larger than the
        whole budget is not kept (returns None)."""
        if len(data) > self.budget_bytes:
            return None
        if not (isinstance(data, memoryview) and isinstance(data.obj, mmap.mmap)):
            data = to_anonymous_mapping(data)
        with self._lock:
            old = self._entries.pop(key, None)
            if old is not None:
                self._bytes -= len(old)
            while self._entries and self._bytes + len(data) > self.budget_bytes:
                _, evicted = self._entries.popitem(last=False)
                self._bytes -= len(evicted)
            self._entries[key] = data
            self._bytes += len(data)
            return data

    def discard(self, key: str) -> None:
        with self._lock:
            old = self._entries.pop(key, None)
            if old is not None:
                self._bytes -= len(old)

    @property
    def bytes_used(self) -> int:
        return self._bytes

    def __len__(self) -> int:
        return len(self._entries)
