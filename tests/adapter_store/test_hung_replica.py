"""A store replica that hangs (SIGSTOP: its connections stay open, its etcd lease outlives this
test, nothing answers) while the workers and gateways read and write through it: their reads
and the gateways' writes are made on the other replica, through the clients they use (the
worker's :class:`StoreSource`, the gateway's store client), with a real etcd and two real store
processes. A write is never sent to the stopped replica: it did not answer the probe made first."""

from __future__ import annotations

import asyncio
import signal

import grpc
import pytest
from support.polling import HANG_GUARD_S
from support.store_replicas import Prefer

from mesh_api.adapter_transfer import ref_by_name, upload_adapter
from mesh_api.upload_wire import WireUploadAdapterStoreStub, upload_wire
from mesh_api.v1 import adapter_store_pb2 as pb
from mesh_api.v1 import adapter_store_pb2_grpc
from services.gateway.service import _Located, _StoreClient
from services.gpu_worker.adapter_source import StoreSource
from services.runtime.etcd import discovery
from services.runtime.etcd.discovery import ChannelPool, ServiceLocator
from services.runtime.process.process import ServiceProcess

pytestmark = pytest.mark.integration

LEASE_TTL_S = 600
"""The replicas' lease: the hung one stays listed in etcd for the whole test, as it does for a
while after it hangs (the clients must not rely on its lease running out)."""


NO_KEEPALIVE = [option for option in discovery.CHANNEL_OPTIONS if "keepalive" not in option[0]]


def start_replicas(etcd_endpoint: str, tmp_path) -> list[ServiceProcess]:
    return [
        ServiceProcess(
            "adapter_store",
            ["--etcd-endpoints", etcd_endpoint, "--lease-ttl-s", str(LEASE_TTL_S),
             "--data-dir", str(tmp_path / f"store{i}"), "--blob-store", str(tmp_path / "blobs")],
            log_path=tmp_path / f"store{i}.log",
        ).start()
        for i in range(2)
    ]  # fmt: skip


class _NotingWrites:
    """The gateway's store stubs, noting the channel each write is sent on."""

    WRITES = ("RegisterAdapter", "ImportAdapter", "DeleteAdapter")

    def __init__(self):
        self.sent_on: list[tuple[str, object]] = []

    def __call__(self, channel) -> WireUploadAdapterStoreStub:
        stub = WireUploadAdapterStoreStub(channel)
        for method in self.WRITES:
            setattr(stub, method, self._noted(method, channel, getattr(stub, method)))
        return stub

    def _noted(self, method: str, channel, call):
        def noted(*args, **kwargs):
            self.sent_on.append((method, channel))
            return call(*args, **kwargs)

        return noted


async def _wire(name: str, files: dict[str, bytes]):
    """An upload as the gateway relays it: a one-shot stream of wire messages."""
    for wire in upload_wire(files, name, owner="alice"):
        yield wire


async def test_reads_and_writes_go_to_the_other_replica_while_one_is_stopped(
    etcd, tmp_path, sample_files, seeded_files, monkeypatch
):
    replicas = start_replicas(etcd.endpoint, tmp_path)
    hung, live = replicas
    source = StoreSource(etcd_endpoints=etcd.endpoint)
    channels = ChannelPool()
    stubs = _NotingWrites()

    def gateway_store() -> _StoreClient:
        """A gateway's store client whose first pick is the replica about to hang (a locator of
        its own: each gateway of a mesh has one)."""
        return _StoreClient(
            _Located(ServiceLocator("adapter_store", "", etcd.endpoint), channels, stubs), None
        )

    reader = gateway_store()
    try:
        for replica in replicas:
            await replica.wait_ready(HANG_GUARD_S)
        async with discovery.aio_channel(
            hung.address, source._channels.tls, discovery.CHANNEL_OPTIONS
        ) as channel:
            info = await upload_adapter(
                adapter_store_pb2_grpc.AdapterStoreStub(channel), sample_files, "a", "alice"
            )
        # Both clients pick the replica about to hang, and are connected to it when it does. Their
        # channels have no keepalive here: what finds the hung replica must be the clients' own
        # bound, not a ping's timeout (which finds it too, up to 30 s after its last answer, as
        # long as a gateway's read may take in all).
        monkeypatch.setattr(discovery, "random", Prefer(hung.address))
        monkeypatch.setattr(discovery, "CHANNEL_OPTIONS", NO_KEEPALIVE)
        assert b"".join((await source.fetch(info.id)).weights) == sample_files["adapter_model.safetensors"]
        assert (await reader.get("alice", "a")).id == info.id
        hung.signal(signal.SIGSTOP)

        async def worker_reads():
            return await source.fetch(info.id), await source.pinned_ids()

        async def gateway_reads():
            listed = await reader.ListAdapters(pb.ListAdaptersRequest(owner="alice"))
            return listed, await reader.get("alice", "a")

        async with asyncio.timeout(HANG_GUARD_S):  # a hang guard, not a timing claim
            (fetched, pinned), (listed, got) = await asyncio.gather(worker_reads(), gateway_reads())
        assert (
            b"".join(fetched.weights) == sample_files["adapter_model.safetensors"] and pinned == frozenset()
        )
        assert [a.id for a in listed.adapters] == [info.id] and got.id == info.id

        # Each write starts at the stopped replica, over the connection made to it before it
        # stopped. Without the probe each would wait for its own deadline (up to 300 s), past the
        # hang guard; with it, only for the probe's bound.
        async with asyncio.timeout(HANG_GUARD_S):  # a hang guard, not a timing claim
            uploaded, imported, deleted = await asyncio.gather(
                gateway_store().RegisterAdapter(_wire("b", seeded_files(1))),
                gateway_store().ImportAdapter(
                    pb.ImportAdapterRequest(uri="file:///nowhere", name="c", owner="alice")
                ),
                gateway_store().DeleteAdapter(pb.DeleteAdapterRequest(ref=ref_by_name("alice", "a"))),
                return_exceptions=True,
            )
            listed = await reader.ListAdapters(pb.ListAdaptersRequest(owner="alice"))
        assert not isinstance(uploaded, BaseException) and uploaded.adapter.name == "b"
        # The import is refused by the replica that answered, for its source, not for want of one.
        assert isinstance(imported, grpc.aio.AioRpcError)
        assert imported.code() not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
        assert not isinstance(deleted, BaseException) and deleted.adapter.id == info.id
        assert [a.name for a in listed.adapters] == ["b"]
        live_channel = channels.get(live.address)
        assert sorted(method for method, channel in stubs.sent_on if channel is live_channel) == sorted(
            _NotingWrites.WRITES
        )
        assert all(channel is live_channel for _, channel in stubs.sent_on)
    finally:
        hung.signal(signal.SIGCONT)
        await source.close()
        await channels.close()
        for replica in replicas:
            replica.kill()
