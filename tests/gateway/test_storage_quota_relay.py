"""A tenant past its storage quota, through a real gateway over a real adapter store that read the
same tenants file: the SDK's upload and vLLM's ``/v1/load_lora_adapter`` are refused with the
store's own one-line message (gRPC ``RESOURCE_EXHAUSTED``, HTTP 429), and the tenant's adapter and
other tenants are untouched."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

import httpx
import pytest

from bench.sample_adapters import SampleAdapterSpec, write_peft_adapter
from loramesh import AsyncClient
from loramesh.errors import ResourceExhausted
from services.adapter_store.config import AdapterStoreConfig
from services.adapter_store.service import AdapterStoreService
from services.gateway.config import GatewayConfig
from services.gateway.http.app import build_app
from services.gateway.service import GatewayService
from services.runtime.rpc.server import start_service

LIMIT = "tenant 'alice' stores 1 adapter, its limit (max_adapters 1)"


@pytest.fixture
async def mesh(tmp_path, base_spec, etcd) -> AsyncIterator:
    """A store and a gateway reading one tenants file (alice: one adapter), alice's adapter
    directories under the gateway's ``--adapter-load-dirs``, which the store lets her import."""
    loras = tmp_path / "loras"
    for seed in (1, 2):
        write_peft_adapter(loras / f"s{seed}", base_spec, SampleAdapterSpec(rank=4, seed=seed))
    tenants = tmp_path / "tenants.json"
    tenants.write_text(
        json.dumps(
            {"keys": {"key-alice": "alice", "key-bob": "bob"}, "tenants": {"alice": {"max_adapters": 1}}}
        )
    )
    policy = tmp_path / "import-policy.json"
    policy.write_text(json.dumps({"tenants": {"alice": [loras.resolve().as_uri()]}}))
    store_config = AdapterStoreConfig(
        data_dir=str(tmp_path / "store"),
        etcd_endpoints=etcd.endpoint,
        tenants_file=str(tenants),
        import_policy_file=str(policy),
        grace_s=1,
    )
    store = await start_service(AdapterStoreService(store_config), store_config)
    config = GatewayConfig(
        adapter_store=store.address, api_keys_file=str(tenants), adapter_load_dirs=str(loras), grace_s=1
    )
    gateway = await start_service(GatewayService(config), config)
    try:
        yield gateway, loras
    finally:
        await gateway.shutdown()
        await store.shutdown()


@pytest.mark.integration
async def test_the_gateway_relays_the_stores_quota_refusal_over_grpc_and_http(mesh):
    gateway, loras = mesh
    async with AsyncClient(gateway.address, api_key="key-alice") as alice:
        await alice.adapters.upload(loras / "s1", "first")
        with pytest.raises(ResourceExhausted) as refused:
            await alice.adapters.upload(loras / "s2", "second")
        assert LIMIT in str(refused.value) and "\n" not in str(refused.value)
        assert [a.name for a in await alice.adapters.list()] == ["first"]
    async with AsyncClient(gateway.address, api_key="key-bob") as bob:
        await bob.adapters.upload(loras / "s2", "second")  # bob has no limit

    transport = httpx.ASGITransport(app=build_app(gateway.service.parts))
    async with httpx.AsyncClient(
        transport=transport, base_url="http://g", headers={"authorization": "Bearer key-alice"}
    ) as http:
        answer = await http.post("/v1/load_lora_adapter", json={"lora_name": "third", "lora_path": "s2"})
    assert answer.status_code == 429
    assert LIMIT in answer.json()["error"]["message"]
