"""The hot set of adapter weights in host RAM, bounded by bytes and evicted LRU.

S-LoRA keeps adapters in main memory; with thousands of them, RAM holds only the recently
used ones and the rest come from disk. The budget bounds resident memory whatever the count.
"""

from __future__ import annotations

import threading
from collections import OrderedDict


class RamTier:
    """Thread-safe LRU map ``adapter id -> bytes`` whose values never exceed ``budget_bytes``."""

    def __init__(self, budget_bytes: int):
        self.budget_bytes = budget_bytes
        self._entries: OrderedDict[str, bytes] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0

    def get(self, key: str) -> bytes | None:
        with self._lock:
            data = self._entries.get(key)
            if data is None:
                self.misses += 1
                return None
            self._entries.move_to_end(key)
            self.hits += 1
            return data

    def put(self, key: str, data: bytes) -> bool:
        """Insert as most recently used, evicting the least recently used to fit.

        A value larger than the whole budget is not kept (returns False).
        """
        if len(data) > self.budget_bytes:
            return False
        with self._lock:
            old = self._entries.pop(key, None)
            if old is not None:
                self._bytes -= len(old)
            while self._entries and self._bytes + len(data) > self.budget_bytes:
                _, evicted = self._entries.popitem(last=False)
                self._bytes -= len(evicted)
            self._entries[key] = data
            self._bytes += len(data)
            return True

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
