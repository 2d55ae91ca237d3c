"""Removes blobs no catalog row references: what a deleted adapter, a replaced version, a failed
registration or a replica killed mid-upload leaves behind.

Any replica may collect, several at once. A blob is deleted only under a ``collecting`` mark that
etcd set in a transaction requiring that no row references the blob
(:meth:`Catalog.mark_collecting`); a registration relying on the blob commits only if the mark
is as it read it before publishing the blob (:meth:`Catalog.prepare`), so a blob a committed row
names is never deleted. Young blobs are left alone (``grace_s``): a registration may have
written its blob and not yet committed its row.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable

from services.adapter_store.blobs.backend import BlobBackend, BlobEntry
from services.adapter_store.catalog import Catalog

log = logging.getLogger("loramesh.adapter_store")


class BlobCollector:
    def __init__(
        self, catalog: Catalog, blobs: BlobBackend, grace_s: float, clock: Callable[[], float] = time.time
    ):
        self.catalog = catalog
        self.blobs = blobs
        self.grace_s = grace_s
        self._clock = clock
        self.collected = 0
        """Blobs this replica removed since it started."""

    def collect(self, listing: Iterable[BlobEntry] | None = None) -> int:
        """One pass over the blob tier (``listing``: the tier's, taken just before by the
        caller, instead of listing it again: start-up lists it once); returns how many blobs it
        removed."""
        referenced = self.catalog.mirror.referenced_digests()
        oldest_kept = self._clock() - self.grace_s
        removed = 0
        for entry in list(self.blobs.listing() if listing is None else listing):
            if entry.digest in referenced or entry.modified_s > oldest_kept:
                continue
            removed += self.remove(entry.digest)
        self.collected += removed
        if removed:
            log.info("collected %d unreferenced blob(s) from %s", removed, self.blobs.description)
        return removed

    def remove(self, digest: str) -> bool:
        """Delete blob ``digest`` under a collection mark, now, unless a row references it (or
        another replica is collecting it); whether it did. Also how a refused registration takes
        back the blobs it published: a registration relying on them meanwhile finds the mark
        changed and publishes them again."""
        mark_revision = self.catalog.mark_collecting(digest)
        if not mark_revision:
            return False  # referenced after all (the mirror lagged), or another replica is on it
        self.blobs.delete(digest)
        if not self.catalog.mark_collected(digest, mark_revision):
            log.error(
                "blob %s was deleted after a registration took its collection mark over as "
                "abandoned: a collector stalled for longer than the stall limit",
                digest,
            )
        return True
