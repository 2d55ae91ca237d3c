"""A real gateway (its tenants file with limits) over a real adapter store: another tenant's
private adapter answers exactly as a missing one, whose words are the store's own, over gRPC and
HTTP; listings never show it."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

import grpc
import httpx
import pytest
from grpc import aio

from bench.sample_adapters import SampleAdapterSpec, adapter_files, write_peft_adapter
from mesh_api.adapter_transfer import upload_adapter
from mesh_api.v1 import adapter_store_pb2_grpc, gateway_pb2, gateway_pb2_grpc, types_pb2
from services.adapter_store.config import AdapterStoreConfig
from services.adapter_store.service import AdapterStoreService
from services.gateway.config import GatewayConfig
from services.gateway.http.app import build_app
from services.gateway.service import GatewayService
from services.gateway.tenant_quota import TenantLimits
from services.runtime.rpc.server import start_service

ALICE = (("authorization", "Bearer key-alice"),)


@pytest.fixture
async def gateway(tmp_path, base_spec, etcd) -> AsyncIterator:
    """The gateway's host, its tenants file giving alice limits; bob's private ``secret`` and
    public ``shared`` registered at the store."""
    spec = SampleAdapterSpec(rank=4, target_modules=("q_proj", "v_proj"))
    files = adapter_files(write_peft_adapter(tmp_path / "a", base_spec, spec))
    store_config = AdapterStoreConfig(
        data_dir=str(tmp_path / "store"), etcd_endpoints=etcd.endpoint, grace_s=1
    )
    store = await start_service(AdapterStoreService(store_config), store_config)
    tenants = tmp_path / "tenants.json"
    tenants.write_text(
        json.dumps(
            {
                "keys": {"key-alice": "alice", "key-bob": "bob"},
                "tenants": {"alice": {"max_concurrent_requests": 2, "tokens_per_minute": 5000}},
                "quota_window_s": 30,
            }
        )
    )
    config = GatewayConfig(adapter_store=store.address, api_keys_file=str(tenants), grace_s=1)
    host = await start_service(GatewayService(config), config)
    try:
        async with aio.insecure_channel(store.address) as channel:
            stub = adapter_store_pb2_grpc.AdapterStoreStub(channel)
            await upload_adapter(stub, files, "secret", "bob")
            await upload_adapter(stub, files, "shared", "bob", types_pb2.VISIBILITY_PUBLIC)
        yield host
    finally:
        await host.shutdown()
        await store.shutdown()


@pytest.mark.integration
async def test_a_private_adapter_is_answered_as_the_store_answers_a_missing_one(gateway):
    async with aio.insecure_channel(gateway.address) as channel:
        stub = gateway_pb2_grpc.GatewayStub(channel)
        for adapter_call in (
            lambda a: stub.GetAdapter(gateway_pb2.GatewayAdapterRequest(adapter=a), metadata=ALICE),
            lambda a: stub.Generate(gateway_pb2.GenerateTextRequest(prompt="Hi", adapter=a), metadata=ALICE),
        ):
            answers = []
            for adapter in ("bob/secret", "bob/ghost"):  # ghost: never registered, the store says so
                with pytest.raises(aio.AioRpcError) as refused:
                    reply = adapter_call(adapter)
                    if hasattr(reply, "__aiter__"):
                        [r async for r in reply]
                    else:
                        await reply
                answers.append((refused.value.code(), refused.value.details()))
            assert answers == [
                (grpc.StatusCode.NOT_FOUND, "adapter 'secret' of owner 'bob' not found"),
                (grpc.StatusCode.NOT_FOUND, "adapter 'ghost' of owner 'bob' not found"),
            ]
        models = await stub.ListModels(gateway_pb2.ListModelsRequest(), metadata=ALICE)
        assert [m.id for m in models.models if not m.is_base] == ["bob/shared"]
        bobs = await stub.ListModels(
            gateway_pb2.ListModelsRequest(), metadata=(("authorization", "Bearer key-bob"),)
        )
        assert sorted(m.id for m in bobs.models if not m.is_base) == ["secret", "shared"]

    core = gateway.service.core
    transport = httpx.ASGITransport(app=build_app(gateway.service.parts))
    async with httpx.AsyncClient(transport=transport, base_url="http://g", headers=dict(ALICE)) as http:
        private, missing = [await http.get(f"/v1/models/bob/{name}") for name in ("secret", "ghost")]
        assert private.status_code == missing.status_code == 404
        assert private.text.replace("secret", "ghost") == missing.text
    # The tenants file's limits reached the core.
    assert core.quota.config.for_tenant("alice") == TenantLimits(2, 5000)
    assert core.quota.config.window_s == 30 and core.quota.config.for_tenant("bob") == TenantLimits()
