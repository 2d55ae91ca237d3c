"""Importing through the gateway: the SDK's ``import_uri`` and the OpenAI ``load_lora_adapter``
route reach a real adapter store, as the caller's tenant, under the store's import policy."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

import httpx
import pytest
from grpc import aio

from bench.sample_adapters import SampleAdapterSpec, write_peft_adapter
from loramesh import AsyncClient, PermissionDenied
from mesh_api.v1 import adapter_store_pb2_grpc, gateway_pb2_grpc
from services.adapter_store.config import AdapterStoreConfig
from services.adapter_store.service import AdapterStoreService
from services.gateway.http.app import build_app
from services.gateway.parts import GatewayParts
from services.gateway.servicer import GatewayServicer
from services.model_files.tokenizer_loading import load_tokenizer
from services.runtime.rpc.interceptors import ServiceInterceptor
from services.runtime.rpc.server import start_service
from tests.gateway.in_memory_store import StubStore, gateway_parts


@pytest.fixture
async def gateway(tmp_path, base_spec, etcd) -> AsyncIterator[tuple[str, GatewayParts]]:
    """A gateway for tenants alice and bob over a real store granting alice ``tmp_path/granted``."""
    for name, seed in (("a", 0), ("a2", 1)):
        write_peft_adapter(
            tmp_path / "granted" / name,
            base_spec,
            SampleAdapterSpec(rank=4, target_modules=("q_proj", "v_proj"), seed=seed),
        )
    policy = tmp_path / "policy.json"
    policy.write_text(json.dumps({"tenants": {"alice": [f"file://{tmp_path / 'granted'}"]}}))
    config = AdapterStoreConfig(
        data_dir=str(tmp_path / "store"),
        etcd_endpoints=etcd.endpoint,
        grace_s=1,
        import_policy_file=str(policy),
    )
    store = await start_service(AdapterStoreService(config), config)
    server = aio.server(interceptors=[ServiceInterceptor()])
    address = f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"
    async with aio.insecure_channel(store.address) as channel:
        stub = adapter_store_pb2_grpc.AdapterStoreStub(channel)
        parts = gateway_parts("key-alice=alice,key-bob=bob", StubStore(stub), load_tokenizer())
        gateway_pb2_grpc.add_GatewayServicer_to_server(GatewayServicer(parts), server)
        await server.start()
        try:
            yield address, parts
        finally:
            await server.stop(None)
            await store.shutdown()


@pytest.mark.integration
async def test_import_uri_through_the_gateway(gateway, tmp_path):
    address, _ = gateway
    uri = f"file://{tmp_path / 'granted' / 'a'}"
    async with AsyncClient(address, "key-alice") as alice:
        first = await alice.adapters.import_uri(uri, "a")
        assert first.changed and (first.adapter.owner, first.adapter.version) == ("alice", 1)
        again = await alice.adapters.import_uri(uri, "a")
        assert not again.changed and again.adapter.id == first.adapter.id
    async with AsyncClient(address, "key-bob") as bob:
        with pytest.raises(PermissionDenied, match="tenant 'bob' may not import from"):
            await bob.adapters.import_uri(uri, "a")


@pytest.mark.integration
async def test_load_lora_adapter_takes_a_uri(gateway, tmp_path):
    _, parts = gateway
    transport = httpx.ASGITransport(app=build_app(parts))
    async with httpx.AsyncClient(transport=transport, base_url="http://gateway") as client:
        body = {"lora_name": "b", "lora_path": f"file://{tmp_path / 'granted' / 'a'}"}
        reply = await client.post(
            "/v1/load_lora_adapter", json=body, headers={"authorization": "Bearer key-alice"}
        )
        assert reply.status_code == 200, reply.text
        body = {"lora_name": "c", "lora_path": "s3://not-granted/a"}
        reply = await client.post(
            "/v1/load_lora_adapter", json=body, headers={"authorization": "Bearer key-alice"}
        )
        assert reply.status_code == 403 and "s3://not-granted/a" in reply.text


@pytest.mark.integration
async def test_load_lora_adapter_in_place_publishes_the_next_version(gateway, tmp_path):
    _, parts = gateway
    transport = httpx.ASGITransport(app=build_app(parts))
    headers = {"authorization": "Bearer key-alice"}
    async with httpx.AsyncClient(transport=transport, base_url="http://gateway", headers=headers) as client:
        body = {"lora_name": "b", "lora_path": f"file://{tmp_path / 'granted' / 'a'}"}
        assert (await client.post("/v1/load_lora_adapter", json=body)).status_code == 200
        first = await parts.catalog.resolve("alice", "b")
        again = await client.post("/v1/load_lora_adapter", json=body)
        assert again.status_code == 400, again.text  # vLLM's refusal, in its words
        assert (
            "has already been loaded. If you want to load the adapter in place, set 'load_inplace'"
            in again.text
        )
        body = {**body, "lora_path": f"file://{tmp_path / 'granted' / 'a2'}", "load_inplace": True}
        assert (await client.post("/v1/load_lora_adapter", json=body)).status_code == 200
        second = await parts.catalog.resolve("alice", "b")
        assert (second.version, first.version) == (2, 1) and second.sha256 != first.sha256
