"""What a tenant stores: its adapters and their bytes, as etcd holds them across every replica.

Each catalog row has a usage entry, ``usage/<owner>/<id>`` holding the bytes the row stores
(:func:`stored_bytes`), written and deleted in the very transaction that commits or removes the
row (:mod:`.catalog`), so an owner's entries always are its adapters. A registration under a
quota reads its owner's entries (:class:`StorageUsage`) and commits only if no entry was created
since (``Create(usage/<owner>/…) < newest + 1``): of two replicas taking the owner's last slot at
once, the second finds the first's entry, reads again and is refused. Entries are one per row
rather than one running total per owner, so registrations of owners without a quota never
contend for a key, and a catalog written before entries existed is brought in row by row
(:meth:`.catalog.Catalog.reconcile_usage`); removals need no check (they only free room).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from services.adapter_store.adapter_record import AdapterRecord


def stored_bytes(record: AdapterRecord) -> int:
    """Bytes ``record`` stores for its owner: its weights, config and chat templates (as many
    as the blobs hold, each counted for every adapter naming it)."""
    texts = (record.config_json, record.chat_template, record.tool_use_chat_template)
    return record.size_bytes + sum(len(text.encode("utf-8")) for text in texts)


@dataclass(frozen=True)
class StorageUsage:
    """An owner's usage entries as one read found them."""

    adapters: int = 0
    bytes: int = 0
    newest: int = 0
    """The largest create revision among the entries (0: none): a commit under a quota requires
    that no entry newer than this exists."""

    @classmethod
    def of_entries(cls, entries: Iterable[tuple[bytes, int]]) -> StorageUsage:
        """From ``(value, create revision)`` of each of an owner's entries."""
        adapters = total = newest = 0
        for value, created in entries:
            adapters += 1
            total += int(value)
            newest = max(newest, created)
        return cls(adapters, total, newest)

    def plus(self, adapters: int, added_bytes: int) -> StorageUsage:
        """The usage with ``adapters`` and ``added_bytes`` more (either may be negative)."""
        return StorageUsage(self.adapters + adapters, self.bytes + added_bytes, self.newest)
