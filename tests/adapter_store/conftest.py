"""Fixtures for the adapter store: the real base model spec, sample PEFT adapters, and a real
gRPC adapter store served from a background thread (so sync tests and hypothesis can call it)."""

from __future__ import annotations

import asyncio
import sqlite3
import threading
from pathlib import Path

import grpc
import pytest

from bench.sample_adapters import SampleAdapterSpec, adapter_files, write_peft_adapter
from mesh_api.v1 import adapter_store_pb2_grpc
from services.adapter_store.config import AdapterStoreConfig
from services.adapter_store.service import AdapterStoreService
from services.runtime.rpc.server import ServiceHost, start_service


@pytest.fixture(scope="session")
def sample_files(base_spec, tmp_path_factory) -> dict[str, bytes]:
    """A valid rank-8 attention-only fp16 adapter for SmolLM2-135M."""
    directory = write_peft_adapter(
        tmp_path_factory.mktemp("sample") / "a", base_spec, SampleAdapterSpec(rank=8)
    )
    return adapter_files(directory)


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
def store_server(tmp_path, request):
    marker = request.node.get_closest_marker("store_config")
    overrides = marker.kwargs if marker else {}
    config = AdapterStoreConfig(**{"data_dir": str(tmp_path / "store"), "grace_s": 2, **overrides})
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
    """``traces(server_or_data_dir)``: blob files, temp files and catalog rows on disk."""
    return store_traces


def store_traces(where: ServerThread | Path) -> dict[str, int]:
    data_dir = Path(where.config.data_dir) if isinstance(where, ServerThread) else Path(where)
    db = sqlite3.connect(data_dir / "catalog.sqlite3")
    try:
        rows = db.execute("SELECT COUNT(*) FROM adapters").fetchone()[0]
    finally:
        db.close()
    return {
        "blobs": len(list((data_dir / "blobs").glob("*"))),
        "temp": len(list((data_dir / "tmp").glob("*"))),
        "rows": rows,
    }
