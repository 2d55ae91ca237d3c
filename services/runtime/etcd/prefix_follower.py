"""Follow every key under one etcd prefix: a listing at one revision, then each change after it.

The adapter store's catalog mirror and the gateways' adapter index both follow the catalog's
rows this way, straight from etcd, so a gateway's listings do not depend on any store replica.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import aetcd

from services.runtime.etcd.membership import EtcdConnection

LIST_PAGE_ROWS = 1000
"""Keys per Range call of a listing: a single reply of 10,000 catalog rows is over gRPC's 4 MiB."""


@dataclass(frozen=True)
class ListingPage:
    """Keys of one Range call of a listing, every page read at the same revision."""

    kvs: list[Any]
    """aetcd key-values, in key order."""
    revision: int
    """The revision the whole listing is read at."""
    last: bool
    """The listing's last page: the changes that follow are those after :attr:`revision`."""


async def follow_prefix(conn: EtcdConnection, prefix: str) -> AsyncIterator[ListingPage | Any]:
    """:class:`ListingPage` s of every key under ``prefix`` (one snapshot), then aetcd watch
    events from the next revision on. It ends only by raising (etcd unreachable, the revision
    compacted away, the watch ended): the follower lists again. Use it under
    ``contextlib.aclosing`` so that a follower that stops cancels the watch."""
    start, end = prefix.encode(), prefix_end(prefix)
    revision = 0
    while True:
        request = aetcd.rpc.RangeRequest(key=start, range_end=end, limit=LIST_PAGE_ROWS, revision=revision)
        reply = await conn.call(lambda c, request=request: range_call(c, request))
        revision = revision or reply.header.revision
        yield ListingPage(list(reply.kvs), revision, last=not reply.more)
        if not reply.more:
            break
        start = reply.kvs[-1].key + b"\0"
    watch = await conn.call(lambda c: c.watch_prefix(prefix.encode(), start_revision=revision + 1))
    try:
        async for event in watch:
            yield event
        raise ConnectionError("etcd ended the watch")
    finally:
        with contextlib.suppress(Exception):
            await asyncio.wait_for(watch.cancel(), conn.config.call_timeout_s)


async def range_call(client: aetcd.Client, request: Any) -> Any:
    """One Range call with all of etcd's options (aetcd's ``get_range`` has no limit nor
    revision)."""
    await client.connect()
    return await client.kvstub.Range(request, metadata=client.metadata)


def prefix_end(prefix: str) -> bytes:
    """The end of the key range holding every key that starts with ``prefix``."""
    raw = bytearray(prefix.encode())
    raw[-1] += 1
    return bytes(raw)
