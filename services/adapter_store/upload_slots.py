"""A tenant's uploads and imports in flight, bounded across every store replica together.

An upload holds its whole adapter in the store's memory (up to ``--max-adapter-mib``) until it is
committed, and an import holds what it fetched: without a bound one tenant could fill a replica's
RAM with uploads in parallel. A tenant with ``max_concurrent_uploads`` N has N slots in etcd,
``uploads/<owner>/<0..N-1>``; an upload takes a free one in a transaction requiring it free
(``Create == 0``), so two replicas never hold one slot, and lets it go when it ends. The slots are
put under a lease of the replica's own, kept alive while it holds any: a replica that dies frees
its slots within the lease's TTL. Cut off from etcd for longer than that, a replica's slots
lapse while its uploads go on, so for that while a tenant may have more than N in flight; a
replica that cannot reach etcd cannot commit an upload either.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import aetcd

from services.adapter_store.catalog_keys import CatalogKeys
from services.runtime.errors import ResourceExhausted, Unavailable
from services.runtime.etcd.prefix_follower import prefix_end

log = logging.getLogger("loramesh.adapter_store")

EtcdCall = Callable[[Callable[[aetcd.Client], Awaitable[Any]], str], Any]
"""Runs one etcd call and returns its result (:meth:`.catalog.Catalog.etcd_call`)."""

UPLOAD_RETRY_AFTER_S = 1.0
"""The retry hint of a refusal for too many uploads in flight: when one ends is not known."""


class UploadSlot:
    """One upload's slot: :meth:`release` it when the upload ends (later calls do nothing)."""

    def __init__(self, slots: UploadSlots | None, key: bytes = b"", token: bytes = b""):
        self._slots, self._key, self._token = slots, key, token

    def release(self) -> None:
        slots, self._slots = self._slots, None
        if slots is not None:
            slots._release(self._key, self._token)


FREE_SLOT = UploadSlot(None)
"""What an upload of a tenant without a bound holds: nothing to let go."""


class UploadSlots:
    """Takes and frees the tenants' upload slots in etcd."""

    def __init__(
        self,
        keys: CatalogKeys,
        call: EtcdCall,
        replica_id: str,
        ttl_s: int,
        clock: Callable[[], float] = time.monotonic,
    ):
        self._keys = keys
        self._call = call
        self._replica_id = replica_id
        self._ttl_s = ttl_s
        self._clock = clock
        self._lock = threading.Lock()
        self._lease = 0
        """The lease slots are put under (0: none granted, or lapsed)."""
        self._lease_until = 0.0
        """Until when the lease surely lives: its last grant or refresh plus its TTL, less a third."""
        self._held = 0
        self._stop = threading.Event()
        self._refresher: threading.Thread | None = None

    def acquire(self, owner: str, limit: int) -> UploadSlot:
        """One of ``owner``'s ``limit`` slots; ResourceExhausted (with a retry hint) when all
        are held."""
        with self._lock:
            self._held += 1
        try:
            return self._take(owner, limit, self._current_lease())
        except BaseException as error:
            with self._lock:
                self._held -= 1
                if isinstance(error, Unavailable):
                    self._lease = 0  # it may be what failed (etcd restarted): the next try takes a new one
            raise

    def _take(self, owner: str, limit: int, lease: int) -> UploadSlot:
        t = aetcd.transactions
        prefix = self._keys.upload_slots(owner)
        token = f"{self._replica_id} {uuid.uuid4().hex}".encode()
        slot = 0
        for _ in range(limit + 1):
            key = self._keys.upload_slot(owner, slot).encode()
            took, responses = self._call(
                lambda c, key=key: c.transaction(
                    compare=[t.Create(key) == 0],
                    success=[t.Put(key, token, lease=lease)],
                    failure=[t.Get(prefix.encode(), prefix_end(prefix))],
                ),
                "take an upload slot",
            )
            if took:
                return UploadSlot(self, key, token)
            held = {meta.key.decode()[len(prefix) :] for _, meta in responses[0]}
            free = [n for n in range(limit) if str(n) not in held]
            if not free:
                break
            slot = free[0]
        raise ResourceExhausted(
            f"tenant {owner!r} has {limit} uploads and imports in flight, its limit "
            f"(max_concurrent_uploads {limit}); retry once one of them has ended",
            retry_after_s=UPLOAD_RETRY_AFTER_S,
        )

    def _current_lease(self) -> int:
        """The lease to put a slot under: the one held while it surely lives, else a new one."""
        with self._lock:
            if self._lease and self._clock() < self._lease_until:
                return self._lease
        granted = self._call(lambda c: c.lease(self._ttl_s), "grant an upload lease")
        with self._lock:
            self._lease = int(granted.id)
            self._lease_until = self._clock() + self._ttl_s * 2 / 3
            if self._refresher is None:
                self._refresher = threading.Thread(target=self._refresh, name="upload-slots", daemon=True)
                self._refresher.start()
            return self._lease

    def _refresh(self) -> None:
        """Keep the lease alive while any slot is held under it (every third of its TTL)."""
        while not self._stop.wait(self._ttl_s / 3):
            with self._lock:
                lease = self._lease if self._held else 0
            if not lease:
                continue  # nothing held: the lease may lapse, the next upload takes a new one
            try:
                reply = self._call(
                    lambda c, lease=lease: c.refresh_lease(lease), "keep the upload lease alive"
                )
            except Exception as error:  # noqa: BLE001 - etcd away: try again next round
                log.warning("cannot keep the upload slots' lease alive: %s", error)
                continue
            with self._lock:
                if getattr(reply, "TTL", 0) > 0:
                    self._lease_until = self._clock() + self._ttl_s * 2 / 3
                elif self._lease == lease:
                    log.warning("the upload slots' lease %x lapsed: the uploads in flight hold none", lease)
                    self._lease = 0

    def _release(self, key: bytes, token: bytes) -> None:
        t = aetcd.transactions
        with self._lock:
            self._held -= 1
        try:
            self._call(
                lambda c: c.transaction(compare=[t.Value(key) == token], success=[t.Delete(key)], failure=[]),
                "free an upload slot",
            )
        except Exception as error:  # noqa: BLE001 - the lease frees it
            log.warning("cannot free upload slot %s now (its lease will): %s", key.decode(), error)

    def close(self) -> None:
        """Stop keeping the lease alive and revoke it: this replica's slots are free at once."""
        self._stop.set()
        if self._refresher is not None:
            self._refresher.join()
        if self._lease:
            try:
                self._call(lambda c: c.revoke_lease(self._lease), "revoke the upload lease")
            except Exception as error:  # noqa: BLE001 - it lapses by itself
                log.debug("revoking the upload lease failed: %s", error)
