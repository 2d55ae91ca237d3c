"""A worker on the adapter store's own file system reads a version's blob file instead of having
it streamed (``--store-fetch auto``): the same bytes, checked against their sha256, with nothing
read from the store's RAM tier; a file it cannot trust, or a store on another file system, and
the version is streamed as before. A real store served on loopback, in this process (so on this
file system)."""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from grpc import aio

from bench.sample_adapters import SampleAdapterSpec, adapter_files, write_peft_adapter
from mesh_api.adapter_transfer import ref_by_id
from mesh_api.upload_wire import upload_wire
from mesh_api.v1 import adapter_store_pb2, adapter_store_pb2_grpc, types_pb2
from services.adapter_store.config import AdapterStoreConfig
from services.adapter_store.service import AdapterStoreService
from services.gpu_worker.adapter_source import StoreSource
from services.runtime.process.file_system import file_system_identity
from services.runtime.rpc.server import start_service

WEIGHTS = "adapter_model.safetensors"


@contextlib.asynccontextmanager
async def stored_adapter(base_spec, tmp_path: Path, etcd) -> AsyncIterator[tuple[str, str, bytes, Path]]:
    """A store with one adapter, published (so its RAM tier holds it too): its address, the
    adapter's id, its weights, its blob file."""
    files = adapter_files(write_peft_adapter(tmp_path / "sql", base_spec, SampleAdapterSpec(rank=8)))
    config = AdapterStoreConfig(
        data_dir=str(tmp_path / "store"), etcd_endpoints=etcd.endpoint, host="127.0.0.1", grace_s=1
    )
    store = await start_service(AdapterStoreService(config), config)
    try:
        wire = upload_wire(files, "sql", "alice", types_pb2.VISIBILITY_PRIVATE, new_version=True)
        async with aio.insecure_channel(store.address) as channel:
            reply = await adapter_store_pb2_grpc.AdapterStoreStub(channel).RegisterAdapter(
                map(adapter_store_pb2.RegisterAdapterRequest.FromString, wire), timeout=60
            )
        info = reply.adapter
        blob = next((tmp_path / "store").rglob(info.sha256))
        yield store.address, info.id, files[WEIGHTS], blob
    finally:
        await store.shutdown()


async def ram_reads(address: str) -> tuple[int, int]:
    async with aio.insecure_channel(address) as channel:
        stats = await adapter_store_pb2_grpc.AdapterStoreStub(channel).Stats(adapter_store_pb2.StatsRequest())
    return stats.ram_hits, stats.ram_misses


async def fetched_weights(source: StoreSource, adapter_id: str) -> bytes:
    try:
        fetched = await source.fetch(adapter_id)
    finally:
        await source.close()
    assert fetched.weights_sha256 == hashlib.sha256(b"".join(fetched.weights)).hexdigest()
    return b"".join(fetched.weights)


@pytest.mark.integration
async def test_a_worker_on_the_stores_file_system_reads_the_blob_file(base_spec, tmp_path, etcd):
    async with stored_adapter(base_spec, tmp_path, etcd) as (address, adapter_id, weights, _blob):
        before = await ram_reads(address)
        assert await fetched_weights(StoreSource(address), adapter_id) == weights
        assert await ram_reads(address) == before  # nothing read from the store's memory or sent


@pytest.mark.integration
async def test_the_store_names_its_file_only_to_a_caller_on_its_file_system(base_spec, tmp_path, etcd):
    async with (
        stored_adapter(base_spec, tmp_path, etcd) as (address, adapter_id, weights, blob),
        aio.insecure_channel(address) as channel,
    ):
        stub = adapter_store_pb2_grpc.AdapterStoreStub(channel)

        async def answer(file_system: str) -> list[adapter_store_pb2.FetchAdapterResponse]:
            request = adapter_store_pb2.FetchAdapterRequest(
                ref=ref_by_id(adapter_id), file_system=file_system
            )
            return [message async for message in stub.FetchAdapter(request)]

        named = await answer(file_system_identity())
        assert [m.WhichOneof("item") for m in named] == ["header"]
        assert Path(named[0].header.blob_path) == blob and named[0].header.total_bytes == len(weights)
        for other in ("", "another-boot:4026531841"):
            streamed = await answer(other)
            assert not streamed[0].header.blob_path
            assert b"".join(m.chunk for m in streamed[1:]) == weights


@pytest.mark.integration
async def test_a_blob_file_that_fails_its_check_is_streamed_instead(base_spec, tmp_path, etcd):
    async with stored_adapter(base_spec, tmp_path, etcd) as (address, adapter_id, weights, blob):
        corrupt = bytearray(blob.read_bytes())
        corrupt[-1] ^= 0xFF
        blob.write_bytes(bytes(corrupt))
        hits, misses = await ram_reads(address)
        assert await fetched_weights(StoreSource(address), adapter_id) == weights
        assert await ram_reads(address) == (hits + 1, misses)  # streamed from the RAM tier


@pytest.mark.integration
async def test_stream_mode_never_reads_the_file(base_spec, tmp_path, etcd):
    async with stored_adapter(base_spec, tmp_path, etcd) as (address, adapter_id, weights, blob):
        blob.unlink()  # the RAM tier still holds it: only a file read would miss it
        hits, misses = await ram_reads(address)
        assert await fetched_weights(StoreSource(address, read_blob_files=False), adapter_id) == weights
        assert await ram_reads(address) == (hits + 1, misses)
