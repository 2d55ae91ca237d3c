"""The gateway's one adapter catalog: which adapter a tenant means by ``name`` or
``owner/name``, whether it may use it, and which adapters it may list.

An adapter is private to its owner unless public. Another tenant's private adapter is
indistinguishable from a missing one: NOT_FOUND, with the adapter store's own message for a
missing adapter (:func:`~services.gateway.adapter_reference.missing_adapter`); listings never
show it.

Two views of the store's catalog, kept coherent here: the store's answers to lookups by name
(they carry what a request needs, chat templates included), cached for a couple of seconds, and
the index of every adapter fed by the store's catalog watch (:mod:`services.gateway.adapter_index`,
what listings read). Each change the watch brings drops the cached answer for its name, so a
registration or delete made anywhere shows in lookups as soon as in listings.

A reference may name one version (``name@N``, ``name@sha256:<hex>``,
:mod:`services.gateway.adapter_version`): the index says which id that version has (or, when it
does not hold it yet, the store's answer for the name does, if that is the version asked for),
and the store is asked for that id. ``name`` is never resolved to a version older than the
newest the index holds: a publish made through this gateway (which waits until the index shows
it) serves every request admitted after it returns, whichever store replica answers.
"""

from __future__ import annotations

import time
from typing import Protocol

import grpc

from mesh_api.v1 import adapter_store_pb2, types_pb2
from services.gateway.adapter_index import AdapterIndex, CatalogWatch, IndexedAdapter, IndexTimeouts
from services.gateway.adapter_reference import ResolvedAdapter, missing_adapter, split_reference
from services.gateway.adapter_version import LATEST, VersionSelector, missing_version, split_version
from services.runtime.errors import NotFound, PermissionDenied
from services.runtime.eviction import EvictionPolicy, LRUEviction


class CatalogStore(CatalogWatch, Protocol):
    """The adapter store's reads the catalog makes."""

    async def get(self, owner: str, name: str) -> types_pb2.AdapterInfo:
        """The adapter ``owner`` registered as ``name`` (its newest version); raises NotFound."""
        ...

    async def get_id(self, adapter_id: str) -> types_pb2.AdapterInfo:
        """The adapter (one version of a name) of id ``adapter_id``; raises NotFound."""
        ...

    async def ListAdapters(
        self, request: adapter_store_pb2.ListAdaptersRequest
    ) -> adapter_store_pb2.ListAdaptersResponse: ...


def may_use(tenant: str, info: types_pb2.AdapterInfo) -> bool:
    return info.owner == tenant or info.visibility == types_pb2.VISIBILITY_PUBLIC


def _not_found(error: Exception) -> bool:
    """``error`` is the store's NOT_FOUND: its own client raises it as the status it came with."""
    if isinstance(error, grpc.aio.AioRpcError):
        return error.code() == grpc.StatusCode.NOT_FOUND
    return isinstance(error, NotFound)


DEFAULT_MAX_ENTRIES = 4096
"""Lookups cached at most by default: far more than a gateway resolves within a TTL."""


