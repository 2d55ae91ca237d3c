"""The catalog's changes as they commit, for whoever keeps a copy of it (the gateways' adapter
index, through ``WatchAdapters``).

The repository publishes under its change lock, right after each commit, so subscribers see the
changes in commit order. A subscriber's callback runs on the committing thread and must not
block (hand the change to a queue). Pure domain code: no gRPC.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass

from services.adapter_store.adapter_record import AdapterRecord


@dataclass(frozen=True)
class CatalogChange:
    """One committed change: an adapter added (or its row replaced), or one removed."""

    upserted: AdapterRecord | None = None
    """The adapter now in the catalog; None for a removal."""
    deleted_id: str = ""
    """The id of the adapter removed (deleted, replaced by a new version, or quarantined)."""


Subscriber = Callable[[CatalogChange], None]


class CatalogChanges:
    """Thread-safe fan-out of :class:`CatalogChange` to subscribers."""

    def __init__(self) -> None:
        self._subscribers: dict[int, Subscriber] = {}
        self._next = 0
        self._lock = threading.Lock()

    def subscribe(self, subscriber: Subscriber) -> Callable[[], None]:
        """Call ``subscriber`` with every change from now on; returns the unsubscribe call."""
        with self._lock:
            key, self._next = self._next, self._next + 1
            self._subscribers[key] = subscriber

        def unsubscribe() -> None:
            with self._lock:
                self._subscribers.pop(key, None)

        return unsubscribe

    def publish(self, change: CatalogChange) -> None:
        with self._lock:
            subscribers = list(self._subscribers.values())
        for subscriber in subscribers:
            subscriber(change)
