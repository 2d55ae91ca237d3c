"""What lease an etcd key lives under, for tests that check expiry by the lease rather than a stopwatch."""

from __future__ import annotations

from dataclasses import dataclass

import aetcd


@dataclass(frozen=True)
class KeyLease:
    lease_id: int
    """0 when the key has no lease (it would never expire)."""
    granted_ttl_s: int
    """The TTL the lease was granted with: etcd deletes the key this long after the last refresh."""


async def key_lease(endpoint: str, key: str) -> KeyLease | None:
    """The lease of ``key`` on the etcd at ``host:port``; None when the key does not exist."""
    host, port = endpoint.removeprefix("http://").rsplit(":", 1)
    async with aetcd.Client(host=host, port=int(port), timeout=30) as client:
        got = await client.get(key.encode())
        if got is None:
            return None
        if not got.lease:
            return KeyLease(0, 0)
        info = await client.get_lease_info(got.lease, keys=False)
        return KeyLease(got.lease, info.grantedTTL)


async def lease_alive(endpoint: str, lease_id: int) -> bool:
    """Whether etcd still holds ``lease_id`` (an expired or revoked lease reports TTL -1)."""
    host, port = endpoint.removeprefix("http://").rsplit(":", 1)
    async with aetcd.Client(host=host, port=int(port), timeout=30) as client:
        return (await client.get_lease_info(lease_id, keys=False)).TTL >= 0
