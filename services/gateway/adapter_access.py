"""Which adapter a tenant means by ``name`` or ``owner/name``, and whether it may use it.

An adapter is private to its owner unless public. Another tenant's private adapter is
indistinguishable from a missing one: NOT_FOUND, with the adapter store's own message for a
missing adapter (:func:`missing_adapter`); listings never show it.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable

from mesh_api.v1 import types_pb2
from services.runtime.errors import InvalidArgument, NotFound
from services.runtime.eviction import EvictionPolicy, LRUEviction

Lookup = Callable[[str, str], Awaitable[types_pb2.AdapterInfo]]
"""``(owner, name) -> AdapterInfo`` from the adapter store; raises NotFound."""


def split_reference(tenant: str, reference: str) -> tuple[str, str]:
    owner, sep, name = reference.partition("/")
    if not sep:
        return tenant, reference
    if not owner or not name or "/" in name:
        raise InvalidArgument(f"adapter {reference!r} must be 'name' or 'owner/name'")
    return owner, name


def missing_adapter(owner: str, name: str) -> NotFound:
    """What the adapter store answers for a name it does not have
    (services/adapter_store/repository.py), word for word."""
    return NotFound(f"adapter {name!r} of owner {owner!r} not found")


def may_use(tenant: str, info: types_pb2.AdapterInfo) -> bool:
    return info.owner == tenant or info.visibility == types_pb2.VISIBILITY_PUBLIC


DEFAULT_MAX_ENTRIES = 4096
"""References cached at most by default: far more than a gateway resolves within a TTL."""


class AdapterAccess:
    """Resolves references with a short-lived cache of the store's answers, bounded in entries:
    with 10,000 adapters and more, an unbounded cache would keep one answer per adapter ever
    asked for. Past ``max_entries`` the least recently used tenth goes at once, so the
    eviction policy's pass over the keys is paid once per that many misses, not per miss."""

    def __init__(
        self,
        lookup: Lookup,
        ttl_s: float = 2.0,
        max_entries: int = DEFAULT_MAX_ENTRIES,
        eviction: EvictionPolicy | None = None,
    ):
        """``eviction``: which entries go first (default least recently used)."""
        if max_entries < 1:
            raise ValueError(f"max_entries must be at least 1, got {max_entries}")
        self._lookup = lookup
        self._ttl_s = ttl_s
        self._max_entries = max_entries
        self._keep = max_entries - max_entries // 10
        """Entries left after a trim."""
        self._eviction = eviction or LRUEviction()
        self._cache: dict[tuple[str, str], tuple[float, types_pb2.AdapterInfo]] = {}

    async def resolve(self, tenant: str, reference: str) -> types_pb2.AdapterInfo:
        """The adapter ``reference`` names for ``tenant``; NotFound otherwise (another tenant's
        private adapter included, as if it did not exist)."""
        key = split_reference(tenant, reference)
        cached = self._cache.get(key)
        if cached is not None and time.monotonic() - cached[0] < self._ttl_s:
            info = cached[1]
        else:
            info = await self._lookup(*key)
            self._cache[key] = (time.monotonic(), info)
        self._eviction.touch(key)
        if len(self._cache) > self._max_entries:
            self._trim()
        if not may_use(tenant, info):
            raise missing_adapter(*key)
        return info

    def forget(self, owner: str, name: str) -> None:
        self._cache.pop((owner, name), None)
        self._eviction.remove((owner, name))

    def __len__(self) -> int:
        return len(self._cache)

    def _trim(self) -> None:
        for key in self._eviction.victims(list(self._cache)):
            if len(self._cache) <= self._keep:
                break
            del self._cache[key]
            self._eviction.remove(key)
