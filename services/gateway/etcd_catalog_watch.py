"""The adapter catalog watched straight from etcd, where the store replicas commit it: the
gateway's index (:mod:`services.gateway.adapter_index`) then lists adapters while every store
replica is down, and follows each commit as soon as etcd has it, whichever replica made it.

Each listing page and each batch of row changes is handed to the index as the message a store's
``WatchAdapters`` stream would send: one format for both sources, so a gateway without etcd (a
fixed ``--adapter-store`` address) still watches through the store.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator, Iterator

import aetcd

from mesh_api.v1 import adapter_store_pb2, types_pb2
from services.runtime.etcd.adapter_catalog_rows import catalog_rows
from services.runtime.etcd.membership import EtcdConnection, MembershipConfig
from services.runtime.etcd.prefix_follower import ListingPage, follow_prefix

LISTING_MESSAGE_ROWS = 1000
"""Rows per message handed to the index while it takes a listing."""


class EtcdCatalogWatch:
    """A :class:`~services.gateway.adapter_index.CatalogWatch` over the catalog's rows in etcd."""

    def __init__(self, config: MembershipConfig):
        self._conn = EtcdConnection(config)
        self._rows = catalog_rows(config.key_prefix)

    async def watch(self, refresh: bool) -> AsyncIterator[adapter_store_pb2.WatchAdaptersResponse]:
        """``refresh``: the last watch broke; dial etcd afresh (the next endpoint)."""
        if refresh:
            await self._conn.reset()
        listing: list = []
        async with contextlib.aclosing(follow_prefix(self._conn, self._rows)) as updates:
            async for update in updates:
                if isinstance(update, ListingPage):
                    listing += update.kvs
                    if update.last:
                        for message in _listing_messages(listing):
                            yield message
                        listing = []
                elif update.kind == aetcd.EventKind.PUT:
                    yield adapter_store_pb2.WatchAdaptersResponse(
                        upserted=[row_info(update.kv.value)], synced=True
                    )
                else:
                    deleted = update.kv.key.decode()[len(self._rows) :]
                    yield adapter_store_pb2.WatchAdaptersResponse(deleted_ids=[deleted], synced=True)

    async def close(self) -> None:
        await self._conn.close()


def _listing_messages(kvs: list) -> Iterator[adapter_store_pb2.WatchAdaptersResponse]:
    """A whole listing in registration order (a row's create revision, then its key, as the
    store orders it), in messages of :data:`LISTING_MESSAGE_ROWS`; the last says it is synced."""
    kvs = sorted(kvs, key=lambda kv: (kv.create_revision, kv.key))
    for start in range(0, len(kvs), LISTING_MESSAGE_ROWS) or [0]:
        page = kvs[start : start + LISTING_MESSAGE_ROWS]
        yield adapter_store_pb2.WatchAdaptersResponse(
            upserted=[row_info(kv.value) for kv in page], synced=start + LISTING_MESSAGE_ROWS >= len(kvs)
        )


def row_info(raw: bytes) -> types_pb2.AdapterInfo:
    """What a listing shows of a catalog row (:mod:`services.runtime.etcd.adapter_catalog_rows`)."""
    row = json.loads(raw)
    return types_pb2.AdapterInfo(
        id=row["id"],
        owner=row["owner"],
        name=row["name"],
        visibility=row["visibility"],
        base_model=row["base_model"],
        max_rank=row["max_rank"],
        created_unix_ms=row["created_ms"],
        version=row["version"],
        sha256=row["sha256"],
    )
