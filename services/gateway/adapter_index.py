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
all in registration order. The store may keep several versions of a name (each its own id):
listings show the newest of each name, and :meth:`AdapterIndex.find` looks up any version it
holds (:mod:`services.gateway.adapter_version`).
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
from services.gateway.adapter_version import VersionSelector, pick_version
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
    version: int = 0
    """The store's version of the name."""
    sha256: str = ""
    """Of its weights."""


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
    """The adapters of one listing and the changes applied to it: every version by id and by
    name; by owner and public, only each name's newest (what a listing shows)."""

    def __init__(self) -> None:
        self.by_id: dict[str, IndexedAdapter] = {}
        self.by_name: dict[tuple[str, str], dict[str, IndexedAdapter]] = {}
        self.by_owner: dict[str, dict[str, IndexedAdapter]] = {}
        self.public: dict[str, IndexedAdapter] = {}

    def upsert(self, entry: IndexedAdapter) -> None:
        self.delete(entry.id)
        self.by_id[entry.id] = entry
        self.by_name.setdefault((entry.owner, entry.name), {})[entry.id] = entry
        self._list_newest(entry.owner, entry.name)

    def delete(self, adapter_id: str) -> None:
        entry = self.by_id.pop(adapter_id, None)
        if entry is None:
            return
        key = (entry.owner, entry.name)
        versions = self.by_name[key]
        del versions[adapter_id]
        self._unlist(entry)
        if versions:
            self._list_newest(*key)
        else:
            del self.by_name[key]

    def _list_newest(self, owner: str, name: str) -> None:
        """List the newest version of ``owner/name`` (by number; of equals, the last received)."""
        versions = self.by_name[(owner, name)].values()
        newest = max(versions, key=lambda e: (e.version, e.order))
        listed = self.by_owner.get(owner, {})
        for other in versions:
            if other is not newest and other.id in listed:
                self._unlist(other)
        if newest.id not in listed:
            self.by_owner.setdefault(owner, {})[newest.id] = newest
            if newest.public:
                self.public[newest.id] = newest

    def _unlist(self, entry: IndexedAdapter) -> None:
        owned = self.by_owner.get(entry.owner, {})
        if owned.pop(entry.id, None) is not None and not owned:
            del self.by_owner[entry.owner]
        self.public.pop(entry.id, None)

    def find(self, owner: str, name: str, selector: VersionSelector, reference: str) -> IndexedAdapter | None:
        return pick_version(self.by_name.get((owner, name), {}).values(), selector, reference)

    def newest(self, owner: str, name: str) -> IndexedAdapter | None:
        versions = self.by_name.get((owner, name))
        return max(versions.values(), key=lambda e: (e.version, e.order)) if versions else None

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
        """Every adapter ``tenant`` may use (its own and every public one, the newest version of
        each name), in registration order."""
        await self._listed()
        return list(self._contents.usable(tenant))

    async def find(
        self, owner: str, name: str, selector: VersionSelector, reference: str
    ) -> IndexedAdapter | None:
        """The version of ``owner/name`` that ``selector`` asks for, None when the index holds no
        such version; InvalidArgument naming ``reference`` for an ambiguous digest prefix."""
        await self._listed()
        return self._contents.find(owner, name, selector, reference)

    def newest(self, owner: str, name: str) -> IndexedAdapter | None:
        """The newest version of ``owner/name`` the index holds now (None: none, or no listing
        yet); never waits."""
        return self._contents.newest(owner, name) if self._synced.is_set() else None

    async def _listed(self) -> None:
        """Until a first listing is complete; UNAVAILABLE past ``first_listing_s``."""
        self.start()
        if not self._synced.is_set():
            try:
                await asyncio.wait_for(self._synced.wait(), self._timeouts.first_listing_s)
            except TimeoutError:
                raise Unavailable("the gateway has not listed the adapter store's adapters yet") from None

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
            version=info.version,
            sha256=info.sha256,
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
