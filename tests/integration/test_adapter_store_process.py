"""The adapter store as an operator runs it: a real process, a real etcd, real signals."""

from __future__ import annotations

import asyncio
import hashlib
import signal
import time

import grpc
import pytest
from grpc import aio
from support.etcd_lease import key_lease, lease_alive

from bench.sample_adapters import SampleAdapterSpec, adapter_files, write_peft_adapter
from loramesh_cli.main import main as cli
from mesh_api.adapter_transfer import fetch_adapter, ref_by_name, upload_adapter, upload_requests
from mesh_api.v1 import adapter_store_pb2 as pb
from mesh_api.v1 import adapter_store_pb2_grpc
from services.adapter_store.catalog_keys import CatalogKeys, row_digests
from services.runtime.etcd.membership import (
    EtcdConnection,
    MembershipConfig,
    list_members,
    member_key,
    read_loads,
)
from services.runtime.process.process import ServiceProcess

pytestmark = pytest.mark.integration

CONFIG, WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
TTL_S = 2
HANG_GUARD_S = 60.0  # not a timing claim: only keeps a broken build from hanging the suite


@pytest.fixture
def store_process(tmp_path, etcd):
    processes = []

    def start(grace_s: float = 10, data_dir=None) -> ServiceProcess:
        args = ["--etcd-endpoints", etcd.endpoint, "--lease-ttl-s", str(TTL_S), "--grace-s", str(grace_s),
                "--data-dir", str(data_dir or tmp_path / "store")]  # fmt: skip
        proc = ServiceProcess("adapter_store", args, log_path=tmp_path / f"store{len(processes)}.log").start()
        processes.append(proc)
        return proc

    yield start
    for proc in processes:
        proc.kill()


@pytest.fixture(scope="module")
def adapters(base_spec, tmp_path_factory) -> list[dict[str, bytes]]:
    root = tmp_path_factory.mktemp("adapters")
    return [
        adapter_files(
            write_peft_adapter(root / f"a{i}", base_spec, SampleAdapterSpec(rank=8 * (i + 1), seed=i))
        )
        for i in range(4)
    ]


async def members(etcd, service="adapter_store") -> list:
    return await list_members(MembershipConfig(etcd_endpoints=etcd.endpoint), service)


async def wait_until(predicate, timeout_s: float, interval_s: float = 0.1):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        result = await predicate()
        if result:
            return result
        await asyncio.sleep(interval_s)
    raise AssertionError(f"condition not met within {timeout_s}s")


async def slow_upload(address: str, files, name: str, started: asyncio.Event, pause_s: float = 0.05):
    """Upload in 64 KiB pieces with pauses, so a signal can land in the middle."""

    async def messages():
        for i, message in enumerate(upload_requests(files, name, "alice")):
            if message.WhichOneof("item") == "chunk":
                data = message.chunk.data
                for start in range(0, len(data), 1 << 16):
                    yield pb.RegisterAdapterRequest(
                        chunk=pb.RegisterAdapterRequest.FileChunk(
                            filename=message.chunk.filename, data=data[start : start + (1 << 16)]
                        )
                    )
                    if i > 1:
                        started.set()
                    await asyncio.sleep(pause_s)
            else:
                yield message

    async with aio.insecure_channel(address) as channel:
        return await adapter_store_pb2_grpc.AdapterStoreStub(channel).RegisterAdapter(messages(), timeout=60)


async def test_member_listed_by_status_and_gone_within_ttl_after_kill9(store_process, etcd, capsys):
    store = store_process()
    await store.wait_ready()
    found = await wait_until(lambda: members(etcd), HANG_GUARD_S)
    assert found[0].address == store.address and found[0].http_address == store.http_address

    assert await asyncio.to_thread(cli, ["status", "--etcd", etcd.endpoint]) == 0
    out = capsys.readouterr().out
    assert "adapter_store" in out and "SERVING" in out and store.address in out and "adapters=0" in out

    # Gone within the TTL is etcd's promise for a lease nobody refreshes: check the lease, then wait.
    config = MembershipConfig(etcd_endpoints=etcd.endpoint)
    lease = await key_lease(etcd.endpoint, member_key(config, "adapter_store", found[0].instance_id))
    assert lease is not None and lease.lease_id and lease.granted_ttl_s == TTL_S
    store.signal(signal.SIGKILL)
    await wait_until(lambda: _none(members(etcd)), HANG_GUARD_S)
    assert not await lease_alive(etcd.endpoint, lease.lease_id)


