"""What a worker's prefix cache cached and evicted since its last announcement to the cluster
prefix tier's index (``services/kv_manager/prefix_index.py``), bounded.

The engine thread records; the announcer (event loop) drains. It mirrors the cache's key set, so
a full announcement (after a restart of the index, or when the pending changes outgrew their
bound) needs no walk of the cache on another thread.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

BlockKey = bytes
"""A cached block's chain hash (``prefix_cache.BlockKey``)."""


@dataclass(frozen=True)
class Announcement:
    """One drained batch of changes."""

    added: list[BlockKey]
    """Keys cached (all those cached now when ``replace``)."""
    removed: list[BlockKey]
    """Keys evicted (none when ``replace``)."""
    replace: bool
    """``added`` is the whole set: the index drops what it held for this worker."""


class PrefixJournal:
    """Keys cached and evicted since the last :meth:`drain` (thread-safe)."""

    def __init__(self, max_pending: int = 4096):
        """``max_pending``: changes kept; past it the next drain announces the whole set."""
        self.max_pending = max_pending
        self._lock = threading.Lock()
        self._held: set[BlockKey] = set()
        self._added: set[BlockKey] = set()
        self._removed: set[BlockKey] = set()
        self._replace = True  # the index knows nothing of a new worker's cache

    def cached(self, key: BlockKey) -> None:
        with self._lock:
            self._held.add(key)
            self._removed.discard(key)
            self._added.add(key)
            self._bound()

    def evicted(self, key: BlockKey) -> None:
        with self._lock:
            self._held.discard(key)
            if key in self._added:
                self._added.discard(key)
            else:
                self._removed.add(key)
            self._bound()

    def resend_all(self) -> None:
        """The next drain announces the whole set (the index is new, or lost a batch)."""
        with self._lock:
            self._replace = True

    def pending(self) -> bool:
        with self._lock:
            return self._replace or bool(self._added or self._removed)

    def drain(self) -> Announcement:
        with self._lock:
            if self._replace:
                announcement = Announcement(sorted(self._held), [], True)
            else:
                announcement = Announcement(sorted(self._added), sorted(self._removed), False)
            self._added, self._removed, self._replace = set(), set(), False
            return announcement

    def _bound(self) -> None:
        if len(self._added) + len(self._removed) > self.max_pending:
            self._added, self._removed, self._replace = set(), set(), True
