"""The catalog as of one etcd revision, held in memory: every read of a replica is served from
it, so reads go on while etcd is unreachable, and a listing never costs an etcd range.

Pure domain code: it knows nothing of etcd; :mod:`.catalog` feeds it the rows it lists and the
events it watches, in revision order.

A name may have several rows: the version it serves (its highest) and the older versions kept
after it (:mod:`.version_retention`). Lookups by id find every row; lookups by name, listings,
counts and pins see only the serving versions.
"""

from __future__ import annotations

import bisect
import threading
from collections.abc import Callable, Iterable

from services.adapter_store.adapter_record import PUBLIC, AdapterRecord
from services.adapter_store.catalog_changes import CatalogChange, CatalogChanges
from services.adapter_store.catalog_keys import record_digests

Seq = tuple[int, str]
"""Where a row stands in registration order: its key's create revision, then its id (the rows a
transaction commits together share one revision)."""


MIRROR_WAIT_S = 10.0
"""How long a write waits for the replica's own mirror to show it before returning anyway."""


class CatalogMirror:
    """Thread-safe: one thread applies, any thread reads or waits for a revision."""

    def __init__(self, changes: CatalogChanges | None = None) -> None:
        """``changes``: where each change is published, in the order it is applied (under the
        mirror's lock: the watch and a replica's own writes apply from different threads)."""
        self._changes = changes
        self._records: dict[str, tuple[Seq, AdapterRecord]] = {}
        self._by_name: dict[tuple[str, str], str] = {}
        """The serving version's id of each name."""
        self._versions: dict[tuple[str, str], set[str]] = {}
        """Every row's id of each name, kept versions included."""
        self._seqs: list[Seq] = []
        self._digests: dict[str, frozenset[str]] = {}
        self.revision = 0
        """The etcd revision the watch has brought the mirror to (a replica's own writes
        applied ahead of it do not move it)."""
        self._changed = threading.Condition(threading.RLock())

    def replace(self, rows: Iterable[tuple[int, AdapterRecord]], revision: int) -> list[CatalogChange]:
        """Take ``rows`` (``(create revision, record)``, a full listing at ``revision``) as the whole
        catalog; returns the changes from what was held before."""
        rows = list(rows)
        with self._changed:
            listed = {record.id for _, record in rows}
            changes = [
                self._remove(adapter_id) for adapter_id in list(self._records) if adapter_id not in listed
            ]
            changes += [self._upsert(seq, record) for seq, record in rows]
            self._advance(revision)
            return self._publish(changes)

    def apply_own(self, committed: int, record: AdapterRecord, replaced: str = "") -> list[CatalogChange]:
        """A registration this replica committed at revision ``committed`` (in place of row
        ``replaced``), applied before the watch delivers it, so the writer reads it back at once
        without waiting for the watch. Nothing when the watch is already past it: it applied the
        registration, and maybe later changes of that row, itself. At ``committed`` itself the watch
        may be between the transaction's events (the replaced row's delete applied, the new row's
        put not yet), so both are applied here too: neither changes what the watch applied. The
        watch's own delivery of it later changes nothing either (:meth:`upsert` of an equal record
        and :meth:`remove` of a row not held are no change)."""
        with self._changed:
            if self.revision > committed:
                return []
            changes = [self._remove(replaced)] if replaced else []
            changes.append(self._upsert(committed, record))
            self._changed.notify_all()
            return self._publish(changes)

    def upsert(self, created: int, record: AdapterRecord, revision: int) -> CatalogChange | None:
        """``created``: the create revision of the record's row; None when the mirror held the
        very same record (applied by :meth:`apply_own`)."""
        with self._changed:
            change = self._upsert(created, record)
            self._advance(revision)
            self._publish([change])
        return change

    def remove(self, adapter_id: str, revision: int) -> CatalogChange | None:
        with self._changed:
            change = self._remove(adapter_id)
            self._advance(revision)
            self._publish([change])
        return change

    def advance(self, revision: int) -> None:
        """The mirror is current as of ``revision`` (nothing of the catalog changed up to it)."""
        with self._changed:
            self._advance(revision)

    def wait_until(self, shows: Callable[[], bool], timeout_s: float) -> bool:
        """Block until ``shows()`` (called with the mirror locked, so it sees a whole change) is
        true; False when ``timeout_s`` passed first. A write waits so for the watch to deliver
        it: every event of one transaction carries the same revision, so the revision alone does
        not say when the last of them has been applied."""
        with self._changed:
            return self._changed.wait_for(shows, timeout_s)

    def _publish(self, changes: list[CatalogChange | None]) -> list[CatalogChange]:
        made = [change for change in changes if change is not None]
        if self._changes is not None:
            for change in made:
                self._changes.publish(change)
        return made

    def _advance(self, revision: int) -> None:
        self.revision = max(self.revision, revision)
        self._changed.notify_all()

    def _upsert(self, created: int, record: AdapterRecord) -> CatalogChange | None:
        held = self._records.get(record.id)
        if held is not None and held[1] == record:
            return None
        if held is None:
            seq = (created, record.id)
            bisect.insort(self._seqs, seq)
        else:
            seq = held[0]
        self._records[record.id] = (seq, record)
        name = (record.owner, record.name)
        self._versions.setdefault(name, set()).add(record.id)
        serving = self._records.get(self._by_name.get(name, ""))
        if serving is None or serving[1].version <= record.version:
            self._by_name[name] = record.id
        self._digests[record.id] = frozenset(record_digests(record).values())
        return CatalogChange(upserted=record)

    def _remove(self, adapter_id: str) -> CatalogChange | None:
        held = self._records.pop(adapter_id, None)
        if held is None:
            return None
        seq, record = held
        del self._seqs[bisect.bisect_left(self._seqs, seq)]
        del self._digests[adapter_id]
        name = (record.owner, record.name)
        self._versions[name].discard(adapter_id)
        if not self._versions[name]:
            del self._versions[name]
        # No older version takes over: a name's serving row goes only when the name is deleted
        # (its kept versions with it), and a prune removes only kept versions.
        if self._by_name.get(name) == adapter_id:
            del self._by_name[name]
        return CatalogChange(deleted_id=adapter_id)

    def holds(self, adapter_id: str) -> bool:
        """Whether a row of ``adapter_id`` is held (for :meth:`wait_until`'s ``shows``)."""
        return adapter_id in self._records

    def get(self, adapter_id: str) -> AdapterRecord | None:
        with self._changed:
            held = self._records.get(adapter_id)
        return held[1] if held else None

    def get_by_name(self, owner: str, name: str) -> AdapterRecord | None:
        with self._changed:
            adapter_id = self._by_name.get((owner, name))
            held = self._records.get(adapter_id) if adapter_id else None
        return held[1] if held else None

    def page(
        self, owner: str | None, include_public: bool, after_seq: Seq, limit: int, kept: bool = False
    ) -> tuple[list[tuple[Seq, AdapterRecord]], int]:
        """``(seq, record)`` pairs after ``after_seq`` in registration order, and the total
        matching: every adapter, or ``owner``'s (and the public ones with ``include_public``);
        the serving versions, and the kept ones too with ``kept``."""

        def matches(record: AdapterRecord) -> bool:
            if not kept and not self._serves(record):
                return False
            if not owner:
                return True
            return record.owner == owner or (include_public and record.visibility == PUBLIC)

        with self._changed:
            if owner:
                total = sum(1 for _, record in self._records.values() if matches(record))
            else:
                total = len(self._records) if kept else len(self._by_name)
            page: list[tuple[int, AdapterRecord]] = []
            for seq in self._seqs[bisect.bisect_right(self._seqs, after_seq) :]:
                record = self._records[seq[1]][1]
                if matches(record):
                    page.append((seq, record))
                    if len(page) == limit:
                        break
        return page, total

    def _serves(self, record: AdapterRecord) -> bool:
        return self._by_name.get((record.owner, record.name)) == record.id

    def all(self) -> list[AdapterRecord]:
        """Every serving version, in registration order."""
        with self._changed:
            records = (self._records[adapter_id][1] for _, adapter_id in self._seqs)
            return [record for record in records if self._serves(record)]

    def versions(self, owner: str, name: str) -> list[AdapterRecord]:
        """Every row of ``owner``'s ``name``, the serving version's and the kept ones, oldest
        first."""
        with self._changed:
            records = [self._records[i][1] for i in self._versions.get((owner, name), ())]
        return sorted(records, key=lambda record: record.version)

    def count(self) -> int:
        """Serving versions."""
        with self._changed:
            return len(self._by_name)

    def pinned_sizes(self) -> dict[str, int]:
        """``{id: size_bytes}`` of every pinned adapter (a kept version is not: a pin is its
        name's serving version's)."""
        with self._changed:
            return {r.id: r.size_bytes for _, r in self._records.values() if r.pinned and self._serves(r)}

    def referenced_digests(self) -> set[str]:
        """Every blob some row references."""
        with self._changed:
            return set().union(*self._digests.values()) if self._digests else set()
