"""A few interchangeable things (the gateway's template render processes) lent to tenants in turn.

A tenant that asks for many at once does not make the others wait behind it: a freed one goes
to the next tenant in turn among those waiting (round robin; first come, first served within a
tenant), and no tenant holds more than ``per_tenant`` at once, so with more than one thing there
is always one a newcomer can have as soon as its holder is done.

Things are returned from any thread (a render ends in the thread that ran it): the bookkeeping
is under a lock, and a waiter gets its thing on its own event loop.
"""

from __future__ import annotations

import asyncio
import threading
from collections import Counter, deque
from collections.abc import Sequence
from typing import Generic, TypeVar

T = TypeVar("T")


class FairShare(Generic[T]):
    """``items``, lent one at a time to tenants in turn, at most ``per_tenant`` to each at once."""

    def __init__(self, items: Sequence[T], per_tenant: int):
        if per_tenant < 1:
            raise ValueError(f"per_tenant must be at least 1, got {per_tenant}")
        self._free = list(items)
        self._per_tenant = per_tenant
        self._held: Counter[str] = Counter()
        self._waiting: dict[str, deque[asyncio.Future]] = {}
        """Waiters by tenant; the dict's order is the tenants' turn order."""
        self._lock = threading.Lock()

    async def acquire(self, tenant: str) -> T:
        """An item for ``tenant``, once it is its turn; give it back with :meth:`release`."""
        with self._lock:
            if self._free and tenant not in self._waiting and self._held[tenant] < self._per_tenant:
                self._held[tenant] += 1
                return self._free.pop()
            waiter = asyncio.get_running_loop().create_future()
            self._waiting.setdefault(tenant, deque()).append(waiter)
        try:
            return await waiter
        except asyncio.CancelledError:
            with self._lock:
                queue = self._waiting.get(tenant)
                if queue is not None and waiter in queue:
                    queue.remove(waiter)
                    if not queue:
                        del self._waiting[tenant]
            if waiter.done() and not waiter.cancelled():  # handed over as the waiter was cancelled
                self.release(tenant, waiter.result())
            raise

    def release(self, tenant: str, item: T) -> None:
        """``tenant`` gives ``item`` back (from any thread)."""
        with self._lock:
            self._held[tenant] -= 1
            if not self._held[tenant]:
                del self._held[tenant]
            self._free.append(item)
            handed = self._hand_out()
        for waiter, holder, lent in handed:
            try:
                waiter.get_loop().call_soon_threadsafe(self._deliver, waiter, holder, lent)
            except RuntimeError:  # its event loop is closed: nobody waits there any more
                self.release(holder, lent)

    @property
    def lent(self) -> int:
        """Items lent out now."""
        with self._lock:
            return sum(self._held.values())

    @property
    def waiting(self) -> int:
        """Requests waiting for an item now."""
        with self._lock:
            return sum(len(queue) for queue in self._waiting.values())

    def _hand_out(self) -> list[tuple[asyncio.Future, str, T]]:
        """Free items given to the waiters whose turn it is (under the lock)."""
        handed = []
        while self._free:
            tenant = next((t for t in self._waiting if self._held[t] < self._per_tenant), None)
            if tenant is None:
                break
            queue = self._waiting.pop(tenant)
            waiter = queue.popleft()
            if queue:
                self._waiting[tenant] = queue  # back at the end: the others go first
            if waiter.done():  # cancelled while it waited
                continue
            self._held[tenant] += 1
            handed.append((waiter, tenant, self._free.pop()))
        return handed

    def _deliver(self, waiter: asyncio.Future, tenant: str, item: T) -> None:
        if waiter.done():
            self.release(tenant, item)
        else:
            waiter.set_result(item)
