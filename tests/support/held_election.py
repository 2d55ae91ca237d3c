"""Holding a leader election where a partition or a pause would: its rounds held back, its key's
lease revoked behind its back (tests of leader fencing, issue 49)."""

from __future__ import annotations

import asyncio

import aetcd
from support.etcd_lease import key_lease


class HeldRounds:
    """An election's wait between rounds (``LeaderElection(sleep=...)``), held until released:
    meanwhile the candidate keeps what its last round told it, as a paused or partitioned
    process does."""

    def __init__(self) -> None:
        self.released = asyncio.Event()

    async def __call__(self, seconds: float) -> None:
        await self.released.wait()
        await asyncio.sleep(seconds)


async def revoke_key_lease(endpoint: str, key: str) -> None:
    """Revoke the lease ``key`` lives under, as when it expires: the key goes with it."""
    lease = await key_lease(endpoint, key)
    assert lease is not None and lease.lease_id, f"{key} has no lease to revoke"
    host, port = endpoint.removeprefix("http://").rsplit(":", 1)
    async with aetcd.Client(host=host, port=int(port), timeout=30) as client:
        await client.revoke_lease(lease.lease_id)


async def create_revision(endpoint: str, key: str) -> int:
    """The revision at which ``key`` was created (0: it does not exist)."""
    host, port = endpoint.removeprefix("http://").rsplit(":", 1)
    async with aetcd.Client(host=host, port=int(port), timeout=30) as client:
        got = await client.get(key.encode())
        return got.create_revision if got is not None else 0
