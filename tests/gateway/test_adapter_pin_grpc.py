"""Pinning through the gateway: the SDK's ``pin``/``unpin`` reach a real adapter store as the
caller's tenant, and a pinned adapter survives eviction pressure in the store's RAM tier (seen
through the store's own RAM hit and miss counters, no timing involved)."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
from grpc import aio

from bench.sample_adapters import SampleAdapterSpec, adapter_files, write_peft_adapter
from loramesh import AsyncClient, PermissionDenied, ResourceExhausted
from mesh_api.adapter_transfer import fetch_adapter, ref_by_name, upload_adapter
from mesh_api.v1 import adapter_store_pb2, adapter_store_pb2_grpc
from services.adapter_store.config import AdapterStoreConfig
from services.adapter_store.service import AdapterStoreService
from services.gateway.config import GatewayConfig
from services.gateway.service import GatewayService
from services.runtime.rpc.server import start_service


@pytest.fixture
async def mesh(
    tmp_path, base_spec, etcd
) -> AsyncIterator[tuple[str, adapter_store_pb2_grpc.AdapterStoreStub]]:
    """A real gateway for tenants alice and bob over a real store (loopback, its catalog in the
    test's etcd) whose RAM tier holds one adapter (1 MiB; a rank-8 q/v adapter of the base model
    is about 0.9 MB);
    alice's a, b and d are registered at the store, each with its own weights (the store keeps
    blobs, and its RAM tier, by content: equal weights would share one entry). Yields the
    gateway's address and a stub of the store."""
    store_config = AdapterStoreConfig(
        data_dir=str(tmp_path / "store"), etcd_endpoints=etcd.endpoint, grace_s=1, ram_budget_mib=1
    )
    store = await start_service(AdapterStoreService(store_config), store_config)
    config = GatewayConfig(adapter_store=store.address, api_keys="key-alice=alice,key-bob=bob", grace_s=1)
    gateway = await start_service(GatewayService(config), config)
    try:
        async with aio.insecure_channel(store.address) as channel:
            stub = adapter_store_pb2_grpc.AdapterStoreStub(channel)
            for seed, name in enumerate(("a", "b", "d")):
                spec = SampleAdapterSpec(rank=8, target_modules=("q_proj", "v_proj"), seed=seed)
                files = adapter_files(write_peft_adapter(tmp_path / name, base_spec, spec))
                await upload_adapter(stub, files, name, "alice")
            yield gateway.address, stub
    finally:
        await gateway.shutdown()
        await store.shutdown()


async def ram_misses_fetching(store, name: str) -> int:
    """RAM misses of the store while it serves one fetch of alice's ``name``."""
    before = (await store.Stats(adapter_store_pb2.StatsRequest())).ram_misses
    await fetch_adapter(store, ref_by_name("alice", name))
    return (await store.Stats(adapter_store_pb2.StatsRequest())).ram_misses - before


@pytest.mark.integration
async def test_a_pinned_adapter_survives_eviction_pressure_in_the_store(mesh):
    address, store = mesh
    async with AsyncClient(address, "key-alice") as alice, AsyncClient(address, "key-bob") as bob:
        pinned = await alice.adapters.pin("a")
        assert pinned.pinned and (await alice.adapters.get("a")).pinned
        with pytest.raises(ResourceExhausted, match="over the store's RAM budget"):
            await alice.adapters.pin("b")  # a and b together do not fit in 1 MiB
        with pytest.raises(PermissionDenied):
            await bob.adapters.pin("alice/a")
        for name in ("b", "d", "b"):  # each would evict a (least recently used), were it not pinned
            assert await ram_misses_fetching(store, name) == 1
        assert await ram_misses_fetching(store, "a") == 0

        assert not (await alice.adapters.unpin("a")).pinned
        assert await ram_misses_fetching(store, "b") == 1  # kept now, in a's place
        assert await ram_misses_fetching(store, "a") == 1
