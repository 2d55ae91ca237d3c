"""The gateway's adapter store client with several store replicas: a call that meets a replica
that died (still listed in etcd: its lease lingers) is made on another; an upload is sent again
from its first message; and an upload the dead replica committed before its answer was lost is
answered as the success it was."""

from __future__ import annotations

import contextlib
import hashlib

import grpc
import pytest
from grpc import aio
from support.polling import poll_until
from support.store_replicas import Prefer, store_replicas

from bench.sample_adapters import SampleAdapterSpec, adapter_files, write_peft_adapter
from mesh_api.adapter_transfer import ref_by_name
from mesh_api.upload_wire import WireUploadAdapterStoreStub, upload_wire
from mesh_api.v1 import adapter_store_pb2
from services.gateway.adapter_index import AdapterIndex
from services.gateway.etcd_catalog_watch import EtcdCatalogWatch
from services.gateway.service import _Located, _StoreClient
from services.runtime.etcd import discovery, prefix_follower
from services.runtime.etcd.discovery import ChannelPool, ServiceLocator
from services.runtime.etcd.membership import MembershipConfig

WEIGHTS = "adapter_model.safetensors"


@pytest.fixture
def seeded(base_spec, tmp_path):
    """``seeded(seed)``: an adapter's files, whose weights differ with the seed."""

    def files(seed: int) -> dict[str, bytes]:
        directory = write_peft_adapter(tmp_path / f"a{seed}", base_spec, SampleAdapterSpec(rank=8, seed=seed))
        return adapter_files(directory)

    return files


async def _messages(files: dict[str, bytes], name: str):
    """The upload as the gateway relays it: a one-shot stream of wire messages."""
    for wire in upload_wire(files, name, owner="alice"):
        yield wire


def _unavailable(details: str) -> aio.AioRpcError:
    return aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, aio.Metadata(), aio.Metadata(), details)


class _Stubs:
    """The store client's stubs, the first ``RegisterAdapter`` made through ``first_upload``."""

    def __init__(self, first_upload):
        self.first_upload = first_upload
        self.uploads = 0

    def __call__(self, channel) -> WireUploadAdapterStoreStub:
        stub = WireUploadAdapterStoreStub(channel)
        real = stub.RegisterAdapter

        async def register(requests, **kwargs):
            self.uploads += 1
            if self.uploads == 1:
                return await self.first_upload(real, requests, **kwargs)
            return await real(requests, **kwargs)

        stub.RegisterAdapter = register
        return stub


async def _reply_lost(real, requests, **kwargs):
    """The upload goes through, and its answer never arrives (the replica died meanwhile)."""
    await real(requests, **kwargs)
    raise _unavailable("the replica died before it answered")


async def _never_sent(real, requests, **kwargs):
    raise _unavailable("the replica could not be reached")


async def _broken_midway(real, requests, **kwargs):
    """The replica takes the first two messages, then the connection breaks."""
    taken = 0
    async for _ in requests:
        taken += 1
        if taken == 2:
            raise _unavailable("the connection broke mid-upload")
    raise AssertionError("the upload has more than two messages")


@contextlib.asynccontextmanager
async def _client(etcd, stub_class=WireUploadAdapterStoreStub):
    """A store client of its own: its first call looks a replica up afresh."""
    channels = ChannelPool()
    locator = ServiceLocator("adapter_store", etcd_endpoints=etcd.endpoint)
    try:
        yield _StoreClient(_Located(locator, channels, stub_class), catalog=None)
    finally:
        await channels.close()


@pytest.mark.integration
async def test_every_store_call_is_made_on_the_live_replica_when_the_other_crashed(
    seeded, tmp_path, etcd, monkeypatch
):
    files = seeded(1)
    async with store_replicas(tmp_path / "stores", etcd.endpoint) as replicas:
        dead = await replicas.crash(0)
        assert await replicas.listed() == sorted(replicas.addresses)  # the dead one still listed
        monkeypatch.setattr(discovery, "random", Prefer(dead))  # and each client below tries it first
        async with _client(etcd) as store:
            uploaded = (await store.RegisterAdapter(_messages(files, "sql"))).adapter
        assert uploaded.owner == "alice" and uploaded.name == "sql"
        async with _client(etcd) as store:
            watch = store.watch(refresh=False)
            first = await anext(watch)
            await watch.aclose()
        assert first.synced and [a.id for a in first.upserted] == [uploaded.id]
        async with _client(etcd) as store:
            assert (await store.get("alice", "sql")).id == uploaded.id
        async with _client(etcd) as store:
            listing = await store.ListAdapters(adapter_store_pb2.ListAdaptersRequest(owner="alice"))
        assert [a.id for a in listing.adapters] == [uploaded.id]


