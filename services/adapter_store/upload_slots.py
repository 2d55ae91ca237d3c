"""A tenant's uploads and imports in flight, bounded across every store replica together.

An upload holds its whole adapter in the store's memory (up to ``--max-adapter-mib``) until it is
committed, and an import holds what it fetched: without a bound one tenant could fill a replica's
RAM with uploads in parallel. A tenant with ``max_concurrent_uploads`` N has N slots in etcd,
``uploads/<owner>/<0..N-1>``, taken and freed by :class:`~services.runtime.etcd.leased_slots.
LeasedSlots` (a transaction requiring the slot free, under a lease of the replica's own): a
replica that dies frees its slots within the lease's TTL. Cut off from etcd for longer than that,
a replica's slots lapse while its uploads go on, so for that while a tenant may have more than N
in flight; a replica that cannot reach etcd cannot commit an upload either.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from services.adapter_store.catalog_keys import CatalogKeys
from services.runtime.errors import ResourceExhausted
from services.runtime.etcd.leased_slots import FREE_SLOT, EtcdCall, HeldSlot, LeasedSlots

UPLOAD_RETRY_AFTER_S = 1.0
"""The retry hint of a refusal for too many uploads in flight: when one ends is not known."""

UploadSlot = HeldSlot
"""One upload's slot: release it when the upload ends."""

__all__ = ["FREE_SLOT", "UPLOAD_RETRY_AFTER_S", "UploadSlot", "UploadSlots"]


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
        self._slots = LeasedSlots(call, replica_id, ttl_s, "upload", clock)

    def acquire(self, owner: str, limit: int) -> UploadSlot:
        """One of ``owner``'s ``limit`` slots; ResourceExhausted (with a retry hint) when all
        are held."""
        slot = self._slots.take(self._keys.upload_slots(owner), limit)
        if slot is None:
            raise ResourceExhausted(
                f"tenant {owner!r} has {limit} uploads and imports in flight, its limit "
                f"(max_concurrent_uploads {limit}); retry once one of them has ended",
                retry_after_s=UPLOAD_RETRY_AFTER_S,
            )
        return slot

    def close(self) -> None:
        """Revoke the slots' lease: this replica's slots are free at once."""
        self._slots.close()
