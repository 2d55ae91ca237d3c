"""A worker's pull of a version just published goes to the store replica that holds it in its
RAM tier (the one that committed it), whichever replica its locator tried first: the other is
asked for it from its RAM tier only and refuses, so it reads no blob and hashes nothing. When no
replica holds it there, it is fetched as any other version."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

import pytest
from grpc import aio
from support.store_replicas import Prefer, StoreReplicas, store_replicas

from bench.sample_adapters import SampleAdapterSpec, adapter_files, write_peft_adapter
from mesh_api.upload_wire import upload_wire
from mesh_api.v1 import adapter_store_pb2, adapter_store_pb2_grpc, types_pb2
from services.gpu_worker.adapter_source import StoreSource
from services.runtime.etcd import discovery

WEIGHTS = "adapter_model.safetensors"


@pytest.fixture
def files(base_spec, tmp_path) -> dict[str, bytes]:
    return adapter_files(write_peft_adapter(tmp_path / "sql", base_spec, SampleAdapterSpec(rank=8)))


async def publish(address: str, files: dict[str, bytes]) -> types_pb2.AdapterInfo:
    """A publish (a new version, as ``client.adapters.publish``): its weights go into the RAM
    tier of the replica taking it before its row commits."""
    wire = upload_wire(files, "sql", "alice", types_pb2.VISIBILITY_PRIVATE, new_version=True)
    async with aio.insecure_channel(address) as channel:
        reply = await adapter_store_pb2_grpc.AdapterStoreStub(channel).RegisterAdapter(
            map(adapter_store_pb2.RegisterAdapterRequest.FromString, wire), timeout=60
        )
    return reply.adapter


async def ram_reads(address: str) -> tuple[int, int]:
    """The replica's RAM tier hits and misses (a miss reads the blob and hashes it)."""
    async with aio.insecure_channel(address) as channel:
        stats = await adapter_store_pb2_grpc.AdapterStoreStub(channel).Stats(adapter_store_pb2.StatsRequest())
    return stats.ram_hits, stats.ram_misses


@contextlib.asynccontextmanager
async def published_by_one_replica(
    files, tmp_path, etcd, monkeypatch
) -> AsyncIterator[tuple[StoreReplicas, str, StoreSource]]:
    """Two replicas, a version published through the second (the writer), and a source that
    discovers them in etcd and tries the first (the other) first: the replicas, its id, the
    source."""
    async with store_replicas(tmp_path / "stores", etcd.endpoint) as replicas:
        info = await publish(replicas.addresses[1], files)
        monkeypatch.setattr(discovery, "random", Prefer(replicas.addresses[0]))
        # Streamed: on the replicas' own file system a source would read the blob file instead
        # (test_adapter_source_blob_files.py).
        source = StoreSource(etcd_endpoints=etcd.endpoint, read_blob_files=False)
        try:
            yield replicas, info.id, source
        finally:
            await source.close()


@pytest.mark.integration
async def test_a_version_just_published_is_sent_by_the_replica_holding_it_in_ram(
    files, tmp_path, etcd, monkeypatch
):
    async with published_by_one_replica(files, tmp_path, etcd, monkeypatch) as (replicas, adapter_id, source):
        other, writer = replicas.addresses
        before = {address: await ram_reads(address) for address in (other, writer)}
        fetched = await source.fetch(adapter_id, just_published=True)
        assert b"".join(fetched.weights) == files[WEIGHTS]
        assert await ram_reads(other) == before[other]  # refused: no blob read, no hit
        hits, misses = await ram_reads(writer)
        assert (hits - before[writer][0], misses - before[writer][1]) == (1, 0)
        # The locator stays on the replica that sent it: the next pull asks it first.
        again = await source.fetch(adapter_id, just_published=True)
        assert b"".join(again.weights) == files[WEIGHTS]
        assert await ram_reads(other) == before[other]


@pytest.mark.integration
async def test_a_version_in_no_ram_tier_is_fetched_from_the_live_replica_all_the_same(
    files, tmp_path, etcd, monkeypatch
):
    async with published_by_one_replica(files, tmp_path, etcd, monkeypatch) as (replicas, adapter_id, source):
        await replicas.crash(1)  # the replica holding it in RAM is gone (still listed)
        fetched = await source.fetch(adapter_id, just_published=True)
        assert b"".join(fetched.weights) == files[WEIGHTS]
        assert (await ram_reads(replicas.addresses[0]))[1] == 1  # read from the blob tier, once