@pytest.mark.integration
@pytest.mark.parametrize(
    "first_upload",
    [
        # Committed, and the answer lost: the retry meets ALREADY_EXISTS of the upload's own commit.
        _reply_lost,
        # Broken midway: the retry sends the whole upload again, from its first message.
        _broken_midway,
    ],
)
async def test_an_upload_whose_first_replica_failed_is_answered_as_the_success_it_is(
    first_upload, seeded, tmp_path, etcd, monkeypatch
):
    files = seeded(1)
    async with store_replicas(tmp_path / "stores", etcd.endpoint) as replicas:
        monkeypatch.setattr(discovery, "random", Prefer(replicas.addresses[0]))
        stubs = _Stubs(first_upload)
        async with _client(etcd, stubs) as store:
            reply = await store.RegisterAdapter(_messages(files, "sql"))
            stored = await store.get("alice", "sql")
    assert stubs.uploads == 2 and reply.adapter.version == 1 and reply.adapter.id == stored.id
    assert stored.sha256 == hashlib.sha256(files[WEIGHTS]).hexdigest()


@pytest.mark.integration
async def test_a_retried_upload_whose_name_holds_other_weights_stays_already_exists(
    seeded, tmp_path, etcd, monkeypatch
):
    async with store_replicas(tmp_path / "stores", etcd.endpoint) as replicas:
        monkeypatch.setattr(discovery, "random", Prefer(replicas.addresses[0]))
        async with _client(etcd) as store:
            await store.RegisterAdapter(_messages(seeded(1), "sql"))
            # Not retried: the same weights again are a duplicate, as ever.
            with pytest.raises(aio.AioRpcError) as duplicate:
                await store.RegisterAdapter(_messages(seeded(1), "sql"))
            assert duplicate.value.code() == grpc.StatusCode.ALREADY_EXISTS
        stubs = _Stubs(_never_sent)
        async with _client(etcd, stubs) as store:
            with pytest.raises(aio.AioRpcError) as refused:
                await store.RegisterAdapter(_messages(seeded(2), "sql"))
    assert refused.value.code() == grpc.StatusCode.ALREADY_EXISTS and stubs.uploads == 2


async def test_a_one_shot_client_stream_is_refused_rather_than_sent_twice():
    located = _Located(
        ServiceLocator("adapter_store", fixed="127.0.0.1:1"), ChannelPool(), WireUploadAdapterStoreStub
    )
    with pytest.raises(TypeError, match="_Replayable"):
        await located.call("RegisterAdapter", _messages({}, "sql"))


@pytest.mark.integration
async def test_the_gateway_lists_the_catalog_from_etcd_while_every_store_replica_is_down(
    seeded, tmp_path, etcd, monkeypatch
):
    """The index watches the rows the replicas commit in etcd, not a replica: it lists with no
    replica alive, in registration order over several read pages, and follows a delete made
    through any replica."""
    monkeypatch.setattr(prefix_follower, "LIST_PAGE_ROWS", 1)
    watch = EtcdCatalogWatch(MembershipConfig(etcd_endpoints=etcd.endpoint))
    async with store_replicas(tmp_path / "stores", etcd.endpoint) as replicas:
        async with _client(etcd) as store:
            kept = (await store.RegisterAdapter(_messages(seeded(1), "kept"))).adapter
            gone = (await store.RegisterAdapter(_messages(seeded(2), "gone"))).adapter
        index = AdapterIndex(watch)
        assert [a.id for a in await index.usable("alice")] == [kept.id, gone.id]
        async with _client(etcd) as store:
            await store.DeleteAdapter(
                adapter_store_pb2.DeleteAdapterRequest(ref=ref_by_name("alice", "gone"))
            )
        await poll_until(
            lambda: index.usable("alice"),
            lambda found: [a.id for a in found] == [kept.id],
            "the delete listed",
        )
        await index.stop()
        for replica in range(len(replicas.hosts)):
            await replicas.crash(replica)
        fresh = AdapterIndex(watch)
        listed = await fresh.usable("alice")
        await fresh.stop()
    await watch.close()
    assert [(a.id, a.name, a.owner, a.max_rank) for a in listed] == [(kept.id, "kept", "alice", 8)]
