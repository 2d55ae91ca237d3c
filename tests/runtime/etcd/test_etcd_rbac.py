"""etcd RBAC from the certificates' CNs (a real etcd with ``--client-cert-auth``): each instance
registers, reports its load and campaigns as itself, and no certificate can register as another
instance; the operator reads everything and writes nothing, nor is it etcd's root (only ``admin``
is); a certificate without a user is refused."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest
from aetcd.exceptions import ClientError
from aetcd.rpc import rpc_pb2, rpc_pb2_grpc

from services.gateway.shared_quota import SharedQuota
from services.kv_manager.service import KVManagerService
from services.runtime.errors import Unavailable
from services.runtime.etcd.etcd_rbac import ETCD_ROOT, LEADER_ELECTIONS, OPERATOR, provision_etcd_rbac
from services.runtime.etcd.etcd_server import EtcdServer
from services.runtime.etcd.leader_election import LeaderElection, leader_key
from services.runtime.etcd.membership import (
    MemberInfo,
    MemberRegistration,
    MembershipConfig,
    list_members,
    read_loads,
)
from services.runtime.security.certificates import CertificateDirectory, create_mesh_certificates
from services.runtime.security.identity import MeshIdentity
from services.runtime.security.tls import aio_channel, etcd_client
from services.scheduler.service import REBALANCER_ELECTION

pytestmark = pytest.mark.integration

HANG_GUARD_S = 30
"""Hang guard only."""

WORKER, OTHER, SCHEDULER, GATEWAY = (
    MeshIdentity("gpu_worker", "gpu_worker-0"),
    MeshIdentity("gpu_worker", "gpu_worker-1"),
    MeshIdentity("scheduler", "scheduler-0"),
    MeshIdentity("gateway", "gateway-0"),
)


@pytest.fixture(scope="module")
def certs(tmp_path_factory) -> CertificateDirectory:
    identities = [WORKER, OTHER, SCHEDULER, GATEWAY, "gpu_worker", "etcd", ETCD_ROOT, OPERATOR]
    return create_mesh_certificates(tmp_path_factory.mktemp("certs"), identities)


@pytest.fixture
async def etcd(tmp_path, certs):
    server = EtcdServer(tmp_path / "etcd", tls=certs.tls_for("etcd")).start()
    try:
        await provision_etcd_rbac(
            server.endpoint, certs.tls_for(ETCD_ROOT), [WORKER, OTHER, SCHEDULER, GATEWAY]
        )
        yield server
    finally:
        server.stop()


def config(etcd: EtcdServer, certs: CertificateDirectory, identity) -> MembershipConfig:
    return MembershipConfig(
        etcd_endpoints=etcd.endpoint, tls=certs.tls_for(identity), register_timeout_s=0, ttl_s=2
    )


def member(identity: MeshIdentity) -> MemberInfo:
    return MemberInfo(identity.kind, identity.instance, "127.0.0.1:1", "127.0.0.1:2", "0", time.time())


async def test_an_instance_registers_as_itself_and_not_as_another(etcd, certs):
    mine = await MemberRegistration(config(etcd, certs, WORKER), member(WORKER), lambda: {"queue": 1}).start()
    try:
        with pytest.raises(Unavailable, match="permission denied"):
            await MemberRegistration(config(etcd, certs, WORKER), member(OTHER)).start()
        with pytest.raises(Unavailable, match="permission denied"):  # a scheduler posing as a worker
            await MemberRegistration(config(etcd, certs, SCHEDULER), member(WORKER)).start()
        with pytest.raises(Unavailable):  # a kind's shared certificate has no etcd user
            await MemberRegistration(config(etcd, certs, "gpu_worker"), member(WORKER)).start()
        # Every instance reads the mesh; the operator too.
        for reader in (OTHER, OPERATOR):
            listed = await list_members(config(etcd, certs, reader))
            assert [(m.service, m.instance_id) for m in listed] == [("gpu_worker", WORKER.instance)]
        assert (await read_loads(config(etcd, certs, OTHER)))[WORKER.instance]["queue"] == 1
    finally:
        await mine.stop()
    assert await list_members(config(etcd, certs, OPERATOR)) == []  # its own lease, revoked


async def test_the_operator_reads_but_writes_nothing_and_is_not_etcds_root(etcd, certs):
    operator = config(etcd, certs, OPERATOR)
    with pytest.raises(Unavailable, match="permission denied"):
        await MemberRegistration(operator, member(WORKER)).start()
    host, port = operator.endpoints()[0]
    async with etcd_client(host, port, operator.tls, timeout=HANG_GUARD_S) as client:
        with pytest.raises(ClientError, match="permission denied"):
            await client.put(b"/loramesh/members/gpu_worker/forged", b"{}")
    listing = rpc_pb2.AuthUserListRequest()
    async with aio_channel(f"{host}:{port}", certs.tls_for(OPERATOR)) as channel:
        with pytest.raises(grpc.aio.AioRpcError, match="permission denied"):
            await rpc_pb2_grpc.AuthStub(channel).UserList(listing, timeout=HANG_GUARD_S)
    async with aio_channel(f"{host}:{port}", certs.tls_for(ETCD_ROOT)) as channel:
        users = (await rpc_pb2_grpc.AuthStub(channel).UserList(listing, timeout=HANG_GUARD_S)).users
    assert {"root", str(ETCD_ROOT), str(OPERATOR), str(WORKER)} <= set(users)


async def test_a_scheduler_campaigns_in_its_election_only(etcd, certs):
    scheduler = config(etcd, certs, SCHEDULER)
    election = LeaderElection(scheduler, REBALANCER_ELECTION, SCHEDULER.instance)
    await election.start()
    try:
        await asyncio.wait_for(election.wait_decided(), HANG_GUARD_S)
        assert election.is_leader
    finally:
        await election.stop()
    host, port = scheduler.endpoints()[0]
    async with etcd_client(host, port, scheduler.tls, timeout=HANG_GUARD_S) as client:
        with pytest.raises(ClientError, match="permission denied"):
            await client.put(leader_key(scheduler, KVManagerService.name).encode(), b"scheduler-0")


async def test_a_gateway_takes_and_frees_its_tenants_slots_and_a_worker_cannot_write_them(etcd, certs):
    gateway = config(etcd, certs, GATEWAY)
    for _ in range(2):  # the second time: the first's slot was freed by revoking its lease
        shared = SharedQuota(gateway, GATEWAY.instance)
        await shared.start()
        try:
            assert await shared.take("alice", 1) is not None
            assert await shared.take("alice", 1) is None
        finally:
            await shared.close()
    host, port = gateway.endpoints()[0]
    async with etcd_client(host, port, certs.tls_for(WORKER), timeout=HANG_GUARD_S) as client:
        with pytest.raises(ClientError, match="permission denied"):
            await client.put(f"{gateway.key_prefix}/gateway/slots/alice/0".encode(), b"gpu_worker-0")


async def test_provisioning_again_on_an_etcd_with_auth_on_adds_what_is_missing(etcd, certs, tmp_path):
    late = MeshIdentity("gpu_worker", "gpu_worker-9")
    late_certs = create_mesh_certificates(certs.path, [late])
    await provision_etcd_rbac(etcd.endpoint, certs.tls_for(ETCD_ROOT), [WORKER, late])
    registration = await MemberRegistration(config(etcd, late_certs, late), member(late)).start()
    await registration.stop()


def test_the_elections_are_the_services_own():
    assert LEADER_ELECTIONS == {"scheduler": (REBALANCER_ELECTION,), "kv_manager": (KVManagerService.name,)}
