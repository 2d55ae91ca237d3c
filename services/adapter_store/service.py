"""The adapter store as a runtime :class:`~services.runtime.rpc.server.Service`."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import socket
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from grpc import aio

from mesh_api.upload_wire import read_upload_message
from mesh_api.v1 import adapter_store_pb2_grpc
from services.adapter_store.adapter_imports import AdapterImports
from services.adapter_store.blobs.open_backend import open_blob_backend
from services.adapter_store.config import AdapterStoreConfig
from services.adapter_store.cpu_niceness import lower_cpu_priority
from services.adapter_store.import_policy import load_import_policy
from services.adapter_store.repository import AdapterRepository, RepositorySettings
from services.adapter_store.servicer import AdapterStoreServicer
from services.adapter_store.sqlite_migration import migrate_sqlite_catalog
from services.adapter_store.validation import ValidationLimits
from services.model_files.base_model import load_base_model_spec
from services.runtime.process.tasks import cancel_and_wait
from services.runtime.rpc.method_handlers import add_servicer_with_readers
from services.runtime.tenants_file import read_tenant_limits

MIB = 2**20
CATALOG_CALL_TIMEOUT_S = 10.0
"""Bound on one etcd call of the catalog: a registration's commit waits for etcd's fsync, which
a busy disk can hold well past the 2 s membership calls get; beyond this etcd is as good as
unreachable (UNAVAILABLE: the client tries another replica)."""
log = logging.getLogger("loramesh.adapter_store")


class AdapterStoreService:
    name = "adapter_store"
    grpc_service_name = "loramesh.v1.AdapterStore"

    def __init__(self, config: AdapterStoreConfig):
        self.config = config
        self.repository: AdapterRepository | None = None
        self.servicer = AdapterStoreServicer()
        self._collecting: asyncio.Task[None] | None = None

    def add_to_server(self, server: aio.Server) -> None:
        add_servicer_with_readers(
            server,
            adapter_store_pb2_grpc.add_AdapterStoreServicer_to_server,
            self.servicer,
            {"RegisterAdapter": read_upload_message},
        )

    async def start(self) -> None:
        cfg = self.config
        lower_cpu_priority(cfg.cpu_nice)  # before the executor's threads: they inherit it
        asyncio.get_running_loop().set_default_executor(
            ThreadPoolExecutor(cfg.blocking_threads, thread_name_prefix="store")
        )
        policy = load_import_policy(cfg.import_policy_file)
        tenants = read_tenant_limits(cfg.tenants_file)
        spec = await asyncio.to_thread(load_base_model_spec, cfg.model or None)
        data_dir = Path(cfg.data_dir)
        blobs = await asyncio.to_thread(open_blob_backend, cfg.blob_store, data_dir, cfg.blob_cache_mib * MIB)
        repository = AdapterRepository(
            blobs,
            dataclasses.replace(
                cfg.required_membership("adapter store", "its catalog lives in etcd"),
                call_timeout_s=CATALOG_CALL_TIMEOUT_S,
            ),
            spec,
            ValidationLimits(max_rank=cfg.max_rank, max_adapter_bytes=cfg.max_adapter_mib * MIB),
            RepositorySettings(
                ram_budget_bytes=cfg.ram_budget_mib * MIB,
                verify_on_open=cfg.verify_on_start,
                eviction_policy=cfg.eviction_policy,
                collect_grace_s=cfg.collect_grace_s,
                keep_versions=cfg.keep_versions,
                keep_versions_s=cfg.keep_versions_s,
                replica_id=cfg.instance_id or f"{socket.gethostname()}:{os.getpid()}",
                tenants=tenants,
            ),
        )
        await asyncio.to_thread(repository.catalog.open)
        await asyncio.to_thread(migrate_sqlite_catalog, data_dir, repository.catalog, blobs)
        await asyncio.to_thread(repository.open)
        self.repository = repository
        self.servicer.attach(repository, AdapterImports(repository, policy))
        self._collecting = asyncio.get_running_loop().create_task(self._collect_periodically())

    async def _collect_periodically(self) -> None:
        """Remove unreferenced blobs every ``collect_interval_s`` (any replica may; they agree
        through etcd)."""
        while True:
            await asyncio.sleep(self.config.collect_interval_s)
            try:
                await asyncio.to_thread(self.repository.collector.collect)
            except Exception as error:  # noqa: BLE001 - etcd or the blob tier away: next round
                log.warning("blob collection failed: %s", error)

    def degraded(self) -> str:
        """What ``/readyz`` adds while this replica cannot write: it goes on serving reads of
        what its mirror holds."""
        problem = self.repository.catalog.problem if self.repository is not None else ""
        return f"writes refused: {problem}" if problem else ""

    async def end_streams(self) -> None:
        """Shutdown begins: end the catalog watches (their gateways watch the next store)."""
        self.servicer.end_watches()

    async def stop(self) -> None:
        await cancel_and_wait([self._collecting])
        if self.repository is not None:
            await asyncio.to_thread(self.repository.close)

    def load_report(self) -> dict:
        if self.repository is None:
            return {"ready": False}
        repository = self.repository
        # Written every second from the event loop: counted, not walked (the full stats walk
        # every row: 15 ms of the loop each time at 10,000 adapters).
        return {
            "catalog": repository.catalog.problem or "ok",
            "blob_store": repository.blobs.description,
            "adapters": repository.catalog.count(),
            "ram_bytes": repository.ram.bytes_used,
            "ram_budget_bytes": repository.ram.budget_bytes,
            "uploads_in_flight": self.servicer.uploads_in_flight,
        }
