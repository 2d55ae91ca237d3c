"""Where a worker gets adapters, and the names it shows them by: a real adapter store served on
loopback (in process), and a directory."""

from __future__ import annotations

import hashlib

import pytest
from grpc import aio

from bench.sample_adapters import SampleAdapterSpec, adapter_files, write_peft_adapter
from mesh_api.adapter_transfer import ref_by_id, upload_adapter
from mesh_api.v1 import adapter_store_pb2, adapter_store_pb2_grpc
from services.adapter_store.config import AdapterStoreConfig
from services.adapter_store.service import AdapterStoreService
from services.gpu_worker.adapter_source import DirectorySource, StoreSource
from services.runtime.rpc.server import start_service


@pytest.mark.integration
async def test_a_store_adapter_is_named_owner_slash_name_once_fetched_and_its_pin_is_read(
    base_spec, tmp_path, etcd
):
    files = adapter_files(write_peft_adapter(tmp_path / "sql", base_spec, SampleAdapterSpec(rank=8)))
    config = AdapterStoreConfig(
        data_dir=str(tmp_path / "store"), etcd_endpoints=etcd.endpoint, host="127.0.0.1", grace_s=1
    )
    store = await start_service(AdapterStoreService(config), config)
    source = StoreSource(store.address)
    try:
        async with aio.insecure_channel(store.address) as channel:
            stub = adapter_store_pb2_grpc.AdapterStoreStub(channel)
            info = await upload_adapter(stub, files, "sql", "alice")
            assert source.public_name(info.id) == info.id  # not fetched yet: nothing better is known
            fetched = await source.fetch(info.id)
            assert b"".join(fetched.weights) == files["adapter_model.safetensors"] and not fetched.pinned
            # Verified on the way in: the parse does not hash the weights again.
            assert fetched.weights_sha256 == hashlib.sha256(files["adapter_model.safetensors"]).hexdigest()
            assert source.public_name(info.id) == "alice/sql" != info.id
            assert await source.pinned_ids() == frozenset()
            await stub.SetAdapterPinned(
                adapter_store_pb2.SetAdapterPinnedRequest(ref=ref_by_id(info.id), pinned=True)
            )
            assert await source.pinned_ids() == {info.id} and (await source.fetch(info.id)).pinned
    finally:
        await source.close()
        await store.shutdown()


def test_a_directory_adapter_is_named_by_its_directory(tmp_path):
    assert DirectorySource(tmp_path).public_name("sql") == "sql"
