"""The last versions of each adapter name, kept after newer ones replace them.

A publish under a name already registered commits the next version, which the name serves from
then on. With ``keep_versions`` above 1 or a ``keep_versions_s`` the version it replaces is
retired, not removed: in the same etcd transaction its usage entry goes (the tenants' storage
quotas count serving versions; kept ones are bounded per name by the retention instead), while
its row and its blob references stay. So, for the kept versions of a name:

- every gateway's catalog watch holds them (``name@N``, ``name@sha256:…``), and the store finds
  them by id (:meth:`~.catalog_mirror.CatalogMirror.get`): a worker fetching the version a
  request was admitted on before a publish, or a continuation moved to another worker, still
  gets it;
- publishing one's content again is a rollback that re-validates nothing (its tensors were
  validated when first stored and its blobs are held): the registrar takes its row's fields
  (:func:`kept_content`).

Listings, counts, pins and lookups by name see the serving versions only
(:class:`~.catalog_mirror.CatalogMirror`).

After each publish the versions older than the last ``keep_versions`` (the serving one counted)
and replaced more than ``keep_versions_s`` ago are pruned: their rows and blob references go (in
transactions of :data:`KEPT_PER_TXN` versions), and the collector removes their blobs once no
other row references them (:mod:`.blob_collector`). The age floor is for requests admitted on a
version just before it was replaced: at a training loop's pace (ten publishes a second) the last
few versions are a fraction of a second, less than such a request may take to reach its worker,
which fetches the version by id only then. A prune that fails (etcd away) is left to the name's
next publish, which prunes every version past the limits, not only one. Deleting a name deletes
its kept versions first, then the name (:meth:`.catalog.Catalog.delete`): a deletion cut short
leaves the name serving, never a kept version in its place.

A request a worker is serving on a pruned version goes on to its end: the worker holds its copy
(host copy and pool pages) by reference until its last request ends, whatever the catalog says.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

import aetcd

from services.adapter_store.adapter_record import AdapterRecord
from services.adapter_store.catalog_keys import CatalogKeys, record_digests
from services.adapter_store.catalog_mirror import MIRROR_WAIT_S, CatalogMirror
from services.adapter_store.config import MAX_KEEP_VERSIONS
from services.runtime.errors import Unavailable

log = logging.getLogger("loramesh.adapter_store")

T = TypeVar("T")

KEPT_PER_TXN = 16
"""Kept versions one transaction removes at most: each is a row and up to 4 blob references, and
etcd takes at most 128 operations in a transaction (its ``--max-txn-ops``)."""


def retirement_ops(keys: CatalogKeys, record: AdapterRecord) -> list:
    """The writes that retire ``record``, the version a publish replaces: out of its owner's
    usage; its row and blob references stay, as a kept version."""
    return [aetcd.transactions.Delete(keys.usage_entry(record.owner, record.id).encode())]


def kept_removals(keys: CatalogKeys, records: list[AdapterRecord]) -> list[list]:
    """The writes that remove kept versions ``records`` (their rows and blob references), in
    transactions' worth."""
    t = aetcd.transactions
    batches = []
    for start in range(0, len(records), KEPT_PER_TXN):
        ops = []
        for record in records[start : start + KEPT_PER_TXN]:
            ops.append(t.Delete(keys.row(record.id).encode()))
            digests = sorted(set(record_digests(record).values()))
            ops += [t.Delete(keys.ref(d, record.id).encode()) for d in digests]
        batches.append(ops)
    return batches


def kept_content(kept: list[AdapterRecord], sha256: str, config_json: str) -> AdapterRecord | None:
    """The newest of ``kept`` (a name's versions) with these weights and this config: what a
    publish of that content again rolls back to; None when none is."""
    for record in reversed(kept):
        if record.sha256 == sha256 and record.config_json == config_json:
            return record
    return None


class VersionRetention:
    """Prunes a name's versions past the last ``keep_versions`` once replaced more than
    ``keep_versions_s`` ago. ``etcd_call(fn, what)`` runs ``fn(client)`` on the catalog's
    connection (:meth:`.catalog.Catalog.etcd_call`); ``clock``: Unix seconds (injected by
    tests)."""

    def __init__(
        self,
        keys: CatalogKeys,
        mirror: CatalogMirror,
        etcd_call: Callable[[Callable[[aetcd.Client], Awaitable[T]], str], T],
        keep_versions: int,
        keep_versions_s: float = 0.0,
        clock: Callable[[], float] = time.time,
    ):
        if not 1 <= keep_versions <= MAX_KEEP_VERSIONS:
            raise ValueError(f"keep_versions must be 1 to {MAX_KEEP_VERSIONS}, got {keep_versions}")
        self.keys = keys
        self.mirror = mirror
        self.keep_versions = keep_versions
        self.keep_versions_s = keep_versions_s
        self._call = etcd_call
        self._clock = clock
        self.pruned = 0
        """Versions this replica pruned since it started."""

    @property
    def retires(self) -> bool:
        """Whether a replaced version is kept at all (``keep_versions`` 1 and no
        ``keep_versions_s``: it is removed)."""
        return self.keep_versions > 1 or self.keep_versions_s > 0

    def versions(self, owner: str, name: str) -> list[AdapterRecord]:
        """Every version of ``owner``'s ``name`` this replica holds, oldest first."""
        return self.mirror.versions(owner, name)

    def prune(self, owner: str, name: str, serving_version: int) -> int:
        """Remove the versions of ``owner``'s ``name`` older than the last ``keep_versions``
        (``serving_version`` the newest of them) and replaced more than ``keep_versions_s`` ago;
        how many it removed. Never raises: what fails now is pruned by the name's next publish."""
        oldest_kept = serving_version - self.keep_versions + 1
        versions = self.versions(owner, name)
        # When a version was replaced: when the next one held was made (the one right after it,
        # unless that was pruned already: later, so the version is kept the longer).
        replaced_ms = {older.id: newer.created_ms for older, newer in itertools.pairwise(versions)}
        latest_ms = (self._clock() - self.keep_versions_s) * 1000
        victims = [
            r
            for r in versions
            if r.version < oldest_kept and replaced_ms.get(r.id, latest_ms + 1) <= latest_ms
        ]
        removed = 0
        try:
            for ops in kept_removals(self.keys, victims):
                self._call(
                    lambda c, ops=ops: c.transaction(compare=[], success=ops, failure=[]), "prune versions"
                )
                removed = min(len(victims), removed + KEPT_PER_TXN)
        except Unavailable as error:
            log.warning("versions of %s/%s before %d are left to the next publish: %s",
                        owner, name, oldest_kept, error)  # fmt: skip
        self.pruned += removed
        # The publisher reads its replica back: the mirror (which the watch, on its own thread,
        # updates) must not show a version pruned by the publish that returned.
        gone = [r.id for r in victims[:removed]]
        if gone and not self.mirror.wait_until(lambda: not any(map(self.mirror.holds, gone)), MIRROR_WAIT_S):
            log.warning("the catalog mirror still shows versions of %s/%s pruned %g s ago",
                        owner, name, MIRROR_WAIT_S)  # fmt: skip
        return removed
