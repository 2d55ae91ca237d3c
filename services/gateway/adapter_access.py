"""Which adapter a tenant means by ``name`` or ``owner/name``, and whether it may use it.

An adapter is private to its owner unless public. Another tenant's private adapter is reported
as PERMISSION_DENIED when named explicitly; listings never show it.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable

from mesh_api.v1 import types_pb2
from services.runtime.errors import InvalidArgument, PermissionDenied

Lookup = Callable[[str, str], Awaitable[types_pb2.AdapterInfo]]
"""``(owner, name) -> AdapterInfo`` from the adapter store; raises NotFound."""


def split_reference(tenant: str, reference: str) -> tuple[str, str]:
    owner, sep, name = reference.partition("/")
    if not sep:
        return tenant, reference
    if not owner or not name or "/" in name:
        raise InvalidArgument(f"adapter {reference!r} must be 'name' or 'owner/name'")
    return owner, name


def may_use(tenant: str, info: types_pb2.AdapterInfo) -> bool:
    return info.owner == tenant or info.visibility == types_pb2.VISIBILITY_PUBLIC


class AdapterAccess:
    """Resolves references with a short-lived cache of the store's answers."""

    def __init__(self, lookup: Lookup, ttl_s: float = 2.0):
        self._lookup = lookup
        self._ttl_s = ttl_s
        self._cache: dict[tuple[str, str], tuple[float, types_pb2.AdapterInfo]] = {}

    async def resolve(self, tenant: str, reference: str) -> types_pb2.AdapterInfo:
        """The adapter ``reference`` names for ``tenant``; NotFound or PermissionDenied otherwise."""
        key = split_reference(tenant, reference)
        cached = self._cache.get(key)
        if cached is not None and time.monotonic() - cached[0] < self._ttl_s:
            info = cached[1]
        else:
            info = await self._lookup(*key)
            self._cache[key] = (time.monotonic(), info)
        if not may_use(tenant, info):
            raise PermissionDenied(f"adapter {reference!r} is private to tenant {info.owner!r}")
        return info

    def forget(self, owner: str, name: str) -> None:
        self._cache.pop((owner, name), None)
