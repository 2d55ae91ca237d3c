"""Fixtures for the adapter store: the real base model spec, sample PEFT adapters, and a real
gRPC adapter store served from a background thread (so sync tests and hypothesis can call it)."""

from __future__ import annotations

import asyncio
import json
import threading
from pathlib import Path

import grpc
import pytest

from bench.sample_adapters import SampleAdapterSpec, adapter_files, write_peft_adapter
from mesh_api.v1 import adapter_store_pb2_grpc
from services.adapter_store.blobs.local_directory import LocalDirectoryBlobs
from services.adapter_store.catalog_keys import CatalogKeys
from services.adapter_store.config import AdapterStoreConfig
from services.adapter_store.repository import AdapterRepository, RepositorySettings
from services.adapter_store.service import AdapterStoreService
from services.adapter_store.validation import ValidationLimits
from services.runtime.etcd.membership import EtcdConnection, MembershipConfig
from services.runtime.rpc.server import ServiceHost, start_service


@pytest.fixture(scope="session")
def sample_files(base_spec, tmp_path_factory) -> dict[str, bytes]:
    """A valid rank-8 attention-only fp16 adapter for SmolLM2-135M."""
    directory = write_peft_adapter(
        tmp_path_factory.mktemp("sample") / "a", base_spec, SampleAdapterSpec(rank=8)
    )
    return adapter_files(directory)


@pytest.fixture(scope="session")
def seeded_files(base_spec, tmp_path_factory):
    """``seeded_files(seed)``: a rank-8 adapter whose weights differ with the seed (blobs are
    shared by content, so distinct adapters need distinct bytes)."""
    root = tmp_path_factory.mktemp("seeded")
    made: dict[int, dict[str, bytes]] = {}

    def files(seed: int) -> dict[str, bytes]:
        if seed not in made:
            directory = write_peft_adapter(root / f"s{seed}", base_spec, SampleAdapterSpec(rank=8, seed=seed))
            made[seed] = adapter_files(directory)
        return made[seed]

    return files


class ServerThread:
    """An in-process service on its own event loop thread."""

    def __init__(self, config: AdapterStoreConfig):
        self.config = config
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.service = AdapterStoreService(config)
        self.running: ServiceHost = self.run(start_service(self.service, config))

    def run(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(120)

    def stop(self) -> None:
        self.run(self.running.shutdown())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


@pytest.fixture
def catalog_config(etcd) -> MembershipConfig:
    """Where a test's adapter catalog lives: the test's own etcd."""
    return MembershipConfig(etcd_endpoints=etcd.endpoint)


@pytest.fixture
def open_repository(tmp_path, base_spec, catalog_config):
    """``open_repository(**settings)``: a repository (a replica) on the test's etcd and blob
    directory, opened; every one is closed after the test. Its ``open_report`` is ``open()``'s."""
    opened = []

    def open_repository(
        blob_dir: Path | None = None,
        limits: ValidationLimits | None = None,
        clock=None,
        blobs=None,
        **settings,
    ) -> AdapterRepository:
        """``blobs``: a blob backend of the test's own (then ``blob_dir`` is not used)."""
        repository = AdapterRepository(
            blobs or LocalDirectoryBlobs(blob_dir or tmp_path / "store"),
            catalog_config,
            base_spec,
            limits or ValidationLimits(),
            RepositorySettings(**settings),
            **({"clock": clock} if clock else {}),
        )
        opened.append(repository)
        repository.open_report = repository.open()
        return repository

    yield open_repository
    for repository in opened:
        repository.close()


@pytest.fixture
def store_server(tmp_path, request, etcd):
    marker = request.node.get_closest_marker("store_config")
    overrides = dict(marker.kwargs) if marker else {}
    if "tenants" in overrides:  # the tenants file's "tenants", written for the store to read
        tenants_file = tmp_path / "tenants.json"
        tenants_file.write_text(json.dumps({"keys": {}, "tenants": overrides.pop("tenants")}))
        overrides["tenants_file"] = str(tenants_file)
    config = AdapterStoreConfig(
        **{"data_dir": str(tmp_path / "store"), "grace_s": 2, "etcd_endpoints": etcd.endpoint, **overrides}
    )
    server = ServerThread(config)
    yield server
    server.stop()


@pytest.fixture
def store_stub(store_server):
    channel = grpc.insecure_channel(store_server.running.address)
    yield adapter_store_pb2_grpc.AdapterStoreStub(channel)
    channel.close()


@pytest.fixture
def traces():
    """``traces(server)``: blob files, staged files and catalog rows (in etcd) of a store."""
    return store_traces


def catalog_rows(endpoint: str) -> int:
    """Rows of the adapter catalog in the etcd at ``endpoint``, counted in etcd itself."""

    async def count() -> int:
        connection = EtcdConnection(MembershipConfig(etcd_endpoints=endpoint))
        try:
            rows = await connection.call(lambda c: c.get_prefix(CatalogKeys.under("/loramesh").rows.encode()))
            return len(list(rows))
        finally:
            await connection.close()

    return asyncio.run(count())


def store_traces(server: ServerThread) -> dict[str, int]:
    data_dir = Path(server.config.data_dir)
    return {
        "blobs": len(list((data_dir / "sha256").glob("*"))),
        "temp": len(list((data_dir / "staging").glob("*"))),
        "rows": catalog_rows(server.config.etcd_endpoints),
    }
