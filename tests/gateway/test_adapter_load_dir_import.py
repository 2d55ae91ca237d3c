"""Loading an adapter by path (vLLM's ``/v1/load_lora_adapter`` with a plain ``lora_path``) is an
import of ``file://``: through a real gateway and a real adapter store whose import policy is the
one ``loramesh up`` writes (the ``admin`` tenant granted ``file://`` of each load dir, nobody else
anything), a path under ``--adapter-load-dirs`` loads for ``admin`` only, a link out of the load
dir (the adapter directory or a file in it) is refused, and so is an adapter over the store's
size limit, from its listed size, before any byte of it is read."""

from __future__ import annotations

import json
import os
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from grpc import aio

from bench.sample_adapters import SampleAdapterSpec, write_peft_adapter
from mesh_api.v1 import adapter_store_pb2, adapter_store_pb2_grpc
from services.adapter_store.config import AdapterStoreConfig
from services.adapter_store.importers.file import FileSource
from services.adapter_store.service import AdapterStoreService
from services.gateway.config import GatewayConfig
from services.gateway.http.app import build_app
from services.model_files.tokenizer_loading import load_tokenizer
from services.runtime.rpc.server import start_service
from tests.gateway.in_memory_store import StubStore, gateway_parts

pytestmark = pytest.mark.integration

ADMIN, BOB = {"authorization": "Bearer key-admin"}, {"authorization": "Bearer key-bob"}


@dataclass
class LoadDirGateway:
    http: httpx.AsyncClient
    store: adapter_store_pb2_grpc.AdapterStoreStub
    load_dir: Path
    outside: Path
    """A directory beside the load dir, holding an adapter."""


@pytest.fixture
async def gateway(tmp_path, base_spec, etcd) -> AsyncIterator[LoadDirGateway]:
    """A gateway (tenants admin and bob; ``--adapter-load-dirs loras``) over a real store whose
    policy grants ``admin`` ``file://`` of ``loras`` (as ``loramesh up`` writes it) and whose
    upload limit is 1 MiB; ``loras/a`` and ``outside/a`` hold a small adapter each."""
    spec = SampleAdapterSpec(rank=4, target_modules=("q_proj", "v_proj"))
    load_dir, outside = tmp_path / "loras", tmp_path / "outside"
    for directory in (load_dir, outside):
        write_peft_adapter(directory / "a", base_spec, spec)
    policy = tmp_path / "import-policy.json"
    policy.write_text(json.dumps({"tenants": {"admin": [load_dir.as_uri()]}}))
    config = AdapterStoreConfig(
        data_dir=str(tmp_path / "store"),
        etcd_endpoints=etcd.endpoint,
        grace_s=1,
        import_policy_file=str(policy),
        max_adapter_mib=1,
    )
    store = await start_service(AdapterStoreService(config), config)
    try:
        async with aio.insecure_channel(store.address) as channel:
            stub = adapter_store_pb2_grpc.AdapterStoreStub(channel)
            parts = gateway_parts(
                "key-admin=admin,key-bob=bob",
                StubStore(stub),
                load_tokenizer(),
                config=GatewayConfig(adapter_load_dirs=str(load_dir)),
            )
            transport = httpx.ASGITransport(app=build_app(parts))
            async with httpx.AsyncClient(transport=transport, base_url="http://gateway/v1") as http:
                yield LoadDirGateway(http, stub, load_dir, outside)
    finally:
        await store.shutdown()


async def load(gateway: LoadDirGateway, headers: dict[str, str], name: str, path: str) -> httpx.Response:
    return await gateway.http.post(
        "/load_lora_adapter", json={"lora_name": name, "lora_path": path}, headers=headers
    )


def refusal(reply: httpx.Response) -> tuple[int, str]:
    return reply.status_code, reply.json()["error"]["message"]


async def test_a_path_under_the_load_dirs_loads_for_the_tenant_granted_it_only(gateway):
    status, message = refusal(await load(gateway, BOB, "a", "a"))
    assert status == 403
    assert message == (
        f"tenant 'bob' may not import from {(gateway.load_dir / 'a').as_uri()} (the store's "
        "--import-policy-file grants it no source covering it)"
    )
    assert (await load(gateway, BOB, "a", str(gateway.load_dir / "a"))).status_code == 403

    loaded = await load(gateway, ADMIN, "a", "a")
    assert loaded.status_code == 200, loaded.text
    assert loaded.text == "Success: LoRA adapter 'a' added successfully."
    listed = await gateway.store.ListAdapters(adapter_store_pb2.ListAdaptersRequest())
    assert [(a.owner, a.name) for a in listed.adapters] == [("admin", "a")]


async def test_a_link_out_of_the_load_dir_is_refused(gateway):
    (gateway.load_dir / "escape").symlink_to(gateway.outside / "a")
    status, message = refusal(await load(gateway, ADMIN, "escape", "escape"))
    assert (status, message) == (403, "'escape' is not under a directory the gateway may load adapters from")

    linked = gateway.load_dir / "linked"
    linked.mkdir()
    (linked / "adapter_config.json").write_bytes((gateway.outside / "a" / "adapter_config.json").read_bytes())
    (linked / "adapter_model.safetensors").symlink_to(gateway.outside / "a" / "adapter_model.safetensors")
    status, message = refusal(await load(gateway, ADMIN, "linked", "linked"))
    assert status == 403
    assert message == (
        f"file://{linked}/adapter_model.safetensors is a symbolic link: links are not followed"
    )


async def test_an_adapter_over_the_size_limit_is_refused_before_it_is_read(gateway, monkeypatch):
    big = gateway.load_dir / "big"
    big.mkdir()
    (big / "adapter_config.json").write_bytes((gateway.load_dir / "a" / "adapter_config.json").read_bytes())
    (big / "adapter_model.safetensors").touch()
    os.truncate(big / "adapter_model.safetensors", 64 << 30)  # sparse: 64 GiB listed, none on disk
    read = []
    monkeypatch.setattr(FileSource, "read", lambda self, file, max_bytes: read.append(file.name))
    status, message = refusal(await load(gateway, ADMIN, "big", "big"))
    assert status == 429 and message.endswith(
        f"(largest file://{big}/adapter_model.safetensors, {64 << 30} bytes), over the size limit "
        f"of {1 << 20} bytes"
    )
    assert read == []  # refused from the listing
