"""Adapter store replicas served in this process on one etcd and one blob directory (as a
deployment of several replicas shares them), one of which a test can crash: its server stops
at once and its member key stays in etcd until its lease expires, as after ``kill -9``."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from services.adapter_store.config import AdapterStoreConfig
from services.adapter_store.service import AdapterStoreService
from services.runtime.etcd.membership import MembershipConfig, list_members
from services.runtime.rpc.server import ServiceHost, start_service

LINGERING_LEASE_S = 60
"""The replicas' lease TTL: a crashed replica stays listed for the whole test."""


@dataclass
class StoreReplicas:
    hosts: list[ServiceHost]
    etcd_endpoint: str

    @property
    def addresses(self) -> list[str]:
        return [host.address for host in self.hosts]

    async def crash(self, index: int) -> str:
        """Stop replica ``index`` as a crash would: no deregistration, every connection dropped
        with no answer. Its address."""
        host = self.hosts[index]
        assert host.registration is not None
        await host.registration.abandon()
        await host.server.stop(None)
        return host.address

    async def listed(self) -> list[str]:
        """The addresses etcd lists for the adapter store."""
        members = await list_members(MembershipConfig(etcd_endpoints=self.etcd_endpoint), "adapter_store")
        return sorted(member.address for member in members)


@contextlib.asynccontextmanager
async def store_replicas(root: Path, etcd_endpoint: str, count: int = 2) -> AsyncIterator[StoreReplicas]:
    """``count`` replicas with data directories under ``root`` and one blob directory."""
    hosts: list[ServiceHost] = []
    try:
        for index in range(count):
            config = AdapterStoreConfig(
                data_dir=str(root / f"replica{index}"),
                blob_store=str(root / "blobs"),
                etcd_endpoints=etcd_endpoint,
                host="127.0.0.1",
                grace_s=1,
                lease_ttl_s=LINGERING_LEASE_S,
            )
            hosts.append(await start_service(AdapterStoreService(config), config))
        yield StoreReplicas(hosts, etcd_endpoint)
    finally:
        for host in hosts:
            await host.shutdown()


class Prefer:
    """Stands in for :mod:`random` in :mod:`services.runtime.etcd.discovery`: picks ``address``
    whenever it is among the choices (the replica a test crashes), else the first."""

    def __init__(self, address: str):
        self.address = address

    def choice(self, options: Sequence[str]) -> str:
        return self.address if self.address in options else options[0]
