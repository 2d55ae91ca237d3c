"""Numbered slots in etcd, each held by at most one process of a service's many at a time.

A bound shared by every replica (a tenant's uploads in flight across the adapter store's
replicas, its generations in flight across the gateways) is N slots under one prefix,
``<prefix><0..N-1>``. A holder takes a free one in a transaction requiring it free
(``Create == 0``), so two processes never hold one slot, and deletes it (if still its own) when
done. Slots are put under a lease of the process's own, kept alive while it holds any: a process
that dies frees its slots within the lease's TTL. Cut off from etcd for longer than that, a
process's slots lapse while what they admitted goes on, so for that while the bound may be
exceeded by what that process held; :meth:`LeasedSlots.lease_alive` says whether its slots surely
still stand.

The calls are synchronous (``call`` runs one etcd call to its end): the adapter store calls from
its request threads, the gateway from a worker thread (:mod:`services.gateway.shared_quota`).
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import aetcd

from services.runtime.errors import Unavailable
from services.runtime.etcd.prefix_follower import prefix_end

log = logging.getLogger("loramesh.leased_slots")

EtcdCall = Callable[[Callable[[aetcd.Client], Awaitable[Any]], str], Any]
"""Runs one etcd call and returns its result; raises Unavailable naming the second argument
(what it was for) when etcd does not answer."""


class HeldSlot:
    """One slot held: :meth:`release` it when done (later calls do nothing)."""

    def __init__(self, slots: LeasedSlots | None, key: bytes = b"", token: bytes = b""):
        self._slots, self._key, self._token = slots, key, token

    def release(self) -> None:
        slots, self._slots = self._slots, None
        if slots is not None:
            slots._release(self._key, self._token)


FREE_SLOT = HeldSlot(None)
"""What is held where there is no bound: nothing to let go."""


class LeasedSlots:
    """Takes and frees slots in etcd under one lease of this process's own."""

    def __init__(
        self,
        call: EtcdCall,
        holder_id: str,
        ttl_s: int,
        what: str,
        clock: Callable[[], float] = time.monotonic,
    ):
        """``holder_id``: this process, written in the slots it holds (who holds one is then
        readable in etcd); ``what``: the slots' name in logs and errors (``"upload"``, ``"generation"``)."""
        self._call = call
        self._holder_id = holder_id
        self._ttl_s = ttl_s
        self._what = what
        self._clock = clock
        self._lock = threading.Lock()
        self._lease = 0
        """The lease slots are put under (0: none granted, or lapsed)."""
        self._lease_until = 0.0
        """Until when the lease surely lives: its last grant or refresh plus its TTL, less a third."""
        self._held = 0
        self._stop = threading.Event()
        self._refresher: threading.Thread | None = None

    def take(self, prefix: str, limit: int) -> HeldSlot | None:
        """One of the ``limit`` slots under ``prefix``, or None when all are held (Unavailable
        when etcd does not answer)."""
        with self._lock:
            self._held += 1
        try:
            slot = self._take(prefix, limit, self._current_lease())
        except BaseException as error:
            with self._lock:
                self._held -= 1
                if isinstance(error, Unavailable):
                    self._lease = 0  # it may be what failed (etcd restarted): the next try takes a new one
            raise
        if slot is None:
            with self._lock:
                self._held -= 1
        return slot

    def lease_alive(self) -> bool:
        """Whether the slots held surely still stand: the lease was kept alive within the last two
        thirds of its TTL."""
        with self._lock:
            return bool(self._lease) and self._clock() < self._lease_until

    def _take(self, prefix: str, limit: int, lease: int) -> HeldSlot | None:
        t = aetcd.transactions
        token = f"{self._holder_id} {uuid.uuid4().hex}".encode()
        slot = 0
        for _ in range(limit + 1):
            key = f"{prefix}{slot}".encode()
            took, responses = self._call(
                lambda c, key=key: c.transaction(
                    compare=[t.Create(key) == 0],
                    success=[t.Put(key, token, lease=lease)],
                    failure=[t.Get(prefix.encode(), prefix_end(prefix))],
                ),
                f"take a {self._what} slot",
            )
            if took:
                return HeldSlot(self, key, token)
            held = {meta.key.decode()[len(prefix) :] for _, meta in responses[0]}
            free = [n for n in range(limit) if str(n) not in held]
            if not free:
                return None
            slot = free[0]
        return None

    def _current_lease(self) -> int:
        """The lease to put a slot under: the one held while it surely lives, else a new one."""
        with self._lock:
            if self._lease and self._clock() < self._lease_until:
                return self._lease
        granted = self._call(lambda c: c.lease(self._ttl_s), f"grant the {self._what} slots' lease")
        with self._lock:
            self._lease = int(granted.id)
            self._lease_until = self._clock() + self._ttl_s * 2 / 3
            if self._refresher is None:
                self._refresher = threading.Thread(
                    target=self._refresh, name=f"{self._what}-slots", daemon=True
                )
                self._refresher.start()
            return self._lease

    def _refresh(self) -> None:
        """Keep the lease alive while any slot is held under it (every third of its TTL)."""
        while not self._stop.wait(self._ttl_s / 3):
            with self._lock:
                lease = self._lease if self._held else 0
            if not lease:
                continue  # nothing held: the lease may lapse, the next take grants a new one
            try:
                reply = self._call(
                    lambda c, lease=lease: c.refresh_lease(lease), f"keep the {self._what} slots' lease alive"
                )
            except Exception as error:  # noqa: BLE001 - etcd away: try again next round
                log.warning("cannot keep the %s slots' lease alive: %s", self._what, error)
                continue
            with self._lock:
                if getattr(reply, "TTL", 0) > 0:
                    self._lease_until = self._clock() + self._ttl_s * 2 / 3
                elif self._lease == lease:
                    log.warning("the %s slots' lease %x lapsed: those in flight hold none", self._what, lease)
                    self._lease = 0

    def _release(self, key: bytes, token: bytes) -> None:
        t = aetcd.transactions
        with self._lock:
            self._held -= 1
        try:
            self._call(
                lambda c: c.transaction(compare=[t.Value(key) == token], success=[t.Delete(key)], failure=[]),
                f"free a {self._what} slot",
            )
        except Exception as error:  # noqa: BLE001 - the lease frees it
            log.warning("cannot free %s slot %s now (its lease will): %s", self._what, key.decode(), error)

    def close(self) -> None:
        """Stop keeping the lease alive and revoke it: this process's slots are free at once."""
        self._stop.set()
        if self._refresher is not None:
            self._refresher.join()
        if self._lease:
            try:
                self._call(lambda c: c.revoke_lease(self._lease), f"revoke the {self._what} slots' lease")
            except Exception as error:  # noqa: BLE001 - it lapses by itself
                log.debug("revoking the %s slots' lease failed: %s", self._what, error)