class AdapterCatalog:
    """Resolves references with a short-lived cache of the store's answers, bounded in entries:
    with 10,000 adapters and more, an unbounded cache would keep one answer per adapter ever
    asked for. Past ``max_entries`` the least recently used tenth goes at once, so the
    eviction policy's pass over the keys is paid once per that many misses, not per miss.

    Lists from the watched index; :meth:`start` it on the event loop (the first listing does too).
    """

    def __init__(
        self,
        store: CatalogStore,
        ttl_s: float = 2.0,
        max_entries: int = DEFAULT_MAX_ENTRIES,
        eviction: EvictionPolicy | None = None,
        timeouts: IndexTimeouts | None = None,
    ):
        """``eviction``: which cached lookups go first (default least recently used);
        ``timeouts``: the watched index's (default :class:`IndexTimeouts`)."""
        if max_entries < 1:
            raise ValueError(f"max_entries must be at least 1, got {max_entries}")
        self._store = store
        self._ttl_s = ttl_s
        self._max_entries = max_entries
        self._keep = max_entries - max_entries // 10
        """Entries left after a trim."""
        self._eviction = eviction or LRUEviction()
        self._cache: dict[tuple[str, str, VersionSelector], tuple[float, types_pb2.AdapterInfo]] = {}
        self._versioned: dict[tuple[str, str], set[VersionSelector]] = {}
        """The selectors other than LATEST cached per name, which a change of the name drops too."""
        self._index = AdapterIndex(store, timeouts or IndexTimeouts(), on_change=self.forget)

    # -- one adapter --------------------------------------------------------------------------

    async def resolve(self, tenant: str, reference: str) -> ResolvedAdapter | None:
        """The adapter ``reference`` names for ``tenant``, None for "" (the base model);
        NotFound otherwise (another tenant's private adapter included, as if it did not exist)."""
        return ResolvedAdapter.of(await self.info(tenant, reference)) if reference else None

    async def info(self, tenant: str, reference: str) -> types_pb2.AdapterInfo:
        """All the store says of the adapter ``reference`` names for ``tenant``; NotFound as
        :meth:`resolve`, naming the version when the name has none such."""
        name_part, selector = split_version(reference)
        owner, name = split_reference(tenant, name_part)
        key = (owner, name, selector)
        cached = self._cache.get(key)
        if cached is not None and time.monotonic() - cached[0] < self._ttl_s:
            info = cached[1]
        else:
            info = await self._lookup(owner, name, selector, reference)
            self._cache[key] = (time.monotonic(), info)
            if not selector.latest:
                self._versioned.setdefault((owner, name), set()).add(selector)
        if selector.latest and (newer := self._index.newest(owner, name)) and newer.version > info.version:
            # The watch has brought a newer version than the store answered (another store
            # replica's mirror behind) or than was cached: never serve older than the index.
            info = await self._store.get_id(newer.id)
            self._cache[key] = (time.monotonic(), info)
        self._eviction.touch(key)
        if len(self._cache) > self._max_entries:
            self._trim()
        if not may_use(tenant, info):
            raise missing_adapter(owner, name)
        return info

    async def _lookup(
        self, owner: str, name: str, selector: VersionSelector, reference: str
    ) -> types_pb2.AdapterInfo:
        if selector.latest:
            return await self._store.get(owner, name)
        indexed = await self._index.find(owner, name, selector, reference)
        try:
            if indexed is not None:
                return await self._store.get_id(indexed.id)
            # Not in the index (yet: a version committed a moment ago, or no such version). The
            # store's newest version of the name is the one a version just published would be.
            newest = await self._store.get(owner, name)
        except (NotFound, grpc.aio.AioRpcError) as error:
            if not _not_found(error):
                raise
            raise missing_version(owner, name, selector) from None
        if not selector.matches(newest.version, newest.sha256):
            raise missing_version(owner, name, selector)
        return newest

    async def registered(self, tenant: str, name: str) -> bool:
        """Whether ``tenant`` has an adapter of its own named ``name``, as the store says now."""
        try:
            await self._store.get(tenant, name)
        except (NotFound, grpc.aio.AioRpcError) as error:
            if not _not_found(error):
                raise
            return False
        return True

    def forget(self, owner: str, name: str) -> None:
        """Drop the cached lookups of ``owner/name`` (any version): it changed."""
        for selector in (LATEST, *self._versioned.pop((owner, name), ())):
            self._cache.pop((owner, name, selector), None)
            self._eviction.remove((owner, name, selector))

    def __len__(self) -> int:
        """Lookups cached."""
        return len(self._cache)

    def _trim(self) -> None:
        for key in self._eviction.victims(list(self._cache)):
            if len(self._cache) <= self._keep:
                break
            del self._cache[key]
            self._eviction.remove(key)
            if not key[2].latest:
                self._versioned.get(key[:2], set()).discard(key[2])

    # -- listings -----------------------------------------------------------------------------

    async def usable(self, tenant: str) -> list[IndexedAdapter]:
        """Every adapter ``tenant`` may use: its own and every public one, in registration order,
        from the watched index (not asked of the store per call)."""
        return await self._index.usable(tenant)

    async def page(
        self, tenant: str, request: adapter_store_pb2.ListAdaptersRequest
    ) -> adapter_store_pb2.ListAdaptersResponse:
        """One page of ``tenant``'s adapters and the public ones, as the store pages them."""
        if request.owner and request.owner != tenant:
            raise PermissionDenied("a tenant may list only its own adapters (and public ones)")
        forwarded = adapter_store_pb2.ListAdaptersRequest()
        forwarded.CopyFrom(request)
        forwarded.owner, forwarded.include_public = tenant, True
        return await self._store.ListAdapters(forwarded)

    async def shows(self, adapter_id: str, present: bool) -> None:
        """Until listings show (``present``) or no longer show ``adapter_id``, briefly: a write
        made through this gateway is read back by its own caller."""
        await self._index.wait_for(adapter_id, present)

    def start(self) -> None:
        """Start watching the store's catalog (once; later calls do nothing)."""
        self._index.start()

    async def stop(self) -> None:
        await self._index.stop()