async def catalog_rows(etcd) -> list[dict[str, str]]:
    """The blob digests of each row of the adapter catalog, read from etcd itself."""
    connection = EtcdConnection(MembershipConfig(etcd_endpoints=etcd.endpoint))
    try:
        rows = await connection.call(lambda c: c.get_prefix(CatalogKeys.under("/loramesh").rows.encode()))
        return [row_digests(kv.value) for kv in rows]
    finally:
        await connection.close()


async def _none(coro) -> bool:
    return not await coro


@pytest.mark.parametrize("wipe", [False, True], ids=["same-data", "wiped-data"])
async def test_reregisters_after_etcd_restart_without_restarting(store_process, etcd, wipe):
    store = store_process()
    await store.wait_ready()
    before = (await wait_until(lambda: members(etcd), HANG_GUARD_S))[0]
    await wait_until(lambda: read_loads(MembershipConfig(etcd_endpoints=etcd.endpoint)), HANG_GUARD_S)
    etcd.stop()
    await asyncio.sleep(TTL_S + 0.5)  # the lease runs out while etcd is away
    await asyncio.to_thread(etcd.restart, wipe=wipe)
    after = (await wait_until(lambda: members(etcd), HANG_GUARD_S))[0]
    assert after.instance_id == before.instance_id and store.proc.poll() is None


async def test_sigterm_lets_an_upload_in_flight_complete_then_exits_0(store_process, adapters, etcd):
    store = store_process(grace_s=20)
    await store.wait_ready()
    started = asyncio.Event()
    upload = asyncio.create_task(slow_upload(store.address, adapters[1], "inflight", started))
    await started.wait()
    store.signal(signal.SIGTERM)
    reply = await upload
    assert reply.adapter.sha256 == hashlib.sha256(adapters[1][WEIGHTS]).hexdigest()
    assert await asyncio.to_thread(store.proc.wait, 30) == 0
    assert await members(etcd) == []

    again = store_process()
    await again.wait_ready()
    async with aio.insecure_channel(again.address) as channel:
        _, data = await fetch_adapter(
            adapter_store_pb2_grpc.AdapterStoreStub(channel), ref_by_name("alice", "inflight")
        )
    assert data == adapters[1][WEIGHTS]


async def test_sigterm_past_the_grace_refuses_the_upload_cleanly(store_process, adapters, tmp_path, etcd):
    store = store_process(grace_s=0.5)
    await store.wait_ready()
    started = asyncio.Event()
    upload = asyncio.create_task(slow_upload(store.address, adapters[3], "cut", started, pause_s=0.2))
    await started.wait()
    store.signal(signal.SIGTERM)
    with pytest.raises(grpc.RpcError) as err:
        await upload
    assert err.value.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED)
    assert await asyncio.to_thread(store.proc.wait, 30) == 0
    assert list((tmp_path / "store" / "sha256").iterdir()) == [] and await catalog_rows(etcd) == []


async def test_kill9_mid_upload_keeps_every_committed_adapter_and_nothing_partial(
    store_process, adapters, tmp_path, etcd
):
    store = store_process()
    await store.wait_ready()
    async with aio.insecure_channel(store.address) as channel:
        stub = adapter_store_pb2_grpc.AdapterStoreStub(channel)
        committed = {
            f"c{i}": (await upload_adapter(stub, adapters[i], f"c{i}", "alice")).sha256 for i in range(3)
        }
    started = asyncio.Event()
    upload = asyncio.create_task(slow_upload(store.address, adapters[3], "interrupted", started))
    await started.wait()
    store.kill()
    with pytest.raises(grpc.RpcError):
        await upload

    again = store_process()
    await again.wait_ready()
    async with aio.insecure_channel(again.address) as channel:
        stub = adapter_store_pb2_grpc.AdapterStoreStub(channel)
        listed = await stub.ListAdapters(pb.ListAdaptersRequest(owner="alice"))
        assert sorted(a.name for a in listed.adapters) == ["c0", "c1", "c2"]
        for i, (name, sha) in enumerate(committed.items()):
            info, data = await fetch_adapter(stub, ref_by_name("alice", name))
            assert hashlib.sha256(data).hexdigest() == sha == info.sha256 and data == adapters[i][WEIGHTS]
        with pytest.raises(grpc.RpcError) as err:
            await stub.GetAdapter(pb.GetAdapterRequest(ref=ref_by_name("alice", "interrupted")))
        assert err.value.code() == grpc.StatusCode.NOT_FOUND
    rows = await catalog_rows(etcd)
    assert sorted(row["sha256"] for row in rows) == sorted(committed.values())
    # Every blob on disk is one of a committed row's (its weights, its config), and nothing is staged.
    data_dir = tmp_path / "store"
    referenced = {digest for row in rows for digest in row.values()}
    assert {path.name for path in (data_dir / "sha256").iterdir()} == referenced
    assert list((data_dir / "staging").iterdir()) == []
