"""Every adapter the store holds, kept in the gateway by watching the store's catalog: what
``/v1/models`` and ``ListModels`` list, without asking the store on each call. The listing half
of the gateway's adapter catalog (:mod:`services.gateway.adapter_catalog`).

OpenAI clients do not page, so ``/v1/models`` lists every adapter a tenant may use. Paging them
out of the store on every call cost one round trip per thousand adapters; instead the index
lists the catalog once and then applies each change as it commits (from etcd,
:mod:`services.gateway.etcd_catalog_watch`, or a store's ``WatchAdapters``), so it follows
registrations and deletions made through any gateway, the CLI or an import. A watch that breaks is opened again and listed afresh; meanwhile the last copy keeps
serving. A register or delete made through this gateway waits (briefly) until the index shows
it, so its own caller reads its write.

Each adapter is kept as a small :class:`IndexedAdapter`, by id and by owner, public ones apart,
all in registration order.
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import itertools
import logging
import sys
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from typing import Protocol

from mesh_api.v1 import adapter_store_pb2, types_pb2
from services.runtime.errors import Unavailable

log = logging.getLogger("loramesh.gateway")


@dataclass(frozen=True, slots=True)
class IndexedAdapter:
    """What a listing shows of one adapter."""

    id: str
    owner: str
    name: str
    public: bool
    base_model: str
    max_rank: int
    created_s: int
    """Registration time, seconds since the epoch."""
    order: int
    """Position in registration order, as the index received it."""


class CatalogWatch(Protocol):
    """The catalog as ``WatchAdapters`` messages: a listing, then changes; ``refresh``: the last
    watch broke, reach the source afresh."""

    def watch(self, refresh: bool) -> AsyncIterator[adapter_store_pb2.WatchAdaptersResponse]: ...


@dataclass(frozen=True)
class IndexTimeouts:
    """How long the index waits, in seconds."""

    first_listing_s: float = 30.0
    """For the first listing, before a listing is refused UNAVAILABLE."""
    own_write_s: float = 10.0
    """For a change made through this gateway to show, before its reply goes anyway."""
    retry_s: float = 1.0
    """Between a broken watch and the next one."""


class _Contents:
    """The adapters of one listing and the changes applied to it."""

    def __init__(self) -> None:
        self.by_id: dict[str, IndexedAdapter] = {}
        self.by_owner: dict[str, dict[str, IndexedAdapter]] = {}
        self.public: dict[str, IndexedAdapter] = {}

    def upsert(self, entry: IndexedAdapter) -> None:
        self.delete(entry.id)
        self.by_id[entry.id] = entry
        self.by_owner.setdefault(entry.owner, {})[entry.id] = entry
        if entry.public:
            self.public[entry.id] = entry

    def delete(self, adapter_id: str) -> None:
        entry = self.by_id.pop(adapter_id, None)
        if entry is None:
            return
        owned = self.by_owner[entry.owner]
        del owned[adapter_id]
        if not owned:
            del self.by_owner[entry.owner]
        self.public.pop(adapter_id, None)

    def usable(self, tenant: str) -> Iterator[IndexedAdapter]:
        """``tenant``'s own adapters and every public one, in registration order."""
        own = self.by_owner.get(tenant, {}).values()
        others = (e for e in self.public.values() if e.owner != tenant)
        return heapq.merge(own, others, key=lambda e: e.order)


class AdapterIndex:
    """The catalog as the store last published it; call :meth:`start` on the event loop."""

    def __init__(
        self,
        store: CatalogWatch,
        timeouts: IndexTimeouts = IndexTimeouts(),
        on_change: Callable[[str, str], None] | None = None,
    ):
        """``on_change``: told ``(owner, name)`` of each adapter the watch registers or deletes."""
        self._store = store
        self._timeouts = timeouts
        self._on_change = on_change
        self._contents = _Contents()
        self._listing: _Contents | None = None
        """A listing being received: it replaces the contents once complete."""
        self._order = itertools.count()
        self._synced = asyncio.Event()
        self._live = False
        """A watch is open and its listing complete: changes arrive as they commit."""
        self._changed = asyncio.Event()
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        """Start watching (once; later calls do nothing)."""
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._watch(), name="adapter-index")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    async def usable(self, tenant: str) -> list[IndexedAdapter]:
        """Every adapter ``tenant`` may use (its own and every public one), in registration order."""
        self.start()
        if not self._synced.is_set():
            try:
                await asyncio.wait_for(self._synced.wait(), self._timeouts.first_listing_s)
            except TimeoutError:
                raise Unavailable("the gateway has not listed the adapter store's adapters yet") from None
        return list(self._contents.usable(tenant))

    async def wait_for(self, adapter_id: str, present: bool) -> None:
        """Until the index has (``present``) or no longer has ``adapter_id``, for at most
        ``IndexTimeouts.own_write_s``; at once when no watch is live."""
        deadline = asyncio.get_running_loop().time() + self._timeouts.own_write_s
        while self._live and (adapter_id in self._contents.by_id) != present:
            changed = self._changed
            remaining = deadline - asyncio.get_running_loop().time()
            if remaining <= 0:
                return
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(changed.wait(), remaining)

    def _apply(self, message: adapter_store_pb2.WatchAdaptersResponse) -> None:
        """One message of a watch: part of its first listing, or changes after it."""
        target = self._listing if self._listing is not None else self._contents
        names = [(info.owner, info.name) for info in message.upserted]
        for info in message.upserted:
            target.upsert(self._entry(info, target.by_id.get(info.id)))
        for adapter_id in message.deleted_ids:
            if (entry := target.by_id.get(adapter_id)) is not None:
                names.append((entry.owner, entry.name))
            target.delete(adapter_id)
        if self._on_change is not None:
            for owner, name in names:
                self._on_change(owner, name)
        if message.synced and self._listing is not None:
            self._contents, self._listing = self._listing, None
            self._live = True
            self._synced.set()
        if target is self._contents:
            self._changed.set()
            self._changed = asyncio.Event()

    def _begin_listing(self) -> None:
        self._listing = _Contents()
        self._live = False

    def _entry(self, info: types_pb2.AdapterInfo, known: IndexedAdapter | None) -> IndexedAdapter:
        """``known``: the index's entry of the same id, whose place in the order it keeps. Owner
        and base model names are interned: one copy however many adapters share one."""
        return IndexedAdapter(
            id=info.id,
            owner=sys.intern(info.owner),
            name=info.name,
            public=info.visibility == types_pb2.VISIBILITY_PUBLIC,
            base_model=sys.intern(info.base_model),
            max_rank=info.max_rank,
            created_s=info.created_unix_ms // 1000,
            order=known.order if known else next(self._order),
        )

    async def _watch(self) -> None:
        refresh = False
        while True:
            try:
                self._begin_listing()
                async for message in self._store.watch(refresh):
                    self._apply(message)
                log.info("the adapter store ended its catalog watch: watching again")
            except Exception as error:  # noqa: BLE001 - any failure (store gone, etcd): list again
                log.warning("catalog watch broke (%s): listing again in %ss", error, self._timeouts.retry_s)
            self._live = False
            refresh = True
            await asyncio.sleep(self._timeouts.retry_s)
