"""The gateway's index of adapters (issue 30): ``/v1/models`` and ``ListModels`` list from it,
not by paging the store per call; it follows the store's changes, made through this gateway (read
at once by the caller) or anywhere else, and lists afresh when its watch breaks."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import httpx
import pytest
from grpc import aio
from support.polling import poll_until

from bench.sample_adapters import SampleAdapterSpec, adapter_files, write_peft_adapter
from mesh_api.adapter_transfer import ref_by_name, upload_requests
from mesh_api.upload_wire import WireUploadAdapterStoreStub, read_upload_message, upload_wire
from mesh_api.v1 import adapter_store_pb2, adapter_store_pb2_grpc, types_pb2
from services.adapter_store.config import AdapterStoreConfig
from services.adapter_store.service import AdapterStoreService
from services.gateway.adapter_index import AdapterIndex, IndexTimeouts
from services.gateway.http.app import build_app
from services.model_files.tokenizer_loading import load_tokenizer
from services.runtime.errors import Unavailable
from services.runtime.rpc.server import start_service
from tests.gateway.in_memory_store import gateway_parts

PUBLIC, PRIVATE = types_pb2.VISIBILITY_PUBLIC, types_pb2.VISIBILITY_PRIVATE


def info(adapter_id: str, owner: str, visibility=PRIVATE) -> types_pb2.AdapterInfo:
    return types_pb2.AdapterInfo(id=adapter_id, name=f"n-{adapter_id}", owner=owner, visibility=visibility)


class ScriptedWatch:
    """A catalog watch fed by the test: each ``watch`` call is one stream of queued messages;
    ``None`` breaks it as an unreachable store would."""

    def __init__(self) -> None:
        self.streams: asyncio.Queue[asyncio.Queue] = asyncio.Queue()
        self.opened = 0

    async def watch(self, refresh: bool) -> AsyncIterator[adapter_store_pb2.WatchAdaptersResponse]:
        self.opened += 1
        messages = await self.streams.get()
        while (message := await messages.get()) is not None:
            yield message
        raise Unavailable("the store went away")


async def test_the_index_lists_own_and_public_adapters_in_order_and_relists_after_a_break():
    source = ScriptedWatch()
    index = AdapterIndex(source, IndexTimeouts(retry_s=0))
    first: asyncio.Queue = asyncio.Queue()
    await source.streams.put(first)
    index.start()
    await first.put(
        adapter_store_pb2.WatchAdaptersResponse(upserted=[info("a1", "alice"), info("b1", "bob", PUBLIC)])
    )
    await first.put(
        adapter_store_pb2.WatchAdaptersResponse(
            upserted=[info("b2", "bob"), info("a2", "alice")], synced=True
        )
    )
    assert [a.id for a in await index.usable("alice")] == ["a1", "b1", "a2"]
    assert [a.id for a in await index.usable("bob")] == ["b1", "b2"]
    await first.put(
        adapter_store_pb2.WatchAdaptersResponse(upserted=[info("c1", "carol", PUBLIC)], synced=True)
    )
    await first.put(adapter_store_pb2.WatchAdaptersResponse(deleted_ids=["b1"], synced=True))
    await index.wait_for("b1", present=False)
    assert [a.id for a in await index.usable("alice")] == ["a1", "a2", "c1"]

    second: asyncio.Queue = asyncio.Queue()
    await source.streams.put(second)
    await first.put(None)  # the watch breaks: the last copy serves while the store is listed again
    await poll_until(lambda: asyncio.sleep(0, source.opened), lambda n: n == 2, "a second watch")
    assert [a.id for a in await index.usable("alice")] == ["a1", "a2", "c1"]
    await second.put(adapter_store_pb2.WatchAdaptersResponse(upserted=[info("a2", "alice")], synced=True))

    async def alices() -> list[str]:
        return [a.id for a in await index.usable("alice")]

    await poll_until(alices, lambda ids: ids == ["a2"], "the new listing in place of the old")
    await index.stop()


async def test_a_listing_before_the_first_sync_is_unavailable():
    index = AdapterIndex(ScriptedWatch(), IndexTimeouts(first_listing_s=0))
    with pytest.raises(Unavailable, match="not listed"):
        await index.usable("alice")
    await index.stop()


class CountingStore:
    """The store calls the gateway makes, over a real store's stub, counting listings."""

    def __init__(self, channel: aio.Channel):
        self.stub = WireUploadAdapterStoreStub(channel)
        self.listings = 0

    async def RegisterAdapter(self, requests):
        return await self.stub.RegisterAdapter(requests)

    async def DeleteAdapter(self, request):
        return await self.stub.DeleteAdapter(request)

    async def ListAdapters(self, request):
        self.listings += 1
        return await self.stub.ListAdapters(request)

    async def get(self, owner: str, name: str):
        return await self.stub.GetAdapter(adapter_store_pb2.GetAdapterRequest(ref=ref_by_name(owner, name)))

    def watch(self, refresh: bool):
        return self.stub.WatchAdapters(adapter_store_pb2.WatchAdaptersRequest())


@pytest.mark.integration
async def test_v1_models_is_served_from_the_index_and_follows_registrations_and_deletes(
    tmp_path, base_spec, etcd
):
    files = adapter_files(write_peft_adapter(tmp_path / "a", base_spec, SampleAdapterSpec(rank=4)))
    config = AdapterStoreConfig(data_dir=str(tmp_path / "store"), etcd_endpoints=etcd.endpoint, grace_s=1)
    store = await start_service(AdapterStoreService(config), config)
    async with aio.insecure_channel(store.address) as channel:
        stub = adapter_store_pb2_grpc.AdapterStoreStub(channel)
        client = CountingStore(channel)
        parts = gateway_parts("key-alice=alice,key-bob=bob", client, load_tokenizer())
        await stub.RegisterAdapter(upload_requests(files, "shared", "bob", PUBLIC))
        transport = httpx.ASGITransport(app=build_app(parts))
        try:
            async with httpx.AsyncClient(
                transport=transport, base_url="http://gateway", headers={"authorization": "Bearer key-alice"}
            ) as http:

                async def listed() -> list[str]:
                    reply = await http.get("/v1/models")
                    assert reply.status_code == 200, reply.text
                    return [m["id"] for m in reply.json()["data"][1:]]

                assert await listed() == ["bob/shared"]

                async def upload(name: str):
                    async def messages():
                        for raw in upload_wire(files, name, owner=""):
                            yield read_upload_message(raw)

                    return await parts.admin.upload_adapter("alice", messages())

                await upload("mine")  # through this gateway: listed as soon as the call returns
                assert await listed() == ["bob/shared", "mine"]
                await parts.admin.delete_adapter("alice", "mine")
                assert await listed() == ["bob/shared"]
                # Through the store directly (another gateway, an import): the watch brings it.
                await stub.RegisterAdapter(upload_requests(files, "elsewhere", "alice"))
                await poll_until(
                    listed, lambda ids: ids == ["bob/shared", "elsewhere"], "the watched registration"
                )
                await stub.DeleteAdapter(
                    adapter_store_pb2.DeleteAdapterRequest(ref=ref_by_name("bob", "shared"))
                )
                await poll_until(listed, lambda ids: ids == ["elsewhere"], "the watched delete")
                assert client.listings == 0  # never paged out of the store per call
        finally:
            await parts.catalog.stop()
            await store.shutdown()
