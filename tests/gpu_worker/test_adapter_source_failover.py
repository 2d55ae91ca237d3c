"""A worker's adapter source with several store replicas: a replica that died (still listed in
etcd: its lease lingers) or that fails in the middle of a download is left for another, and the
fetch succeeds there."""

from __future__ import annotations

import hashlib

import grpc
import pytest
from grpc import aio
from support.store_replicas import LINGERING_LEASE_S, Prefer, store_replicas

from bench.sample_adapters import SampleAdapterSpec, adapter_files, write_peft_adapter
from mesh_api.adapter_transfer import ref_by_id, upload_adapter
from mesh_api.v1 import adapter_store_pb2, adapter_store_pb2_grpc
from services.gpu_worker.adapter_source import StoreSource
from services.runtime.etcd import discovery
from services.runtime.etcd.membership import MemberInfo, MemberRegistration, MembershipConfig

WEIGHTS = "adapter_model.safetensors"


@pytest.fixture
def files(base_spec, tmp_path) -> dict[str, bytes]:
    return adapter_files(write_peft_adapter(tmp_path / "sql", base_spec, SampleAdapterSpec(rank=8)))


@pytest.mark.integration
async def test_a_fetch_and_the_pins_are_read_from_the_live_replica_when_the_other_crashed(
    files, tmp_path, etcd, monkeypatch
):
    async with store_replicas(tmp_path / "stores", etcd.endpoint) as replicas:
        async with aio.insecure_channel(replicas.addresses[1]) as channel:
            stub = adapter_store_pb2_grpc.AdapterStoreStub(channel)
            info = await upload_adapter(stub, files, "sql", "alice")
            await stub.SetAdapterPinned(
                adapter_store_pb2.SetAdapterPinnedRequest(ref=ref_by_id(info.id), pinned=True)
            )
        dead = await replicas.crash(0)
        assert await replicas.listed() == sorted(replicas.addresses)  # the dead one still listed
        monkeypatch.setattr(discovery, "random", Prefer(dead))  # and tried first
        source = StoreSource(etcd_endpoints=etcd.endpoint)
        try:
            fetched = await source.fetch(info.id)
            assert b"".join(fetched.weights) == files[WEIGHTS] and fetched.pinned
            assert source.public_name(info.id) == "alice/sql"
            assert await source.pinned_ids() == {info.id}
        finally:
            await source.close()


class _BreaksMidDownload(adapter_store_pb2_grpc.AdapterStoreServicer):
    """A replica that announces an adapter, sends part of it and fails UNAVAILABLE."""

    def __init__(self, info, weights: bytes):
        self.info = info
        self.weights = weights
        self.fetches = 0

    async def FetchAdapter(self, request, context):
        self.fetches += 1
        header = adapter_store_pb2.FetchAdapterResponse.Header(
            adapter=self.info, total_bytes=len(self.weights), sha256=hashlib.sha256(self.weights).hexdigest()
        )
        yield adapter_store_pb2.FetchAdapterResponse(header=header)
        yield adapter_store_pb2.FetchAdapterResponse(chunk=self.weights[: len(self.weights) // 2])
        await context.abort(grpc.StatusCode.UNAVAILABLE, "the replica went away mid-download")


@pytest.mark.integration
async def test_a_download_broken_midway_is_fetched_again_from_the_start_on_another_replica(
    files, tmp_path, etcd, monkeypatch
):
    async with store_replicas(tmp_path / "stores", etcd.endpoint, count=1) as replicas:
        async with aio.insecure_channel(replicas.addresses[0]) as channel:
            info = await upload_adapter(
                adapter_store_pb2_grpc.AdapterStoreStub(channel), files, "sql", "alice"
            )
        broken = _BreaksMidDownload(info, files[WEIGHTS])
        server = aio.server()
        adapter_store_pb2_grpc.add_AdapterStoreServicer_to_server(broken, server)
        address = f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"
        await server.start()
        registration = MemberRegistration(
            MembershipConfig(etcd_endpoints=etcd.endpoint, ttl_s=LINGERING_LEASE_S),
            MemberInfo("adapter_store", "broken-1", address, "", "test", 0.0),
        )
        await registration.start()
        monkeypatch.setattr(discovery, "random", Prefer(address))
        source = StoreSource(etcd_endpoints=etcd.endpoint)
        try:
            fetched = await source.fetch(info.id)
        finally:
            await source.close()
            await registration.stop()
            await server.stop(None)
        assert broken.fetches == 1 and b"".join(fetched.weights) == files[WEIGHTS]


@pytest.mark.integration
async def test_a_fixed_address_is_tried_once(files, tmp_path, etcd):
    async with store_replicas(tmp_path / "stores", etcd.endpoint) as replicas:
        dead = await replicas.crash(0)
        source = StoreSource(dead)
        try:
            with pytest.raises(discovery.MemberUnavailable, match=f"adapter store at {dead}: UNAVAILABLE"):
                await source.pinned_ids()
        finally:
            await source.close()
